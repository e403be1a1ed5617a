"""Ahead-of-time GPU compilation of every kernel launch the runtime makes (no GPU needed).

`python -m benchmarks.aot` records the launches of `launch_perturb`, `launch_update`, `launch_fill`,
`launch_normals`, `launch_virtual_linear` and `launch_lowrank_linear` (products, then GEMM) on CPU
tensors (keys, tensor ids and offsets of 1, 16, 2^31, 2^32 - 1) and those one ES iteration of four real
models makes in every dtype, noise, evaluation and update mode (meta tensors through fastes.ES and
population_batched), specialises each with Triton's own binder and compiles each distinct variant with
`triton.compile` for sm_90 (H100 / H200), sm_80 (A100) and gfx942 (MI300). It needs compiled kernels, so
it runs in subprocesses without TRITON_INTERPRET (this suite sets it). Compiled results are cached under
$FASTES_CACHE_DIR/aot (CI starts empty).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import aot
from benchmarks.static import fast_path

# The targets of each subprocess, run side by side (CI has 2 cores; each records the launches, ~10 s).
RUNS = ["sm_90", "sm_80", "gfx942"]
DTYPES = ("fp32", "bf16", "fp16")
# The distinct variants one real model's launches may compile to, per target (docs/gpu.md):
# virtual_linear 3 dtypes x 2 noises x 4 tile heights (16, 32, 64, 128 rows), perturb 3 x 2, update
# (fp32: apply, gradient; 16-bit: apply, stochastic, gradient) x 2 noises, the low-rank factors'
# one-launch normals on 2 streams, lowrank_linear 3 dtypes x 2 tile heights (16, 64 rows) x (with and
# without a bias, the products inside; without a bias, the products given: the wide projections of
# models without biases), lowrank_products 3 dtypes; on gfx942 also the 128-row virtual_linear tiles
# and the 64-row lowrank_linear tiles of an output over 2 GiB (64-bit pointers).
VARIANT_BOUND = {"sm_90": 69, "sm_80": 69, "gfx942": 78}
ROOT = Path(__file__).resolve().parents[1]  # benchmarks.aot is run from the repository's root


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; 1 is what the runtime uses
    out = tmp_path_factory.mktemp("aot")
    processes = []
    for i, targets in enumerate(RUNS):
        args = [
            sys.executable,
            "-m",
            "benchmarks.aot",
            "--targets",
            targets,
            "--json",
            str(out / f"{i}.json"),
        ]
        processes.append(
            subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    reports = []
    for i, process in enumerate(processes):
        log, _ = process.communicate(timeout=900)
        path = out / f"{i}.json"
        assert path.exists(), f"python -m benchmarks.aot crashed:\n{log[-4000:]}"
        reports.append((json.loads(path.read_text()), process.returncode, log))
    return reports


@pytest.mark.slow
def test_every_launched_variant_compiles_without_spills(compiled):
    for report, _, _ in compiled:
        assert report["results"], "no launches were captured"
        for r in report["results"]:
            where = f"{r['label']} for {r['target']}"
            assert r["ok"], f"{where} does not compile: {r['error']}"
            assert not r["spills"], f"{where} spills ({r['spill_bytes']} bytes of local memory or registers)"
            assert r["registers"] > 0


@pytest.mark.slow
def test_every_real_model_launch_is_compiled_for_every_target(compiled):
    results = [r for report, _, _ in compiled for r in report["results"]]
    for target in ("sm_90", "sm_80", "gfx942"):
        labels = {label for r in results if r["target"] == target for label in r["labels"]}
        for model in aot.MODEL_CONFIGS:
            for dtype in DTYPES:
                for noise in ("gaussian", "rademacher"):
                    prefix = f"{model} {dtype} {noise} full: "
                    kernels = {
                        label[len(prefix) :].split()[0] for label in labels if label.startswith(prefix)
                    }
                    assert kernels == {"perturb_kernel", "update_kernel", "virtual_linear_kernel"}, (
                        f"{prefix}{target}: {kernels}"
                    )
                    heights = {
                        label.split("BLOCK_M=")[1].split()[0]
                        for label in labels
                        if label.startswith(prefix + "virtual_linear")
                    }
                    assert heights == {"16", "32", "64", "128"}, f"{prefix}{target}: tile heights {heights}"
                lowrank = ["normals_kernel", "lowrank_linear_kernel"]
                if (
                    model != "SmolLM2-135M"
                ):  # its widest projection (1536 outputs) sums its products in the GEMM
                    lowrank.append("lowrank_products_kernel")
                for kernel in lowrank:
                    assert any(
                        label.startswith(f"{model} {dtype} gaussian lowrank: {kernel}") for label in labels
                    ), f"{model} {dtype} lowrank {target}: no {kernel}"
        # The variant count is bounded: launches of every shape and row count share a few variants.
        from_models = [
            r
            for r in results
            if r["target"] == target and any(" full: " in x or " lowrank: " in x for x in r["labels"])
        ]
        assert 0 < len(from_models) <= VARIANT_BOUND[target], f"{target}: {len(from_models)} variants"


@pytest.mark.slow
def test_fp32_virtual_linear_128_row_tile_does_not_spill(compiled):
    # It used to: 255 registers and ~640 bytes of local memory on sm_90 (software pipelining of the FMA dot).
    tiles = [
        r
        for report, _, _ in compiled
        for r in report["results"]
        if r["kernel"] == "virtual_linear_kernel"
        and r["constexprs"]["DTYPE"] == "fp32"
        and r["constexprs"]["BLOCK_M"] == "128"
        and any(label.startswith("Llama-3-8B fp32") for label in r["labels"])
    ]
    assert {r["target"] for r in tiles} == {"sm_90", "sm_80", "gfx942"}
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in tiles), [
        (r["target"], r["spill_bytes"]) for r in tiles
    ]


@pytest.mark.slow
def test_16_bit_lowrank_linear_of_real_models_runs_on_tensor_cores(compiled):
    """The low-rank layer's x W^T is a tensor-core GEMM (wgmma for the 64-row tile on sm_90)."""
    for (report, _, _), target, mma in zip(compiled, RUNS, ("HGMMA", "HMMA")):
        tiles = [
            r
            for r in report["results"]
            if r["kernel"] == "lowrank_linear_kernel"
            and r["constexprs"]["DTYPE"] == "bf16"
            and r["constexprs"]["BLOCK_M"] == "64"
            and any(label.startswith("Qwen2.5-1.5B bf16") for label in r["labels"])
        ]
        assert tiles, f"{target}: no 64-row bf16 lowrank_linear of Qwen2.5-1.5B"
        for r in tiles:
            opcodes = report["opcodes"][f"{target} {r['label']}"]
            assert any(op.startswith(mma) for op in opcodes), f"{target}: no {mma} in {sorted(opcodes)}"


