"""scripts/trl_tests.py, the harness that runs TRL's own GRPO tests against fastes: its import swap, hub-id
substitution, local zen rows, junit parsing and classification, on synthetic inputs (no TRL checkout
needed)."""

import importlib.util
import json
from pathlib import Path

import pytest

from fastes.tasks.base import ALPHABET

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trl_tests.py"
spec = importlib.util.spec_from_file_location("trl_tests", SCRIPT)
trl_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trl_tests)

# A stand-in for TRL's test file, written here (not TRL's): the import line and hub ids the harness rewrites.
SYNTHETIC = """import pytest
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

MODEL = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
REWARD = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
LONGER = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5-extra"


def test_one():
    dataset = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
    GRPOTrainer(model=MODEL, reward_funcs=REWARD, args=GRPOConfig(output_dir="x"), train_dataset=dataset)
"""


@pytest.mark.parametrize(
    "trainer, line",
    [
        ("grpo", "from fastes import GRPOConfig, GRPOTrainer"),
        ("es", "from fastes import ESConfig as GRPOConfig, ESTrainer as GRPOTrainer"),
        ("trl", "from trl import GRPOConfig, GRPOTrainer"),
    ],
)
def test_swap_import_replaces_only_the_trainer_import(trainer, line):
    out = trl_tests.swap_import(SYNTHETIC, trainer)
    assert out == SYNTHETIC.replace("from trl import GRPOConfig, GRPOTrainer", line)
    assert out.count("GRPOTrainer(") == 1  # the test body is untouched


def test_swap_import_refuses_a_file_without_the_import():
    with pytest.raises(SystemExit, match="has no line"):
        trl_tests.swap_import("from trl import SFTTrainer\n", "grpo")


def test_hub_ids_and_class_names():
    assert trl_tests.hub_ids(SYNTHETIC) == [
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5-extra",
        "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5",
    ]  # not the zen dataset
    assert trl_tests.class_name("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5") == "Qwen2ForCausalLM"
    assert trl_tests.class_name("trl-internal-testing/tiny-GptOssForCausalLM") == "GptOssForCausalLM"
    assert trl_tests.class_name("trl-internal-testing/tiny-Qwen3_5ForConditionalGeneration-NoThink") == (
        "Qwen3_5ForConditionalGeneration"
    )


def test_substitute_ids_replaces_whole_ids_only(tmp_path):
    paths = {
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": tmp_path / "causal",
        "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": tmp_path / "reward",
    }
    out = trl_tests.substitute_ids(SYNTHETIC, paths)
    assert f'MODEL = "{tmp_path / "causal"}"' in out
    assert f'REWARD = "{tmp_path / "reward"}"' in out
    assert 'LONGER = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5-extra"' in out  # a longer id: not built
    assert '"trl-internal-testing/zen"' in out  # datasets are served by the plugin, not rewritten


def test_zen_rows_have_the_hub_shapes_in_the_tokenizer_alphabet():
    standard = trl_tests.zen_rows("standard_prompt_only")
    conversational = trl_tests.zen_rows("conversational_prompt_only")
    for rows in (standard, conversational):
        assert (len(rows["train"]), len(rows["test"])) == (17, 2)
    for row in standard["train"] + standard["test"]:
        assert list(row) == ["prompt"] and isinstance(row["prompt"], str) and row["prompt"]
        assert set(row["prompt"]) <= set(ALPHABET)
    for row in conversational["train"] + conversational["test"]:
        assert list(row) == ["prompt"]
        [message] = row["prompt"]
        assert message["role"] == "user" and set(message["content"]) <= set(ALPHABET)
    with pytest.raises(ValueError, match="no local rows"):
        trl_tests.zen_rows("standard_preference")


