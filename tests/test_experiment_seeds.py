"""More seeds of the study's headline comparison (fastes/experiment/seeds.py): a second seed's folder
inside the report's directory is read, checked and tabulated; `--report-only` writes the report again.

Seed 0's metrics are the committed SmolLM2 study's (docs/experiment/smollm2); "seed 1" is made from them
with every model's per-problem results shuffled."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastes.analysis.passk import pass_at_k
from fastes.cli import main
from fastes.errors import ConfigError
from fastes.experiment import headline, other_seeds

STUDY = Path(__file__).resolve().parents[1] / "docs" / "experiment" / "smollm2"


def _another_seed(metrics: dict, seed: int) -> dict:
    """The headline arms' metrics as another seed would leave them: per-problem results shuffled (and
    the accuracies and Pass@K that follow from them)."""
    rng = np.random.default_rng(seed)
    n = metrics["preset"]["passk_samples"]
    models = {}
    for name in ("base", "es", "grpo"):
        model = dict(metrics["models"][name])
        model["greedy_correct"] = rng.permutation(model["greedy_correct"]).tolist()
        model["greedy_accuracy"] = float(np.mean(model["greedy_correct"]))
        model["correct_counts"] = rng.permutation(model["correct_counts"]).tolist()
        model["pass_at_k"] = {
            k: float(np.mean(pass_at_k(n, model["correct_counts"], int(k)))) for k in model["pass_at_k"]
        }
        models[name] = model
    return {
        **metrics,
        "preset": {**metrics["preset"], "seed": seed},
        "models": models,
        "missing_stages": ["grpo_es"],
    }


@pytest.fixture
def report_dir(tmp_path):
    """A finished study (seed 0) with seed 1's metrics in seed1/, as a second-seed run leaves them."""
    out = tmp_path / "study"
    (out / "seed1").mkdir(parents=True)
    shutil.copy(STUDY / "metrics.json", out / "metrics.json")
    seed1 = _another_seed(_load(out / "metrics.json"), 1)
    (out / "seed1" / "metrics.json").write_text(json.dumps(seed1))
    return out


def _load(path):
    return json.loads(path.read_text())


def test_headline_is_the_paired_difference_of_each_seed_and_their_mean(report_dir):
    runs = [_load(report_dir / "metrics.json"), _load(report_dir / "seed1" / "metrics.json")]
    found = headline(runs)
    assert [row["seed"] for row in found["seeds"]] == [0, 1]
    assert list(found["mean"]) == ["greedy", "Pass@1", "Pass@32"]
    for run, row in zip(runs, found["seeds"]):
        models = run["models"]
        es, grpo = (np.asarray(models[m]["greedy_correct"], float) for m in ("es", "grpo"))
        value, se = row["measures"]["greedy"]["es_minus_grpo"]
        assert value == pytest.approx((es - grpo).mean())
        assert se == pytest.approx((es - grpo).std(ddof=1) / np.sqrt(len(es)))
        # Pass@1 at T=1 is the share of correct samples; Pass@32 of 32 samples: any correct sample.
        counts = {m: np.asarray(models[m]["correct_counts"]) for m in ("es", "grpo")}
        assert row["measures"]["Pass@1"]["es_minus_grpo"][0] == pytest.approx(
            ((counts["es"] - counts["grpo"]) / 32).mean()
        )
        covered = {m: (c > 0) * 1.0 for m, c in counts.items()}
        assert row["measures"]["Pass@32"]["es_minus_grpo"][0] == pytest.approx(
            (covered["es"] - covered["grpo"]).mean()
        )
        for name, k in (("Pass@1", "1"), ("Pass@32", "32")):
            assert row["measures"][name]["es"] == pytest.approx(models["es"]["pass_at_k"][k])
    (a, sa), (b, sb) = (row["measures"]["greedy"]["es_minus_grpo"] for row in found["seeds"])
    mean, mean_se = found["mean"]["greedy"]
    assert mean == pytest.approx((a + b) / 2) and mean_se == pytest.approx(np.hypot(sa, sb) / 2)


def test_report_only_writes_the_seed_table_into_the_report(report_dir, capsys):
    assert main(["experiment", "--report-only", "--out", str(report_dir)]) == 0
    report = (report_dir / "report.md").read_text()
    assert "## ES vs GRPO over seeds" in report and "on 2 training seeds" in report
    assert "[1](seed1/metrics.json)" in report and "0 (this run)" in report
    seed1 = _load(report_dir / "seed1" / "metrics.json")["models"]
    assert f"| greedy | [1](seed1/metrics.json) | {seed1['base']['greedy_accuracy']:.3f} | " in report
    assert f"| {seed1['es']['greedy_accuracy']:.3f} | {seed1['grpo']['greedy_accuracy']:.3f} |" in report
    assert "| Pass@32 | **mean** |" in report and "Over the seeds" in report
    assert "2 seeds for ES vs GRPO (above); every other figure is from seed 0 alone." in report


def test_a_report_without_seed_folders_has_no_seed_table(report_dir):
    shutil.rmtree(report_dir / "seed1")
    assert main(["experiment", "--report-only", "--out", str(report_dir)]) == 0
    report = (report_dir / "report.md").read_text()
    assert "over seeds" not in report and "- One seed." in report


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m["preset"].update(sigma=0.5), "not this experiment with another seed (sigma differ)"),
        (lambda m: m["preset"].update(seed=0), "seed 0 is already in the report"),
        (lambda m: m["models"].pop("grpo"), "models grpo are not evaluated yet"),
    ],
)
def test_a_seed_folder_of_another_experiment_is_refused_in_one_line(report_dir, capsys, change, message):
    path = report_dir / "seed1" / "metrics.json"
    metrics = _load(path)
    change(metrics)
    path.write_text(json.dumps(metrics))
    before = (report_dir / "metrics.json").read_bytes()
    with pytest.raises(ConfigError, match="seed1"):
        other_seeds(report_dir, _load(report_dir / "metrics.json"))
    assert main(["experiment", "--report-only", "--out", str(report_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (report_dir / "report.md").exists() and (report_dir / "metrics.json").read_bytes() == before


def test_report_only_refuses_what_it_cannot_report(tmp_path, report_dir, capsys):
    assert main(["experiment", "--report-only", "--out", str(tmp_path / "none")]) == 2
    assert "metrics.json does not exist; run the experiment there first" in capsys.readouterr().err
    metrics = _load(report_dir / "metrics.json")
    metrics["missing_stages"] = ["sweep"]
    (report_dir / "metrics.json").write_text(json.dumps(metrics))
    assert main(["experiment", "--report-only", "--out", str(report_dir)]) == 2
    assert "stages sweep are not finished" in capsys.readouterr().err
    (report_dir / "metrics.json").write_text("{broken")
    assert main(["experiment", "--report-only", "--out", str(report_dir)]) == 2
    assert "is not an experiment's metrics.json" in capsys.readouterr().err
    assert main(["experiment", "--report-only", "--out", str(report_dir), "--seed", "3"]) == 2
    assert "--report-only trains nothing and reads --out only; leave out --seed" in capsys.readouterr().err


def test_a_seed_whose_preset_differs_only_in_its_tuning_note_is_the_same_experiment(report_dir):
    path = report_dir / "seed1" / "metrics.json"
    metrics = _load(path)
    metrics["preset"]["tuning"] = "a later description of how the settings were chosen"
    path.write_text(json.dumps(metrics))
    assert list(other_seeds(report_dir, _load(report_dir / "metrics.json"))) == ["seed1"]