@pytest.mark.slow
def test_each_kernel_is_compiled_once_whatever_its_keys_ids_and_offsets(compiled):
    for report, returncode, log in compiled:
        # The labels cover every kernel, dtype and mode the runtime launches...
        kernels = {r["kernel"] for r in report["results"]}
        assert kernels == {
            "perturb_kernel",
            "update_kernel",
            "fill_kernel",
            "normals_kernel",
            "virtual_linear_kernel",
            "lowrank_products_kernel",
            "lowrank_linear_kernel",
        }
        assert {"perturb bf16", "update fp16 stochastic", "update fp32 gradient"} <= report[
            "variants_per_label"
        ].keys()
        # ...and launches that differ only in data values (1, 16, 2^31, 2^32 - 1), or a real model's
        # launches of one kernel and constexprs at any shape and row count, share one variant.
        for label, count in report["variants_per_label"].items():
            assert count == 1, f"{label}: {count} compiled variants; a data value is specialised"
        assert returncode == 0, log[-4000:]


@pytest.mark.slow
def test_full_tiles_take_a_path_of_128_bit_accesses_without_shared_memory(compiled):
    results = {r["label"]: r for r in compiled[0][0]["results"]}
    for label in (
        "perturb fp32",
        "perturb bf16",
        "update bf16 apply",
        "update fp16 stochastic",
        "update fp32 gradient",
        "normals stream=2",
    ):
        instructions = aot.parse_sass(results[label]["sass"])
        path, _ = fast_path(instructions)
        ops = [instructions[i][2] for i in path]
        assert any(op in ("LDG.E.128", "STG.E.128") for op in ops), f"{label}: no 128-bit access"
        assert not [op for op in ops if op.startswith(("LDG", "STG")) and ".U16" in op], (
            f"{label}: 16-bit accesses"
        )
        # The four Philox lanes are interleaved in registers, not through shared memory.
        assert not [op for op in ops if op.startswith(("STS", "LDS", "BAR"))], f"{label}: shared memory"


def test_capture_refuses_the_interpreter():
    # This process runs under TRITON_INTERPRET=1: kernels here are interpreted, not compiled.
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        with aot.capture():
            pass


def test_unknown_target_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown target 'sm_91'"):
        aot.gpu_target("sm_91")


SASS = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/              @!P0 BRA 0x50 ;
        /*0020*/                   IMAD.WIDE.U32 R2, R0, 0x10, RZ ;
        /*0030*/                   FFMA R1, R1, R1, R1 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   ISETP.GE.AND P1, PT, R0, 0x1, PT ;
        /*0060*/               @P1 BRA 0xa0 ;
        /*0070*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0080*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*00b0*/               @P2 STG.E.U16 desc[UR4][R2.64], R4 ;
        /*00c0*/                   EXIT ;
        /*00d0*/                   BRA 0xd0;
