"""A static performance report of the kernels, from their SASS: predicted, not measured.

    python -m benchmarks --static [--out benchmarks/results]

Each kernel variant the runtime launches is compiled for sm_90 without a GPU (`benchmarks.aot`);
the SASS of its cubin gives, per element, the instructions of the path a full, aligned tile takes
(and of one iteration of the update's direction loop), the width of its global loads and stores,
registers and spills. A throughput model of an H100 / H200 SM (assumptions in `MODEL_NOTES`, written
into the report) turns that into a predicted time per element and a share of copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import aot
from benchmarks.model_iteration import DEVICES, POPULATION, Device, NoiseRates, model_iterations
from benchmarks.model_iteration import markdown as model_markdown

# Pipes of an sm_90 SM, in thread-instructions per clock (CUDA C++ Programming Guide, arithmetic
# instruction throughput, compute capability 9.0): what each SASS opcode is charged to.
ISSUE_PER_CLOCK = 128  # 4 schedulers x 1 warp instruction x 32 threads
PIPE_PER_CLOCK = {"fp32": 128, "imad": 64, "alu": 64, "xu": 16}
XU_OPCODES = ("MUFU", "I2F.", "F2I", "F2F", "I2F ")  # special functions and the slow conversions
FP32_OPCODES = ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "HADD2", "HFMA2", "HMUL2")
NO_PIPE = ("BRA", "EXIT", "BSSY", "BSYNC", "NOP", "BAR", "WARPSYNC", "DEPBAR", "YIELD", "CALL", "RET")


MODEL_NOTES = [
    "Predicted, not measured: no GPU was used. SASS from Triton's own ptxas for sm_90 (cuobjdump).",
    "Instructions per element: the path a full, 16-byte-aligned tile takes (the masked tail path is "
    "not counted), divided by the elements each thread handles; loop bodies once per iteration.",
    "Throughput per SM per clock (CUDA programming guide, cc 9.0): 128 issue slots, FP32 128, "
    "IMAD 64 (shares the FMA-heavy pipe with half of the FP32 work), other integer/logic 64, "
    "MUFU and slow conversions 16; uniform-datapath (U*) instructions take issue slots only. "
    "Compute time = the most loaded of these; latency, occupancy and instruction cache are ignored.",
    "132 SMs at 1.755 GHz (a sustained clock under load; the boost clock is 1.98 GHz, which would make "
    "compute-bound figures 13% faster). Copy bandwidth = ~90% of peak HBM: H100 SXM 3.0 TB/s "
    "(3.35 peak), H200 SXM 4.3 TB/s (4.8 peak).",
    "Predicted time per element = max(compute, bytes / copy bandwidth): perfect overlap, an upper bound "
    "on speed. 'Share of copy' = copy time of the same bytes / predicted time.",
]
REPORT_LABELS = [
    "perturb fp32",
    "perturb bf16",
    "perturb fp16",
    "update fp32 apply",
    "update bf16 apply",
    "update bf16 stochastic",
    "update bf16 gradient",
    "fill normal stream=0",
    "fill bits stream=0",
    "virtual_linear bf16 K=64 N=48 rows=1",
    # Sign (Rademacher) noise, docs/noise.md section 6a
    "perturb fp32 sign",
    "perturb bf16 sign",
    "update fp32 apply sign",
    "update bf16 apply sign",
    "update bf16 stochastic sign",
    "update bf16 gradient sign",
    "fill sign stream=4",
    "virtual_linear bf16 K=64 N=48 rows=1 sign",
]
UPDATE_DIRECTIONS = 15  # N = 30 members, antithetic
# virtual_linear at a real shape (Qwen2.5-0.5B's up_proj, K=896 N=4864): 64 rows per member (a decode
# step of 64 prompts: 64-row tiles), a 4096-row prefill (128-row tiles), and the fp32 128-row tile that
# used to spill.
REAL_VIRTUAL = {
    "virtual_linear bf16 K=896 N=4864 rows=64": (torch.bfloat16, 64),
    "virtual_linear bf16 K=896 N=4864 rows=4096": (torch.bfloat16, 4096),
    "virtual_linear fp32 K=896 N=4864 rows=128": (torch.float32, 128),
}


def pipe_of(opcode: str) -> str:
    if opcode.startswith(NO_PIPE) or opcode.startswith(("LD", "ST", "RED", "ATOM", "S2R", "CS2R", "SHFL")):
        return "other"
    if opcode.startswith("U") or opcode in ("R2UR", "S2UR"):
        return "uniform"
    if opcode.startswith(XU_OPCODES) or opcode in ("I2F", "F2I"):
        return "xu"
    if opcode.startswith(FP32_OPCODES):
        return "fp32"
    if opcode.startswith("IMAD"):
        return "imad"
    return "alu"


def fast_path(instructions: list[tuple[int, str, str, str]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Indices of the instructions a full aligned tile executes, and the loops (first, last index).

    Every path from the entry to an EXIT is enumerated (backward branches are loops: not taken on the
    path, counted per iteration by the caller); the fast path is the one that enters the loops, with
    the most 128-bit global accesses, and among those the shortest (the masked path has scalar
    accesses, a tail path none).
    """
    index_of = {address: i for i, (address, *_) in enumerate(instructions)}
    loops = []
    for i, (address, _, opcode, operands) in enumerate(instructions):
        if opcode == "BRA":
            target = int(operands.split()[0].rstrip(";"), 16)
            if target < address:
                loops.append((index_of[target], i))
    paths: list[list[int]] = []

    def walk(i: int, path: list[int]) -> None:
        while i < len(instructions):
            address, predicate, opcode, operands = instructions[i]
            path.append(i)
            if opcode == "EXIT":
                if not predicate:
                    paths.append(path)
                    return
                walk(i + 1, list(path))  # not taken
                paths.append(path)
                return
            if opcode == "BRA":
                target = int(operands.split()[0], 16)
                if target == address:  # the trailing self-loop after the last EXIT
                    return
                if target > address:
                    if predicate:
                        walk(index_of[target], list(path))
                    else:
                        i = index_of[target]
                        continue
            i += 1
        if len(paths) > 4096:
            raise RuntimeError("too many paths through the kernel to enumerate")

    walk(0, [])

    def wide(path: list[int]) -> int:
        return sum(
            instructions[i][2].startswith(("LDG", "STG")) and ".128" in instructions[i][2] for i in path
        )

    def loops_entered(path: list[int]) -> int:
        on_path = set(path)
        return sum(first in on_path for first, _ in loops)

    best = max(paths, key=lambda p: (loops_entered(p), wide(p), -len(p)))
    return best, loops