def test_zen_dataset_returns_what_load_dataset_would():
    datasets = pytest.importorskip("datasets")
    zen = {"standard_prompt_only": trl_tests.zen_rows("standard_prompt_only")}
    train = trl_tests.zen_dataset(zen, "standard_prompt_only", split="train")
    assert isinstance(train, datasets.Dataset) and train.column_names == ["prompt"] and len(train) == 17
    both = trl_tests.zen_dataset(zen, "standard_prompt_only")
    assert (
        isinstance(both, datasets.DatasetDict) and set(both) == {"train", "test"} and len(both["test"]) == 2
    )
    stream = trl_tests.zen_dataset(zen, "standard_prompt_only", split="test", streaming=True)
    assert isinstance(stream, datasets.IterableDataset) and len(list(stream)) == 2
    streams = trl_tests.zen_dataset(zen, "standard_prompt_only", streaming=True)
    assert isinstance(streams, datasets.IterableDatasetDict)
    with pytest.raises(ValueError, match="no local rows"):
        trl_tests.zen_dataset(zen, "conversational_prompt_only", split="train")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="7">
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_init_minimal" time="0.5"/>
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer"
  name="test_train[/cache/trl-internal-testing/tiny-X]" time="2.0">
  <failure message="AssertionError: Parameter w has not changed.&#10;assert not True">tb</failure>
</testcase>
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_train_beta_non_zero" time="1.0">
  <error message="failed on setup with &quot;ValueError: /cache/trl-internal-testing/tiny-X: boom&quot;">
  tb</error>
</testcase>
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_train_vllm" time="0.0">
  <skipped type="pytest.skip" message="test requires vllm">skip</skipped></testcase>
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_tools" time="0.0">
  <skipped type="pytest.xfail" message="tool parsing">xfail</skipped></testcase>
<testcase classname="tests.test_grpo_trainer.TestGetHighEntropyMask" name="test_compute_entropy_mask_0"
  time="0.1"/>
<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_train_with_eval" time="3.0">
  <failure message="TypeError: /tmp/fastes-trl-tests-ab12/tests/t.py: eval_strategy">tb</failure></testcase>