"""


def test_fast_path_enters_loops_and_prefers_128_bit_accesses():
    instructions = aot.parse_sass(SASS)
    assert [op for _, _, op, _ in instructions][:3] == ["S2R", "BRA", "IMAD.WIDE.U32"]
    assert instructions[1][1] == "@!P0" and instructions[1][3] == "0x50"
    path, loops = fast_path(instructions)
    assert loops == [(2, 4)]  # the backward branch at 0x40 closes a loop from 0x20
    assert path == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # through the loop, then the 128-bit path


def test_pipe_model_takes_the_most_loaded_pipe():
    from benchmarks.static import cycles_per_element, pipe_of

    assert [
        pipe_of(op) for op in ("IMAD.WIDE.U32", "LOP3.LUT", "FFMA", "MUFU.SQRT", "UIADD3", "STG.E.128")
    ] == [
        "imad",
        "alu",
        "fp32",
        "xu",
        "uniform",
        "other",
    ]
    assert cycles_per_element({"alu": 64.0}) == 1.0  # 64 integer operations per SM per clock
    assert cycles_per_element({"fp32": 128.0}) == 1.0
    assert cycles_per_element({"imad": 64.0, "fp32": 128.0}) == 1.5  # they share the FMA-heavy pipe
    assert cycles_per_element({"xu": 32.0, "alu": 1.0}) == 2.0
    assert cycles_per_element({"uniform": 256.0}) == 2.0  # issue slots only


class _Source:
    """Stands in for a Triton ASTSource: all compile_cached needs of it is its hash."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def hash(self) -> str:
        return self.digest


def test_compiled_results_are_cached_by_source_options_and_target(tmp_path, monkeypatch):
    compiles = []

    def compile_variant(source, options, target_name, label):
        compiles.append((source.digest, target_name))
        ok = source.digest != "broken"
        return aot.CompileResult("k", label, target_name, ok=ok, registers=40, error="" if ok else "no")

    monkeypatch.setattr(aot, "compile_variant", compile_variant)
    first = aot.compile_cached(_Source("a"), {"num_warps": 4}, "sm_90", "one", tmp_path)
    again = aot.compile_cached(_Source("a"), {"num_warps": 4}, "sm_90", "two", tmp_path)
    assert compiles == [("a", "sm_90")] and again.registers == 40 and again.label == "two"
    assert first.ok and again.ok
    aot.compile_cached(_Source("a"), {"num_warps": 8}, "sm_90", "one", tmp_path)  # other options
    aot.compile_cached(_Source("a"), {"num_warps": 4}, "sm_80", "one", tmp_path)  # other target
    aot.compile_cached(_Source("b"), {"num_warps": 4}, "sm_90", "one", tmp_path)  # other source
    for _ in range(2):  # a failure is compiled again, never remembered
        assert not aot.compile_cached(_Source("broken"), {}, "sm_90", "x", tmp_path).ok
    assert len(compiles) == 6 and len(list(tmp_path.iterdir())) == 4


def test_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown model 'GPT-5'"):
        aot.model_config("GPT-5")
    with pytest.raises(SystemExit):  # the command says it in one line, before any work
        aot.main(["--models", "GPT-5"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith("error: unknown model 'GPT-5'; choose from " + str(list(aot.MODEL_CONFIGS)))
    config = aot.model_config("Qwen2.5-0.5B", layers=1)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 1)


def test_real_model_shapes_match_the_published_parameter_counts():
    from benchmarks.model_iteration import model_shape

    qwen = model_shape("Qwen2.5-0.5B")  # 0.49B parameters, 0.36B without the (tied) embedding
    assert qwen.evolved == 24 * (2 * 896 * 896 + 2 * 128 * 896 + 3 * 4864 * 896) == 357_826_560
    assert round(qwen.total / 1e6) == 494 and qwen.matmul == qwen.evolved + 151936 * 896
    llama = model_shape("Llama-3-8B")  # 8.03B parameters; its lm_head is not tied, so it evolves
    assert round(llama.total / 1e7) == 803 and llama.evolved == llama.total - 128256 * 4096 - 65 * 4096
    assert llama.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_predicted_iteration_chooses_the_fastest_mode_that_fits():
    from benchmarks.model_iteration import DEVICES, NoiseRates, iteration, model_shape

    h100, h200 = DEVICES
    rates = NoiseRates(
        perturb=1.5e-12, update=2e-11, fill=1.5e-12, virtual_decode=2e-12, virtual_prefill=2e-12
    )
    llama = iteration(model_shape("Llama-3-8B"), h100, rates)
    modes = llama["modes"]
    assert modes["materialised"]["group"] < 32 and modes["member"]["group"] == 1  # 15 GB per copy
    fitting = {m: v["total_s"] for m, v in modes.items() if v["fits"]}
    assert llama["choice"]["mode"] == min(fitting, key=fitting.get)
    assert llama["choice"]["full_rank_mode"] != "lowrank"
    for v in fitting.values():  # nothing beats plain inference of the same tokens
        assert v >= llama["floor_s"]
    # Free noise in the matmul: virtual then costs what materialised does, less the perturb.
    free = iteration(model_shape("Qwen2.5-0.5B"), h200, NoiseRates(1.5e-12, 2e-11, 1.5e-12, 0.0, 0.0))[
        "modes"
    ]
    assert free["virtual"]["total_s"] < free["materialised"]["total_s"] < free["virtual"]["total_s"] * 1.05