@dataclass
class KernelReport:
    label: str
    registers: int
    spill_bytes: int
    elements_per_thread: int
    instructions_per_element: float  # outside the loop, along the fast path
    loop_per_element: float  # one iteration of the direction / K loop, per element of that iteration
    pipes_per_element: dict  # outside the loop
    loop_pipes_per_element: dict
    global_accesses: dict  # opcode -> count on the fast path (whole program)
    bytes_per_element: int
    predicted: dict  # device -> figures


def analyse(result, label: str) -> KernelReport:
    """Counts per element along the fast path of one compiled variant (a CompileResult with SASS)."""
    instructions = aot.parse_sass(result.sass)
    path, loops = fast_path(instructions)
    c = result.constexprs
    threads = result.num_warps * 32
    if label.startswith("virtual_linear"):
        per_thread = int(c["BLOCK_N"]) * int(c["BLOCK_K"]) // threads  # noise elements per K-iteration
    else:
        per_thread = int(c["BLOCK"]) // threads
    in_loop = {i for first, last in loops for i in range(first, last + 1)}
    outside = [i for i in path if i not in in_loop]
    body = [i for i in path if i in in_loop]
    pipes = Counter(pipe_of(instructions[i][2]) for i in outside)
    loop_pipes = Counter(pipe_of(instructions[i][2]) for i in body)
    accesses = Counter(instructions[i][2] for i in path if instructions[i][2].startswith(("LDG", "STG")))
    element_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}
    dtype = next((k for k in element_bytes if f" {k}" in label), "fp32")
    size = element_bytes[dtype]
    if label.startswith("perturb"):
        bytes_per_element = 2 * size
    elif label.startswith("update"):
        bytes_per_element = size if "gradient" in label else 2 * size
    elif label.startswith("fill bits"):
        bytes_per_element = 8
    elif label.startswith("fill"):
        bytes_per_element = 4
    else:
        bytes_per_element = 0
    report = KernelReport(
        label=label,
        registers=result.registers,
        spill_bytes=result.spill_bytes,
        elements_per_thread=per_thread,
        instructions_per_element=len(outside) / per_thread,
        loop_per_element=len(body) / per_thread,
        pipes_per_element={k: v / per_thread for k, v in sorted(pipes.items())},
        loop_pipes_per_element={k: v / per_thread for k, v in sorted(loop_pipes.items())},
        global_accesses=dict(sorted(accesses.items())),
        bytes_per_element=bytes_per_element,
        predicted={},
    )
    report.predicted = {d.name: predict(report, d) for d in DEVICES}
    return report


def cycles_per_element(pipes: dict) -> float:
    """SM clocks per element under the pipe model: the most loaded of issue and the pipes."""
    total = sum(pipes.values())
    fp32, imad = pipes.get("fp32", 0.0), pipes.get("imad", 0.0)
    return max(
        total / ISSUE_PER_CLOCK,
        pipes.get("alu", 0.0) / PIPE_PER_CLOCK["alu"],
        imad / PIPE_PER_CLOCK["imad"],
        (imad + fp32) / PIPE_PER_CLOCK["fp32"],
        pipes.get("xu", 0.0) / PIPE_PER_CLOCK["xu"],
    )