</testsuite></testsuites>"""


def test_parse_junit_restores_hub_ids_and_reads_outcomes():
    cases = {c["id"]: c for c in trl_tests.parse_junit(JUNIT, "/cache")}
    assert cases["TestGRPOTrainer::test_train[trl-internal-testing/tiny-X]"]["outcome"] == "failed"
    assert cases["TestGRPOTrainer::test_train[trl-internal-testing/tiny-X]"]["message"] == (
        "AssertionError: Parameter w has not changed."
    )
    assert cases["TestGRPOTrainer::test_train_beta_non_zero"]["outcome"] == "failed"  # an error element
    assert cases["TestGRPOTrainer::test_train_beta_non_zero"]["message"] == (
        'failed on setup with "ValueError: trl-internal-testing/tiny-X: boom"'  # the hub id, not the path
    )
    assert cases["TestGRPOTrainer::test_init_minimal"] == {
        "id": "TestGRPOTrainer::test_init_minimal",
        "outcome": "passed",
        "message": "",
        "seconds": 0.5,
    }
    assert cases["TestGRPOTrainer::test_train_with_eval"]["message"] == "TypeError: tests/t.py: eval_strategy"
    assert cases["TestGRPOTrainer::test_train_vllm"]["outcome"] == "skipped"
    assert cases["TestGRPOTrainer::test_tools"]["message"] == "xfail: tool parsing"


def test_classify_grpo_against_a_baseline():
    cases = trl_tests.parse_junit(JUNIT, "/cache")
    baseline = {
        "TestGRPOTrainer::test_train_with_eval": {"status": "failed", "reason": "KeyError: 'eval_loss'"}
    }
    got = {r["id"]: (r["status"], r["reason"]) for r in trl_tests.classify(cases, "grpo", baseline)}
    assert got["TestGRPOTrainer::test_init_minimal"] == ("passed", "")
    assert got["TestGRPOTrainer::test_train[trl-internal-testing/tiny-X]"] == (
        "failed",
        "AssertionError: Parameter w has not changed.",
    )
    assert got["TestGRPOTrainer::test_train_beta_non_zero"][0] == "failed"  # applies to GRPO
    assert got["TestGRPOTrainer::test_train_vllm"] == (
        "not applicable",
        "skipped by TRL's marker: test requires vllm",
    )
    assert got["TestGRPOTrainer::test_tools"][0] == "not applicable"
    assert got["TestGetHighEntropyMask::test_compute_entropy_mask_0"][1].startswith("TRL internals:")
    assert got["TestGRPOTrainer::test_train_with_eval"] == (
        "not applicable",
        "fails with TRL too under the local models and data: KeyError: 'eval_loss'",
    )
    summary = trl_tests.summary(trl_tests.classify(cases, "grpo", baseline))
    assert summary == {
        "passed": 1,
        "failed": 2,
        "not applicable": 4,
        "applicable": 3,
        "total": 7,
        "percent_passed_of_applicable": 33.3,
    }


def test_classify_es_drops_grpo_only_tests_and_trl_ignores_the_baseline():
    cases = trl_tests.parse_junit(JUNIT, "/cache")
    es = {r["id"]: r for r in trl_tests.classify(cases, "es")}
    assert es["TestGRPOTrainer::test_train_beta_non_zero"]["status"] == "not applicable"
    assert es["TestGRPOTrainer::test_train_beta_non_zero"]["reason"].startswith("GRPO only: beta")
    assert es["TestGRPOTrainer::test_train_with_eval"]["status"] == "failed"  # no baseline given
    assert trl_tests.lookup(trl_tests.GRPO_ONLY, "TestGRPOTrainer::test_train_scale_rewards[group]")
    assert trl_tests.lookup(
        trl_tests.GRPO_ONLY, "TestGRPOTrainer::test_reward_metric_reflects_reward_weights[normalize_then_sum]"
    )
    assert not trl_tests.lookup(
        trl_tests.GRPO_ONLY, "TestGRPOTrainer::test_reward_metric_reflects_reward_weights[sum_then_normalize]"
    )
    failed = {"TestGRPOTrainer::test_init_minimal": {"status": "failed", "reason": "x"}}
    trl = {r["id"]: r for r in trl_tests.classify(cases, "trl", failed)}
    assert trl["TestGRPOTrainer::test_init_minimal"]["status"] == "passed"


def test_read_progress_marks_the_test_in_flight(tmp_path):
    log = tmp_path / "progress.jsonl"
    records = [
        {"start": "tests/t.py::A::test_a"},
        {
            "nodeid": "tests/t.py::A::test_a",
            "when": "call",
            "outcome": "failed",
            "duration": 1.0,
            "longrepr": "tb\nE   ValueError: nope\nE   more\n\nt.py:3: ValueError",
        },
        {
            "nodeid": "tests/t.py::A::test_a",
            "when": "teardown",
            "outcome": "passed",
            "duration": 0.0,
            "longrepr": "",
        },
        {"start": "tests/t.py::A::test_s"},
        {
            "nodeid": "tests/t.py::A::test_s",
            "when": "setup",
            "outcome": "skipped",
            "duration": 0.0,
            "longrepr": "('tests/t.py', 396, 'Skipped: test requires vllm')",
        },
        {
            "nodeid": "tests/t.py::A::test_s",
            "when": "teardown",
            "outcome": "passed",
            "duration": 0.0,
            "longrepr": "",
        },
        {"start": "tests/t.py::A::test_b[/cache/trl-internal-testing/tiny-X]"},
    ]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n{cut")
    done, current = trl_tests.read_progress(log, Path("/cache"))
    assert done["A::test_a"]["outcome"] == "failed" and done["A::test_a"]["message"] == "ValueError: nope"
    assert (done["A::test_s"]["outcome"], done["A::test_s"]["message"]) == ("skipped", "test requires vllm")
    assert current == (
        "A::test_b[trl-internal-testing/tiny-X]",
        "tests/t.py::A::test_b[/cache/trl-internal-testing/tiny-X]",
    )


def test_the_alarm_fails_a_stuck_test_and_the_run_goes_on(tmp_path):
    """The plugin's per-test alarm turns a hanging test into a failure; the next test still runs."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / trl_tests.TEST_FILE).write_text(
        "import time\n\ndef test_hangs():\n    time.sleep(60)\n\ndef test_after():\n    pass\n"
    )
    (tmp_path / "zen.json").write_text("{}")
    (tmp_path / "fastes_trl_plugin.py").write_text(trl_tests.PLUGIN)
    cases, seconds = trl_tests.run_pytest(
        tmp_path, None, timeout=1, run_timeout=60, paths_root=Path("/cache")
    )
    got = {c["id"]: c for c in cases}
    assert got["test_grpo_trainer::test_hangs"]["outcome"] == "failed"
    assert "timed out after 1 s" in got["test_grpo_trainer::test_hangs"]["message"]
    assert got["test_grpo_trainer::test_after"]["outcome"] == "passed"
    assert seconds < 30
