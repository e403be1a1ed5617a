"""Compile the kernels for GPUs on a machine without one: every specialisation the runtime launches.

    python -m fastes.kernels.aot [--targets sm_90,sm_80,gfx942] [--json FILE]

The launch functions (`launch_perturb`, `launch_update`, `launch_fill`, `launch_virtual_linear`) are
called on CPU tensors with Triton's `JITFunction.run` replaced by a recorder (`capture`). Each recorded
launch is specialised by Triton's own binder, exactly as `run` would on a GPU (signature, constexprs,
divisibility attributes), and compiled with `triton.compile` for a `GPUTarget`: PTX and a cubin via the
ptxas shipped in the Triton wheel (AMD: an hsaco). `cuobjdump` from the same wheel gives registers,
local memory and the SASS. Exit status 1 when a launch fails to compile or spills registers.

This needs compiled kernels, so it refuses to run under TRITON_INTERPRET=1 (the test suite starts it in
a subprocess without it). Nothing is launched and no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# (name, triton backend, arch, warp size): the targets checked by default.
TARGETS = {
    "sm_90": ("cuda", 90, 32),
    "sm_80": ("cuda", 80, 32),
    "gfx942": ("hip", "gfx942", 64),
}
# Data values that must never change what is compiled (1 used to become a constexpr; 16 a divisibility
# variant; 2^31 and 2^32 - 1 an i64 one).
EDGE_WORDS = (1, 16, 1 << 31, (1 << 32) - 1)


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments and a label saying what it stands for."""

    kernel: Any
    args: tuple
    kwargs: dict
    grid: tuple
    label: str = ""


@contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record the launches made inside the block instead of running them (no GPU needed)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(
            "fastes.kernels.aot needs compiled kernels; run it in a process without TRITON_INTERPRET=1 "
            "(python -m fastes.kernels.aot)"
        )
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def runtime_launches() -> list[Launch]:
    """The launches fastes makes, over every dtype and mode, with edge values for keys, ids, offsets.

    The label names what should decide the compiled variant (kernel, dtype, mode, shape): launches with
    the same label must specialise identically whatever their keys, tensor ids or offsets.
    """
    import triton.language as tl

    from . import MODE_APPLY, MODE_APPLY_STOCHASTIC, MODE_GRADIENT, build_tile_table, table
    from .noise import launch_fill
    from .perturb import launch_perturb
    from .update import launch_update
    from .virtual_linear import launch_virtual_linear

    block = 1024  # fastes.ops._BLOCK
    sign_block = 2048  # fastes.ops._SIGN_BLOCK: sign noise runs on larger tiles
    dtypes = {
        "fp32": (torch.float32, tl.float32),
        "bf16": (torch.bfloat16, tl.bfloat16),
        "fp16": (torch.float16, tl.float16),
    }
    keys = [(1, 1), (16, 1 << 31), ((1 << 32) - 1, 0), (0x5D25E919, 0x9FA8B4D7)]
    id_sets = [[1, 16], [1 << 31, (1 << 32) - 1]]
    all_launches: list[Launch] = []

    def add(label: str, launch, *args) -> None:
        with capture() as recorded:
            launch(*args)
        for one in recorded:
            one.label = label
        all_launches.extend(recorded)

    for name, (torch_dtype, dtype) in dtypes.items():
        for ids in id_sets:
            tensors = [torch.zeros(37, dtype=torch_dtype), torch.zeros(4096, dtype=torch_dtype)]
            tiles = build_tile_table(tensors, ids, block)
            sign_tiles = build_tile_table(tensors, ids, sign_block)
            outputs = table.addresses([torch.empty_like(t) for t in tensors], torch.device("cpu"))
            for key in keys:
                add(f"perturb {name}", launch_perturb, tiles, outputs, key, 1e-3, dtype)
                add(
                    f"perturb {name} sign",
                    launch_perturb,
                    sign_tiles,
                    outputs,
                    key,
                    1e-3,
                    dtype,
                    "rademacher",
                )
            modes = {"apply": MODE_APPLY, "gradient": MODE_GRADIENT}
            if name != "fp32":
                modes["stochastic"] = MODE_APPLY_STOCHASTIC
            for mode_name, mode in modes.items():
                for directions in (1, 16, 30):
                    key_column = torch.tensor(keys * 8, dtype=torch.int64)[:directions]
                    weights = torch.linspace(-1, 1, directions)
                    grads = [torch.empty_like(t) for t in tensors] if mode == MODE_GRADIENT else None
                    for rounding in [(1, (1 << 32) - 1), (16, 1 << 31)]:
                        add(
                            f"update {name} {mode_name}",
                            launch_update,
                            *(tiles, grads, key_column, weights, 2e-3, 1.0, rounding, mode, dtype),
                        )
                        add(
                            f"update {name} {mode_name} sign",
                            launch_update,
                            *(
                                sign_tiles,
                                grads,
                                key_column,
                                weights,
                                2e-3,
                                1.0,
                                rounding,
                                mode,
                                dtype,
                                "rademacher",
                            ),
                        )
        for members, rows, n_in, n_out in [(2, 1, 64, 48), (3, 17, 64, 48), (2, 3, 37, 33)]:
            x = torch.zeros(members * rows, n_in, dtype=torch_dtype)
            weight = torch.zeros(n_out, n_in, dtype=torch_dtype)
            y = torch.empty(members * rows, n_out, dtype=torch_dtype)
            member_keys = torch.tensor(keys[:members] * 2, dtype=torch.int64)[:members]
            scales = torch.full((members,), 1e-3)
            for tid in EDGE_WORDS:
                add(
                    f"virtual_linear {name} K={n_in} N={n_out} rows={rows}",
                    launch_virtual_linear,
                    *(x, weight, y, member_keys, scales, tid, rows, dtype),
                )
                if rows == 17:  # sign noise: the word path (K = 64) and the per-element path (K = 37)
                    continue  # are covered by the other shapes; fewer variants to compile
                add(
                    f"virtual_linear {name} K={n_in} N={n_out} rows={rows} sign",
                    launch_virtual_linear,
                    *(x, weight, y, member_keys, scales, tid, rows, dtype, None, 32, 32, False, "rademacher"),
                )
            # A Conv1D weight is stored [in, out]: the transposed variant (GPT-2 models).
            conv_weight = torch.zeros(n_in, n_out, dtype=torch_dtype)
            add(
                f"virtual_linear {name} transposed K={n_in} N={n_out} rows={rows}",
                launch_virtual_linear,
                *(x, conv_weight, y, member_keys, scales, 1, rows, dtype),
                *(None, 32, 32, True),  # block_m, block_n, block_k, transposed
            )
            if rows == 17:
                continue
            add(
                f"virtual_linear {name} transposed K={n_in} N={n_out} rows={rows} sign",
                launch_virtual_linear,
                *(x, conv_weight, y, member_keys, scales, 1, rows, dtype),
                *(None, 32, 32, True, "rademacher"),
            )
    for raw_bits in (True, False):
        out = torch.empty(4099, dtype=torch.int64 if raw_bits else torch.float32)
        for key, tid, offset in [((1, 1), 1, 0), ((16, 1 << 31), (1 << 32) - 1, 16), ((0, 0), 16, 1 << 34)]:
            for stream in (0, 1):
                add(
                    f"fill {'bits' if raw_bits else 'normal'} stream={stream}",
                    launch_fill,
                    *(out[: 1 + offset % 4099], key, tid, offset, stream, raw_bits),
                )
    signs = torch.empty(4099, dtype=torch.float32)
    for key, tid, offset in [((1, 1), 1, 0), ((16, 1 << 31), (1 << 32) - 1, 128), ((0, 0), 16, 1 << 34)]:
        add("fill sign stream=4", launch_fill, signs, key, tid, offset, 4, False, 1024, "rademacher")
    return all_launches


@dataclass(frozen=True)
class Specialisation:
    """What Triton compiles for a launch: the cache key of a compiled variant."""

    kernel: str
    signature: tuple
    constexprs: tuple
    attrs: tuple


_binders: dict = {}