def predict(report: KernelReport, device: Device) -> dict:
    """Predicted nanoseconds per element (per 1e9 elements: seconds) and share of copy bandwidth."""
    pipes = Counter(report.pipes_per_element)
    if report.label.startswith("update"):
        for k, v in report.loop_pipes_per_element.items():
            pipes[k] += UPDATE_DIRECTIONS * v
    elif report.label.startswith("virtual_linear"):
        pipes = Counter(report.loop_pipes_per_element)  # per noise element, the K loop dominates
    clock = device.sms * device.clock_ghz * 1e9
    compute_s = cycles_per_element(pipes) / clock
    memory_s = report.bytes_per_element / (device.copy_tb_s * 1e12)
    predicted_s = max(compute_s, memory_s)
    figures = {
        "compute_ns_per_1k": 1e12 * compute_s,
        "memory_ns_per_1k": 1e12 * memory_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
    }
    if memory_s:
        figures["share_of_copy"] = memory_s / predicted_s
    return figures


def virtual_decode_figures(virtual: KernelReport, perturb: KernelReport) -> dict:
    """Virtual vs materialised members at 1B evolved bf16 parameters, 16 members, one row per member.

    Virtual regenerates every member's noise in each forward pass; materialised builds the members'
    weights once per generation (perturb) and then reads 16 weight copies per forward pass.
    """
    parameters, members = 1e9, 16
    out = {}
    for device in DEVICES:
        clock = device.sms * device.clock_ghz * 1e9
        noise_s = members * parameters * cycles_per_element(virtual.loop_pipes_per_element) / clock
        plain_s = 2 * parameters / (device.copy_tb_s * 1e12)  # read the bf16 weights once
        p = perturb.predicted[device.name]
        build_s = members * parameters * 1e-12 * max(p["compute_ns_per_1k"], p["memory_ns_per_1k"])
        out[device.name] = {
            "virtual_ms_per_forward": 1e3 * noise_s,
            "plain_ms_per_forward": 1e3 * plain_s,
            "materialised_ms_per_forward": 1e3 * members * plain_s,
            "materialise_ms_per_generation": 1e3 * build_s,
            "materialised_gib": members * parameters * 2 / 2**30,
        }
    return out


def real_virtual_launches() -> list[aot.Launch]:
    """The launches of REAL_VIRTUAL, recorded on meta tensors (two members)."""
    from fastes.engine.kernels import launch_virtual_linear
    from fastes.engine.ops import triton_dtype

    launches = []
    for label, (dtype, rows) in REAL_VIRTUAL.items():
        x = torch.empty(2 * rows, 896, dtype=dtype, device="meta")
        weight = torch.empty(4864, 896, dtype=dtype, device="meta")
        y = torch.empty(2 * rows, 4864, dtype=dtype, device="meta")
        keys = torch.empty(2, 2, dtype=torch.int64, device="meta")
        scales = torch.empty(2, device="meta")
        with aot.capture() as recorded:
            launch_virtual_linear(x, weight, y, keys, scales, 7, rows, triton_dtype(dtype))
        recorded[0].label = label
        launches += recorded
    return launches


def seconds_per_element(report: KernelReport, device: Device, directions: int = 0) -> float:
    """Predicted seconds per element of a perturb, fill or update kernel (the update over `directions`)."""
    pipes = Counter(report.pipes_per_element)
    for k, v in report.loop_pipes_per_element.items():
        pipes[k] += directions * v
    compute = cycles_per_element(pipes) / (device.sms * device.clock_ghz * 1e9)
    return max(compute, report.bytes_per_element / (device.copy_tb_s * 1e12))


