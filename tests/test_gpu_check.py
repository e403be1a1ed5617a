"""The GPU check's logic, on CPU: its steps run the interpreted kernels against the reference with small
sizes, write their files, and a failing, crashing or missing step never stops the others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def run(tmp_path, steps: str) -> int:
    return gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path), "--steps", steps])


def read(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow
def test_kernel_steps_pass_on_the_interpreter_and_write_their_files(tmp_path):
    steps = ["stream", "perturb", "update", "virtual", "large", "bench"]
    assert run(tmp_path, ",".join(steps)) == 0
    summary = read(tmp_path, "summary")
    assert summary["passed"] and list(summary["steps"]) == steps
    for step in steps:
        record = read(tmp_path, step)
        assert record["passed"] and record["checks"], step
        assert (tmp_path / f"{step}.log").read_text().startswith(f"== {step} ==")
    names = [c["name"] for step in steps for c in read(tmp_path, step)["checks"]]
    # Key word 1 and tensor id 1 (once specialised into constants by Triton) are among the cases.
    assert any("key=0x1,0x1 id=0x1" in n for n in names)
    assert any(n.startswith("virtual") and "id=0x1" in n for n in names)
    assert any("stochastic key 1" in n for n in names)
    facts = read(tmp_path, "bench")["facts"]
    assert facts["perturb_bfloat16"]["perturb_s"] > 0 and facts["update_float32"]["naive_s"] > 0


def test_a_failing_or_crashing_step_does_not_stop_the_others(tmp_path, monkeypatch):
    import fastes.engine.kernels

    def crash(*args):
        raise RuntimeError("simulated crash")

    def wrong_perturb(table, dst_addresses, key, scale, dtype):  # writes nothing: results stay garbage
        pass

    monkeypatch.setitem(gpu_check.STEPS, "stream", crash)
    monkeypatch.setattr(fastes.engine.kernels, "launch_perturb", wrong_perturb)
    assert run(tmp_path, "stream,perturb,environment") == 1
    stream, perturb, environment = (read(tmp_path, s) for s in ("stream", "perturb", "environment"))
    assert (
        not stream["passed"]
        and "simulated crash" in stream["error"]
        and stream["failed"] == ["stream crashed"]
    )
    assert not perturb["passed"] and perturb["failed"] and not perturb["error"]
    assert environment["passed"] and environment["facts"]["torch"] == torch.__version__
    summary = read(tmp_path, "summary")
    assert not summary["passed"]
    assert {s: v["passed"] for s, v in summary["steps"].items()} == {
        "stream": False,
        "perturb": False,
        "environment": True,
    }


def test_without_cuda_it_says_so_and_exits_2(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_unknown_step_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        run(tmp_path, "environment,warp_drive")


def script(tmp_path, steps: str, budget: int = 340) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_CHECK_STEPS=steps,
        GPU_CHECK_ARGS="--device cpu --small",
        GPU_CHECK_BUDGET=str(budget),
        TRITON_INTERPRET="1",
    )
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_script_records_every_step_and_survives_a_failing_one(tmp_path):
    result = script(tmp_path, "facts nonexistent environment")
    assert result.returncode == 1, result.stdout[-3000:]
    record = read(tmp_path, "script")
    assert [(s["step"], s["status"]) for s in record["steps"]] == [
        ("facts", "passed"),
        ("nonexistent", "failed"),
        ("environment", "passed"),
    ]
    assert record["failures"] == 1
    log = (tmp_path / "gpu_check.log").read_text()
    assert "torch" in log and "unknown steps ['nonexistent']" in log
    assert read(tmp_path, "environment")["passed"]


@pytest.mark.slow
def test_script_model_step_measures_and_predicts_the_noise_of_each_mode(tmp_path):
    result = script(tmp_path, "model")
    assert result.returncode == 0, result.stdout[-3000:]
    assert [(s["step"], s["status"]) for s in read(tmp_path, "script")["steps"]] == [("model", "passed")]
    record = read(tmp_path, "model")
    names = [c["name"] for c in record["checks"]]
    assert names[:2] == [
        "model virtual logits vs materialised",
        "model lowrank logits vs lowrank materialised",
    ]
    assert len(names) == 5 and facts_ratio_is_positive(record)
    facts = record["facts"]["model"]
    assert facts["name"] == "Qwen2.5-0.5B" and facts["overrides"]["hidden_size"] == 32  # --small
    for mode in ("materialised", "virtual", "lowrank"):
        assert facts["predicted_noise_s"][mode] > 0
        assert facts["measured"][mode]["build_s"] > 0 and facts["measured"][mode]["update_s"] > 0
    # The tiny model's shape is what was predicted for: its evolved weights, not Qwen2.5-0.5B's.
    assert facts["shape"]["evolved"] == 32 * 32 * 2 + 2 * 16 * 32 + 3 * 64 * 32


def facts_ratio_is_positive(record: dict) -> bool:
    return record["facts"]["model"]["lowrank_forward_over_plain"] > 0


@pytest.mark.slow
def test_model_step_fails_when_low_rank_members_miss_their_noise(tmp_path, monkeypatch):
    from fastes.es.population import LowRankLinear

    real = LowRankLinear.__init__

    def without_noise(self, base, sides, *args, **kwargs):
        inputs, outputs = sides
        real(self, base, (inputs, torch.zeros_like(outputs)), *args, **kwargs)

    monkeypatch.setattr(LowRankLinear, "__init__", without_noise)
    assert run(tmp_path, "model") == 1
    assert read(tmp_path, "model")["failed"] == ["model lowrank logits vs lowrank materialised"]


@pytest.mark.slow
def test_model_step_fails_when_virtual_members_miss_their_noise(tmp_path, monkeypatch):
    import fastes.engine.kernels

    real = fastes.engine.kernels.launch_virtual_linear

    def without_noise(x, weight, y, keys, scales, *args, **kwargs):
        real(x, weight, y, keys, scales * 0, *args, **kwargs)

    monkeypatch.setattr(fastes.engine.kernels, "launch_virtual_linear", without_noise)
    assert run(tmp_path, "model") == 1
    assert read(tmp_path, "model")["failed"] == ["model virtual logits vs materialised"]


def test_script_skips_what_the_time_budget_does_not_allow(tmp_path):
    result = script(tmp_path, "environment es", budget=5)
    assert result.returncode == 1
    assert [s["status"] for s in read(tmp_path, "script")["steps"]] == ["skipped", "skipped"]
    assert "time budget is spent" in result.stdout