def specialise(launch: Launch, target) -> tuple[Specialisation, Any, dict]:
    """Triton's own binder on the recorded arguments: (variant, ASTSource, options), as `run` does."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if (fn, target) not in _binders:
        backend = make_backend(target)
        _binders[fn, target] = backend, create_function_from_signature(fn.signature, fn.params, backend)
    backend, binder = _binders[fn, target]
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    variant = Specialisation(
        fn.__name__,
        tuple(signature.items()),
        tuple(sorted((k, str(v)) for k, v in constexprs.items())),
        tuple(sorted((k, str(v)) for k, v in attrs.items())),
    )
    return variant, ASTSource(fn, signature, constexprs, attrs), options.__dict__


@dataclass
class CompileResult:
    """One variant compiled for one target."""

    kernel: str
    label: str
    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    registers: int = 0
    spill_bytes: int = 0  # local memory per thread (NVIDIA) or spilled registers (AMD)
    num_warps: int = 0
    constexprs: dict = field(default_factory=dict)
    sass: str = ""  # NVIDIA only

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose from {sorted(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def compile_variant(source, options: dict, target_name: str, label: str) -> CompileResult:
    """triton.compile for the target, then registers and spills from the binary (and SASS on NVIDIA)."""
    import triton

    target = gpu_target(target_name)
    start = time.perf_counter()
    result = CompileResult(source.fn.__name__, label, target_name, ok=False)
    result.constexprs = {source.fn.arg_names[k[0]]: str(v) for k, v in source.constants.items()}
    try:
        compiled = triton.compile(source, target=target, options=options)
    except Exception as error:  # a compile failure is a result to report, not a crash of the check
        result.error = f"{type(error).__name__}: {error}".strip()[:2000]
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    result.num_warps = compiled.metadata.num_warps
    if target.backend == "cuda":
        result.registers, result.spill_bytes, result.sass = _cubin_facts(compiled.asm["cubin"])
    else:
        result.registers, result.spill_bytes = _amdgcn_facts(compiled.asm["amdgcn"])
    result.ok = True
    return result


def _cubin_facts(cubin: bytes) -> tuple[int, int, str]:
    """(registers, local memory bytes per thread, SASS text) of a cubin, from cuobjdump."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (
            subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1)) + int(re.search(r"STACK:(\d+)", usage).group(1))
    return registers, local, sass


def _amdgcn_facts(asm: str) -> tuple[int, int]:
    """(VGPRs, spilled VGPRs + SGPRs) from the metadata the AMD backend writes into its assembly."""
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", asm)
    spills = sum(int(n) for n in re.findall(r"\.[vs]gpr_spill_count:\s+(\d+)", asm))
    return int(vgprs.group(1)) if vgprs else 0, spills


def check(
    targets: list[str], labels: str = ""
) -> tuple[list[CompileResult], dict[str, list[Specialisation]]]:
    """Compile every distinct variant the runtime launches (whose label matches `labels`) per target.

    Returns the results and, per label, the distinct variants its launches produced (one is right).
    """
    launches = [launch for launch in runtime_launches() if re.search(labels, launch.label)]
    results: list[CompileResult] = []
    for target_name in targets:
        target = gpu_target(target_name)
        variants: dict[Specialisation, tuple[Any, dict, str]] = {}
        per_label: dict[str, set] = {}
        for launch in launches:
            variant, source, options = specialise(launch, target)
            variants.setdefault(variant, (source, options, launch.label))
            per_label.setdefault(launch.label, set()).add(variant)
        for source, options, label in variants.values():
            results.append(compile_variant(source, options, target_name, label))
    return results, {label: sorted(v, key=repr) for label, v in per_label.items()}


def parse_sass(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, predicate, opcode with modifiers, operands) of each instruction of a cuobjdump -sass
    listing."""
    pattern = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
    return [(int(a, 16), p.strip(), op, rest.strip()) for a, p, op, rest in pattern.findall(sass)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastes.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {list(TARGETS)}")
    parser.add_argument("--labels", default="", help="only launches whose label matches this regex")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        gpu_target(t)  # bad names fail before any work
    import triton

    start = time.perf_counter()
    results, per_label = check(targets, args.labels)
    failed = [r for r in results if not r.ok or r.spills]
    for r in results:
        state = "FAIL" if not r.ok else "SPILL" if r.spills else "ok"
        print(
            f"{state:5s} {r.target:7s} {r.label:40s} regs={r.registers:3d} local={r.spill_bytes} "
            f"{r.seconds:5.1f}s {r.error.splitlines()[0] if r.error else ''}"
        )
    ambiguous = {label: len(v) for label, v in per_label.items() if len(v) > 1}
    for label, n in ambiguous.items():
        print(f"VARIANTS {label}: {n} compiled variants where one is expected (a data value is specialised)")
    print(
        f"{len(results)} variants, {len(failed)} failed or spilled, triton {triton.__version__}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    if args.json:
        rows = [{**asdict(r), "spills": r.spills} for r in results]
        args.json.write_text(
            json.dumps(
                {
                    "triton": triton.__version__,
                    "results": rows,
                    "variants_per_label": {label: len(v) for label, v in per_label.items()},
                    "opcodes": {
                        f"{r.target} {r.label}": dict(Counter(op for _, _, op, _ in parse_sass(r.sass)))
                        for r in results
                        if r.sass
                    },
                },
                indent=1,
            )
        )
    return 1 if failed or ambiguous else 0


if __name__ == "__main__":
    sys.exit(main())