def noise_rates(reports: dict[str, KernelReport], device: Device) -> NoiseRates:
    """The bf16 noise kernels' predicted rates on `device`, for the real-model iteration."""
    clock = device.sms * device.clock_ghz * 1e9
    return NoiseRates(
        perturb=seconds_per_element(reports["perturb bf16"], device),
        update=seconds_per_element(reports["update bf16 apply"], device, directions=POPULATION // 2),
        fill=seconds_per_element(reports["fill normal stream=0"], device),
        virtual_decode=cycles_per_element(
            reports["virtual_linear bf16 K=896 N=4864 rows=64"].loop_pipes_per_element
        )
        / clock,
        virtual_prefill=cycles_per_element(
            reports["virtual_linear bf16 K=896 N=4864 rows=4096"].loop_pipes_per_element
        )
        / clock,
    )


def compile_reports(labels: list[str]) -> dict[str, KernelReport]:
    """Compile the launches of these labels for sm_90 and analyse their SASS, in the order given."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("python -m benchmarks --static compiles for a GPU target: unset TRITON_INTERPRET")
    target = aot.gpu_target("sm_90")
    chosen = {}
    for launch in aot.runtime_launches() + real_virtual_launches():
        if launch.label in labels and launch.label not in chosen:
            chosen[launch.label] = launch
    reports = {}
    for label in labels:
        variant, source, options = aot.specialise(chosen[label], target)
        result = aot.compile_variant(source, options, "sm_90", label)
        if not result.ok:
            raise RuntimeError(f"{label} failed to compile for sm_90: {result.error}")
        reports[label] = analyse(result, label)
    return reports


# What the real-model iteration needs of the kernels (bf16).
RATE_LABELS = [
    "perturb bf16",
    "update bf16 apply",
    "fill normal stream=0",
    "virtual_linear bf16 K=896 N=4864 rows=64",
    "virtual_linear bf16 K=896 N=4864 rows=4096",
]


def predicted_rates() -> dict[str, NoiseRates]:
    """The noise kernels' predicted rates per device (compiles the five variants they need)."""
    reports = compile_reports(RATE_LABELS)
    return {d.name: noise_rates(reports, d) for d in DEVICES}


def run_static(out: Path | None) -> dict:
    """Compile the report's variants for sm_90, analyse them, write the report files into `out`."""
    import triton

    by_label = compile_reports(REPORT_LABELS + list(REAL_VIRTUAL))
    reports = list(by_label.values())
    virtual = next(r for r in reports if r.label.startswith("virtual_linear"))
    perturb = by_label["perturb bf16"]
    data = {
        "kind": "static",
        "predicted_not_measured": True,
        "date": datetime.date.today().isoformat(),
        "triton": triton.__version__,
        "target": "sm_90",
        "update_directions": UPDATE_DIRECTIONS,
        "notes": MODEL_NOTES,
        "kernels": [asdict(r) for r in reports],
        "virtual_decode_1b_16_members": virtual_decode_figures(virtual, perturb),
        "models": model_iterations({d.name: noise_rates(by_label, d) for d in DEVICES}),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"static-sm90-{data['date']}"
        stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
        stem.with_suffix(".md").write_text(markdown(data))
        print(f"wrote {stem}.json and .md")
    print(markdown(data))
    return data


def markdown(data: dict) -> str:
    lines = [
        f"# Static performance report (sm_90) -- predicted, not measured ({data['date']}, triton "
        f"{data['triton']})",
        "",
        "| kernel | instr/element | loop instr/element/iteration | regs | spills | global accesses (fast "
        "path, per thread) | H100: share of copy | H200: share of copy | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in data["kernels"]:
        accesses = ", ".join(f"{n}x {op}" for op, n in k["global_accesses"].items())
        shares = [k["predicted"][d.name].get("share_of_copy") for d in DEVICES]
        share_text = [f"{100 * s:.0f}%" if s is not None else "-" for s in shares]
        loop = f"{k['loop_per_element']:.1f}" if k["loop_per_element"] else "-"
        lines.append(
            f"| {k['label']} | {k['instructions_per_element']:.1f} | {loop} | {k['registers']} | "
            f"{k['spill_bytes']} | {accesses} | {share_text[0]} | {share_text[1]} | "
            f"{k['predicted'][DEVICES[1].name]['bound']} |"
        )
    lines += [
        "",
        f"The update's figures are for {data['update_directions']} directions (N = 30 members, "
        "antithetic); its loop column is per direction.",
        "",
    ]
    lines.append(
        "Population-batched evaluation at 1B evolved bf16 parameters, 16 members, one row per member:"
    )
    lines.append("")
    for name, v in data["virtual_decode_1b_16_members"].items():
        lines.append(
            f"- {name}: virtual noise {v['virtual_ms_per_forward']:.1f} ms per forward pass; materialised "
            f"members {v['materialised_ms_per_forward']:.1f} ms per forward pass (16 weight copies read, "
            f"{v['materialised_gib']:.0f} GiB) plus {v['materialise_ms_per_generation']:.1f} ms per "
            f"generation to build them; plain inference {v['plain_ms_per_forward']:.2f} ms"
        )
    lines += ["", "Assumptions:", ""] + [f"- {n}" for n in data["notes"]]
    lines += [""] + model_markdown(data["models"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the noise kernels' predicted rates per device as JSON (for benchmarks.gpu_check's model step,
    which runs under the interpreter in the tests, where nothing can be compiled for a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.static", description=main.__doc__)
    parser.add_argument("--rates", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    args.rates.write_text(json.dumps({name: asdict(r) for name, r in predicted_rates().items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
