"""The benchmark harness in quick mode, so that it never rots. Checks the output's shape, never timings."""

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` lives at the repo root

from benchmarks import run  # noqa: E402
from benchmarks.lowrank_forward_cpu import written_first  # noqa: E402
from benchmarks.suites import SUITES  # noqa: E402
from fastes.es.population import LowRankLinear  # noqa: E402


def positive(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # CPU whatever the machine: this checks the harness, and the kernels are interpreted in the tests.
    data, paths = run(quick=True, out=out, device="cpu", threads=1, log=lambda _: None)
    return data, paths, out


def test_every_suite_reports_positive_ratios(quick):
    data, _, _ = quick
    results = data["results"]
    assert set(results) == set(SUITES)
    assert all(results[s] for s in SUITES), "every suite has at least one record"
    for r in results["noise"]:
        assert positive(r["ratio_vs_randn"]) and positive(r["fastes_normals_per_s"])
        assert positive(r["reference_normals_per_s"])  # the eager reference, timed beside it on CPU
    (step,) = results["step"]
    assert step["backend"] == "cpu" and step["population"] == 4
    for key in ("speedup_vs_naive", "member_speedup_vs_naive", "update_speedup_vs_naive"):
        assert positive(step[key])
    assert step["memory"]["increment_bytes"] >= 0 and step["memory"]["evolved_bytes"] == 3 * 64 * 64 * 4
    for r in results["perturb"]:
        assert positive(r["speedup_vs_naive"]) and positive(r["fraction_of_copy_bandwidth"])
        assert r["fastes_exact"] is True  # the pointer swap restores bit for bit, by construction
    assert {r["population"] for r in results["update"]} == {8, 30}
    for r in results["update"]:
        assert positive(r["speedup_vs_naive"]) and positive(r["fastes_element_members_per_s"])
    (iteration,) = results["iteration"]
    assert positive(iteration["speedup_vs_naive"])
    assert iteration["fastes"]["tokens"] > 0 and iteration["naive"]["tokens"] > 0
    for r in results["memory"]:
        assert r["inference"]["peak_bytes"] > 0 and positive(r["es_vs_inference"])


def test_targets_are_judged_not_asserted(quick):
    data, _, _ = quick
    targets = data["targets"]
    assert {t["target"] for t in targets} >= {
        "ES step (12.6M fp32, N=30) vs naive",
        "member perturb+restore vs naive",
        "normals per second vs torch.randn",
        "perturb+restore vs naive",
        "fused update at N=30 vs naive",
        "whole ES iteration vs naive loop",
        "ES peak memory vs plain inference",
    }
    assert all(isinstance(t["hit"], bool) for t in targets)


def test_files_written(quick):
    data, paths, out = quick
    env = data["environment"]
    for key in ("date", "device_name", "torch", "triton", "cpu_model"):
        assert env[key]
    assert set(paths) == {"json", "md", "png", "latest"}
    assert json.loads(paths["json"].read_text())["results"].keys() == data["results"].keys()
    assert paths["latest"].name == "latest-cpu-quick.md"
    text = paths["md"].read_text()
    assert "## Targets" in text and ("**hit**" in text or "**miss**" in text)
    assert "## ES step on bare weights" in text
    assert paths["png"].stat().st_size > 0 and paths["png"].parent == out


def test_comparison_benchmark_quick_mode_writes_its_report(tmp_path):
    from benchmarks import sign_noise

    results = sign_noise.main(["--quick", "--out", str(tmp_path), "--runs", str(tmp_path / "none")])
    stem = tmp_path / f"sign-noise-cpu-{results['date']}"
    assert {r["op"] for r in results["throughput"]} == {"perturb", "update N=2"}
    assert all(r["gaussian_s"] > 0 and r["rademacher_s"] > 0 for r in results["throughput"])
    for problem in ("toy", "regression"):
        assert set(results[problem]["final"]) == {"gaussian", "rademacher"}
        assert all(len(c) == 4 for curves in results[problem]["curves"].values() for c in curves)  # 3 steps
    report = stem.with_suffix(".md").read_text()
    assert "| README toy" in report and "Countdown: not run" in report
    assert "Machine shared" not in report  # what was observed, not a literal
    assert f"Load average {results['load_average'][0]:.1f} (1 min)" in report
    assert stem.with_suffix(".png").stat().st_size > 0 and stem.with_suffix(".json").exists()


def test_the_load_average_is_read_before_the_suites_run(monkeypatch):
    """The report says 'load average ... at the start': it must not be the suites' own load."""
    import os

    import benchmarks.runner as runner

    ran = []
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0) if ran else (0.25, 0.5, 0.75))
    monkeypatch.setattr(runner, "run_suites", lambda ctx, suites: ran.append(1) or {})
    data, _ = runner.run(quick=True, device="cpu", log=lambda _: None)
    assert ran and data["environment"]["load_average"] == [0.25, 0.5, 0.75]


def test_a_second_run_the_same_day_gets_its_own_dated_files(tmp_path):
    from benchmarks.common import dated_stem

    assert dated_stem(tmp_path, "cpu-x", "2026-12-03") == "cpu-x-2026-12-03"
    (tmp_path / "cpu-x-2026-12-03.md").write_text("first run")
    assert dated_stem(tmp_path, "cpu-x", "2026-12-03") == "cpu-x-2026-12-03-2"
    (tmp_path / "cpu-x-2026-12-03-2-update.png").write_bytes(b"")
    assert dated_stem(tmp_path, "cpu-x", "2026-12-03", endings=(".md", "-update.png")) == "cpu-x-2026-12-03-3"
    assert dated_stem(tmp_path, "cpu-x", "2026-12-03", "-quick") == "cpu-x-2026-12-03-quick"


@torch.no_grad()
@pytest.mark.parametrize("bias", [True, False])
def test_the_benchmarked_alternative_computes_the_same_layer(bias):
    """benchmarks.lowrank_forward_cpu times a second way of adding the term (written first, the GEMM
    accumulating into it): it must compute what the layer computes, or the comparison means nothing."""
    torch.manual_seed(4)
    base = torch.nn.Linear(37, 53, bias=bias)
    factors = [(torch.randn(53, 2), torch.randn(37, 2)) for _ in range(3)]
    layer = LowRankLinear.from_factors(base, factors, [0.5, -0.5, 0.25])
    x = torch.randn(3 * 4, 5, 37)
    torch.testing.assert_close(written_first(layer, x), layer(x), rtol=1e-5, atol=1e-5)


def test_the_memory_target_compares_median_runs_of_fresh_processes(monkeypatch):
    """benchmarks.real_model runs plain generation and the default mode --memory-repeats times each under
    each allocator setting, alternating, every other variant once under fastes' own, and reports each
    repeated variant's median run by peak, per allocator setting."""
    import argparse

    from benchmarks import real_model

    peaks = {
        ("plain", "default"): iter([300, 100, 200]),
        ("fastes lowrank", "default"): iter([5, 9, 7]),
        ("naive loop", "default"): iter([50]),
        ("plain", "fixed mmap threshold"): iter([40, 60, 50]),
        ("fastes lowrank", "fixed mmap threshold"): iter([3, 3, 4]),
    }
    order = []
    environments = []

    def child(args, shape, name, allocator="default"):
        order.append((name, allocator))
        environments.append(real_model.ALLOCATORS[allocator])
        return {"seconds": float(len(order)), "peak_bytes": next(peaks[name, allocator]), "tokens": 1}

    monkeypatch.setattr(real_model, "_child", child)
    monkeypatch.setattr(real_model, "_progress", lambda message: None)
    args = argparse.Namespace(memory_repeats=3)
    names = ["plain", "fastes lowrank", "naive loop"]
    variants = real_model._fresh_variants(args, (2, 2, 4), names, compared=names[:2])
    fixed = [("plain", "fixed mmap threshold"), ("fastes lowrank", "fixed mmap threshold")]
    default = [("plain", "default"), ("fastes lowrank", "default")]
    assert order == [(name, "default") for name in names] + fixed + default + fixed + default + fixed
    assert all(
        env == {"MALLOC_MMAP_THRESHOLD_": "131072"}
        for (_, a), env in zip(order, environments)
        if a != "default"
    )
    assert variants["plain"]["peak_bytes"] == 200 and variants["plain"]["seconds"] == 10.0
    assert variants["fastes lowrank"]["peak_bytes"] == 7
    assert [r["peak_bytes"] for r in variants["plain"]["runs"]] == [300, 100, 200]
    assert variants["plain"]["fixed mmap threshold"]["peak_bytes"] == 50
    assert variants["fastes lowrank"]["fixed mmap threshold"]["peak_bytes"] == 3
    assert variants["naive loop"]["peak_bytes"] == 50 and len(variants["naive loop"]["runs"]) == 1
    assert "fixed mmap threshold" not in variants["naive loop"]


def test_the_fastest_rounds_ratio_takes_each_sides_fastest_round_on_its_own():
    """The fastest ES token rate over the fastest plain one, which may come from different rounds."""
    from benchmarks import real_model

    rounds = [
        {"es_tokens": 100, "es_seconds": 2.0, "plain_tokens": 100, "plain_seconds": 1.0},  # ES 50, plain 100
        {"es_tokens": 120, "es_seconds": 1.5, "plain_tokens": 100, "plain_seconds": 1.25},  # ES 80, plain 80
    ]
    assert real_model._fastest_ratio(rounds) == 80 / 100
    assert real_model._fastest_ratio(rounds[1:]) == 1.0


def test_the_tiny_iteration_benchmark_reports_its_medians_and_fastest_rounds():
    """Two rounds of the materialised mode: every timed call recorded, the ratios read off them."""
    from benchmarks.tiny_iteration import markdown, measure_mode

    result = measure_mode("materialised", rounds=2)
    seconds = result["range_s"]
    assert result["fastest_time_ratio"] == seconds["plain"][0] / seconds["ES iteration"][0]
    rounds = result["rounds_s"]
    per_round = [a / b for a, b in zip(rounds["plain"], rounds["ES iteration"])]
    assert result["time_ratio"] == statistics.median(per_round)  # neighbours in time, not two medians
    assert result["ratio_of_medians"] == result["median_s"]["plain"] / result["median_s"]["ES iteration"]
    assert set(result["iteration_split_s"]) >= {"time/generation", "time/noise", "time/update"}
    report = {
        "date": "d",
        "time": "t",
        "cpu": "c",
        "threads": 1,
        "load_average_at_start": 0.0,
        "antithetic": False,
        "rounds": 2,
        "modes": {"materialised": result},
    }
    assert f"{result['fastest_time_ratio']:.3f}" in markdown(report)
    assert "products taken" not in markdown(report)  # a report from before they were recorded
    report["cpu_products"] = {"packed": True, "member_matmul": False, "small_packed": True}
    header = markdown(report).splitlines()[2]  # the products, and all the header had before them
    assert "the library's products taken (packed, small-packed); load average 0.0 at the start" in header
    assert header.endswith("interleaved rounds (`python -m benchmarks.tiny_iteration`).")


def test_the_tiny_iteration_benchmark_times_the_population_generation_alone(monkeypatch):
    """The "population generation" column times the generate call with the population's layers already
    in place: entering (which writes the members' weights) and leaving are timed apart."""
    from contextlib import contextmanager

    import fastes.es.population as population
    from benchmarks import tiny_iteration

    events = []
    entered = population.population_batched

    @contextmanager
    def recorded(*args, **kwargs):
        with entered(*args, **kwargs) as members:
            events.append("enter")
            yield members
        events.append("exit")

    untimed = tiny_iteration._timed

    def timed(call):
        events.append("start")
        result = untimed(call)
        events.append("stop")
        return result

    monkeypatch.setattr(population, "population_batched", recorded)
    monkeypatch.setattr(tiny_iteration, "_timed", timed)
    tiny_iteration.measure_mode("materialised", rounds=1)
    # the last round: plain generation; the population's generate call; enter and exit; the ES iteration
    # (which enters through fastes.run.es_loop's own reference, not recorded here)
    plain, generation = ["start", "stop"], ["enter", "start", "stop", "exit"]
    enter_exit, iteration = ["start", "enter", "exit", "stop"], ["start", "stop"]
    assert events[-12:] == plain + generation + enter_exit + iteration


def test_each_round_rotates_its_three_measurements_and_reads_the_ratios_off_them():
    """benchmarks.real_model's round: plain generation, the ES iteration and transformers' generate, in an
    order that rotates, each ratio a quotient of two of their token rates."""
    from benchmarks import real_model

    calls = []
    plain = lambda: calls.append("plain") or (2.0, 100, 5)  # noqa: E731
    iteration = lambda: calls.append("es") or (4.0, 100, 5, {"time/generation": 3.0})  # noqa: E731
    reference = lambda: calls.append("transformers") or (5.0, 100, 5)  # noqa: E731
    firsts = []
    for index in range(3):
        calls.clear()
        r = real_model._round(index, plain, iteration, reference)
        firsts.append(calls[0])
        assert sorted(calls) == ["es", "plain", "transformers"]
    assert firsts == ["plain", "es", "transformers"]
    assert r["rate_ratio"] == 0.5 and r["transformers_rate_ratio"] == 1.25
    assert r["plain_over_transformers"] == 2.5


def test_a_round_times_plain_generation_at_the_iterations_lengths_right_after_it():
    """With `matched`, the round runs plain generation at the ES rows' own lengths straight after the ES
    iteration (whose lengths it takes), wherever the rotation puts the iteration."""
    from benchmarks import real_model

    calls = []
    plain = lambda: calls.append("plain") or (2.0, 100, 5)  # noqa: E731
    iteration = lambda: calls.append("es") or (4.0, 120, 9, {"time/generation": 3.0})  # noqa: E731
    reference = lambda: calls.append("transformers") or (5.0, 100, 5)  # noqa: E731
    matched = lambda: calls.append("matched") or (3.0, 120, 9)  # noqa: E731
    for index in range(3):
        calls.clear()
        r = real_model._round(index, plain, iteration, reference, matched)
        assert calls[calls.index("es") + 1] == "matched" and len(calls) == 4
    assert r["matched_rate_ratio"] == 0.75 and r["rate_ratio"] == 0.6
    assert "matched_rate_ratio" not in real_model._round(0, plain, iteration, reference)


def test_plain_generation_at_given_lengths_does_the_work_of_rows_that_stopped_there():
    """benchmarks.naive.generate_at_lengths: at the lengths the rows stop at by themselves it generates
    the same tokens with the same batch at every step; at other lengths, each row exactly its own,
    longer or shorter than where EOS would stop it. A length outside 1..max_new_tokens is refused."""
    from benchmarks.naive import generate_at_lengths
    from fastes.models.generation import generate
    from fastes.models.loading import load_model, tiny_model_path
    from fastes.tasks import get_task

    model, tokenizer = load_model(tiny_model_path())  # the shipped checkpoint: its rows stop at EOS
    prompts = [ex.prompt for ex in get_task("countdown", seed=0).split("test")[:6]] + ["12+34=", "rev 123:"]
    batches = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    own = generate(model, tokenizer, prompts, max_new_tokens=10)
    own_batches, batches[:] = list(batches), []
    assert len(set(own.lengths)) > 1  # rows stop at different steps
    again = generate_at_lengths(model, tokenizer, prompts, own.lengths, 10)
    assert again.completion_ids == own.completion_ids and batches == own_batches
    other = [1 + (n + 3) % 10 for n in own.lengths]
    assert any(o > n for o, n in zip(other, own.lengths))  # some rows past their own EOS
    batches.clear()
    assert generate_at_lengths(model, tokenizer, prompts, other, 10).lengths == other
    # the prompts' forward, then one a step with the rows still short of their length
    assert batches == [len(prompts)] + [sum(n > step for n in other) for step in range(1, max(other))]
    with pytest.raises(ValueError, match="one length in 1..10 per prompt"):
        generate_at_lengths(model, tokenizer, prompts, [0] * len(prompts), 10)


def test_the_transformers_baseline_generates_what_fastes_generates():
    """The benchmarks' transformers_generate (every row decoding until the last stops) completes the same
    prompts to the same tokens as fastes' own loop, in which finished rows leave: the same work."""
    from benchmarks.naive import transformers_generate
    from fastes.models.generation import generate
    from fastes.models.loading import load_model, tiny_model_path
    from fastes.tasks import get_task

    model, tokenizer = load_model(tiny_model_path())  # the shipped checkpoint: its rows stop at EOS
    prompts = [ex.prompt for ex in get_task("countdown", seed=0).split("test")[:6]] + ["12+34=", "rev 123:"]
    ours = generate(model, tokenizer, prompts, max_new_tokens=10)
    theirs = transformers_generate(model, tokenizer, prompts, 10)
    assert theirs.completion_ids == ours.completion_ids and theirs.prompt_ids == ours.prompt_ids
    assert theirs.texts == ours.texts
    assert len(set(ours.lengths)) > 1  # rows stopped at different steps: some left fastes' batch early


def test_the_fixed_length_rounds_give_both_sides_the_same_work(tmp_path):
    """benchmarks.real_model's equal-work rounds (EOS stops no row) on the shipped tiny checkpoint: plain
    generation, the ES iteration and transformers' generate each process every row's prompt and
    max_new_tokens tokens, where with EOS the rows stop at different steps."""
    import argparse

    from benchmarks import real_model
    from fastes.models.loading import tiny_model_path

    args = argparse.Namespace(
        model=str(tiny_model_path()), population=2, prompts=3, new_tokens=5, out=tmp_path, rounds=2
    )
    fixed = real_model.interleaved(args, "lowrank", fixed_length=True)
    stopping = real_model.interleaved(args, "lowrank")
    for r in fixed["rounds"]:
        assert r["plain_tokens"] == r["es_tokens"] == r["transformers_tokens"]
        assert r["plain_steps"] == r["es_steps"] == args.new_tokens
    assert fixed["fixed_length"] and not stopping["fixed_length"]
    # some rows of the checkpoint stop at EOS within the tokens: with EOS, fewer tokens are processed
    assert all(r["plain_tokens"] < fixed["rounds"][0]["plain_tokens"] for r in stopping["rounds"])
