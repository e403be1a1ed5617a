#!/usr/bin/env python
"""Run TRL's own GRPO tests against fastes, with only the import swapped.

    python scripts/trl_tests.py --trl /path/to/trl-checkout --trainer {grpo,es,trl} [-k EXPR] [--json OUT]

What it does, in order:

1. Copies the checkout's `tests/` to a temporary directory and, in its `test_grpo_trainer.py`, replaces the
   one line `from trl import GRPOConfig, GRPOTrainer`: `--trainer grpo` imports fastes'
   GRPOConfig/GRPOTrainer, `--trainer es` imports `ESConfig as GRPOConfig, ESTrainer as GRPOTrainer`, and
   `--trainer trl` leaves it as is (TRL itself: the baseline that shows the substitutions below are sound).
   Nothing else in the test bodies changes except the hub ids of step 2. No TRL code is kept in this
   repository: the copy lives only for the run.
2. Builds, once (cached under $FASTES_CACHE_DIR/trl-tests, else ~/.cache/fastes/trl-tests), random-weight tiny
   models of the architectures named by the file's `trl-internal-testing/tiny-*` ids that transformers can
   build from a config class, each saved with `save_pretrained` beside fastes' offline character tokenizer
   (with a chat template and a pad token; the sequence classifiers have num_labels=1 and `pad_token_id`). The
   ids are replaced in the copied file by the local paths (a plain string replacement; test names are reported
   with the original ids). Ids it cannot build (vision-language models, custom remote code) stay as they are,
   and their tests are "not applicable: needs a hub model". A pytest plugin makes
   `datasets.load_dataset("trl-internal-testing/zen", CONFIG, ...)` return local rows of the same shape,
   written by this script (17 train rows and 2 test rows, as the hub dataset has; split=None gives a
   DatasetDict, streaming=True an IterableDataset); every other call goes to the real `load_dataset`. The
   causal LMs are tuned to end a completion after about `EOS_MEAN_LENGTH` tokens (their EOS logit is raised
   along the mean final hidden state): with plain random weights no completion ever ends, so every test that
   keeps TRL's default max_completion_length=512 would generate 512 tokens per completion for 51 steps, an
   hour of CPU for the file. The one test that relies on completions never ending (all truncated) then fails
   with TRL too and is reported not applicable as a substitution fault.
3. Runs pytest on that file with `--junitxml`, in one process. The per-test time limit (`--timeout`, default
   300 s) is a SIGALRM set by the plugin around each test's call phase: pytest-timeout is not installed here,
   and the alarm turns a stuck test into an ordinary failure ("timed out after N s") without losing the rest
   of the run. A test stuck in C code that ignores the signal is caught by a whole-run watchdog: the plugin
   logs each finished test to a progress file, the run is killed after `--run-timeout`, the test in flight is
   recorded as timed out, and pytest is started again without the tests already done.
4. Classifies every test (parametrised cases separately): passed; failed, with the first line of the error; or
   not applicable, with a reason: a skip or xfail marker of TRL's (GPU, vLLM, Liger, jmespath, bitsandbytes,
   kernels), a test of TRL internals (TRL_INTERNALS below), a GRPO-only feature under `--trainer es`
   (GRPO_ONLY below), a model that must come from the hub, or a test that fails under `--trainer trl` with the
   same substitutions (read from `--baseline`, by default the newest benchmarks/results/trl-tests-trl-*.json).
   Prints one line per test, then the counts, the share of applicable tests that passed, the TRL commit, the
   installed TRL version and the fastes commit; `--json OUT` writes all of it. For grpo and es it also lists,
   read from the test source, every GRPOConfig(...) / GRPOTrainer(...) keyword the failing tests pass that
   fastes' classes do not take (a failing test names only the first).

The tests import trl from the checkout by default (`--trl-from installed` for the installed package): a
checkout's tests/testing_utils.py imports names other TRL releases lack. `--from-json A.json [B.json ...]`
runs nothing and classifies earlier runs' outcomes again (the union of their tests), e.g. after the
baseline changed, or to merge a run split with -k.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEST_FILE = "test_grpo_trainer.py"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
IMPORTS = {
    "trl": TRL_IMPORT,
    "grpo": "from fastes import GRPOConfig, GRPOTrainer",
    "es": "from fastes import ESConfig as GRPOConfig, ESTrainer as GRPOTrainer",
}
HUB_PREFIX = "trl-internal-testing/"
ZEN = "trl-internal-testing/zen"
EOS_MEAN_LENGTH = 12  # tokens a completion of the tiny causal LMs lasts on average (see step 2)


def _table(text: str) -> dict[str, str]:
    """{key: reason} from lines "key" followed by indented lines of its reason."""
    table: dict[str, str] = {}
    key = ""
    for line in text.strip("\n").splitlines():
        if line.startswith(" "):
            table[key] = f"{table[key]} {line.strip()}".strip()
        else:
            key = line.strip()
            table[key] = ""
    return table


# Not applicable to any drop-in: tests of TRL's internals (read in TRL f2cd57710, July 2026). Keys are
# "Class::test" (every parametrised case), "Class::test[id]" (one case) or "Class::*" (the whole class).
TRL_INTERNALS = _table("""
TestGetHighEntropyMask::*
    calls GRPOTrainer.get_high_entropy_mask with a Mock trainer and a mocked accelerator:
    TRL's helper through TRL's private layout
TestGRPORolloutDispatch::*
    builds the trainer with object.__new__ and calls the private _generate with TRL's private
    attributes (_tokenizer, _metrics, vllm_generation)
TestTransformersContinuousBatchingContract::*
    tests transformers' continuous-batching API, not the trainer
TestGRPOTrainer::test_entropy_bonus_flows_gradients
    reads trainer._entropy_bonus_enabled and calls the private _get_per_token_logps_and_entropies
TestGRPOTrainer::test_compute_liger_loss_passes_vllm_is_ratio
    patches the private _generate_and_score_completions and trainer.liger_loss
TestGRPOTrainer::test_train_reward_func_with_log_extra
    asserts on the private trainer._logs["extra"]
TestGRPOTrainer::test_prepare_input_called_with_correct_data
    patches GRPOTrainer.training_step (the transformers.Trainer method TRL subclasses), checks its
    call arguments, and expects the hub dataset's exact prompts
TestGRPOTrainer::test_train_with_mask_truncated_completions
    patches transformers' GenerationMixin.generate to return Qwen2.5's token ids (151643, 151645):
    assumes generation through HF generate with that vocabulary
TestGRPOTrainer::test_liger_kernel_with_peft_lm_head_raises
    checks TRL's guard for the Liger GRPO loss (liger-kernel)
TestGRPOTrainer::test_liger_kernel_with_peft_non_lm_head_target_allowed
    checks TRL's guard for the Liger GRPO loss (expects ImportError without liger-kernel)
TestGRPOTrainer::test_liger_kernel_with_peft_modules_to_save_lm_head_allowed
    checks TRL's guard for the Liger GRPO loss (expects ImportError without liger-kernel)
TestGRPOTrainer::test_liger_kernel_with_peft_prompt_learning_raises
    checks TRL's guard for the Liger GRPO loss (liger-kernel)
TestGRPOTrainerVLM::*
    vision: vision-language models and image datasets from the hub
    (tiny-*ForConditionalGeneration, zen-image)
TestGRPOTrainer::test_trust_remote_code
    needs a hub model with custom code (tiny-RemoteForCausalLM)
""")

# Not applicable to ES (--trainer es): GRPO-only settings. A test that only trains on prompts and rewards
# applies to ES.
GRPO_ONLY = _table("""
TestGRPOTrainer::test_train_loss_types
    GRPO loss types (loss_type)
TestGRPOTrainer::test_train_eval_on_start
    sets loss_type="grpo" (its regression is in the GRPO loss)
TestGRPOTrainer::test_train_multiple_iterations
    num_iterations: several policy-gradient steps on one generation batch
TestGRPOTrainer::test_train_moe_peft_model
    beta=0.1: KL to a reference model
TestGRPOTrainer::test_train_with_sync_ref_model
    reference model and its sync (beta, sync_ref_model)
TestGRPOTrainer::test_train_beta_non_zero
    beta: KL to a reference model
TestGRPOTrainer::test_get_off_policy_mask
    off-policy masking of the GRPO loss
TestGRPOTrainer::test_get_off_policy_mask_padding
    off-policy masking of the GRPO loss
TestGRPOTrainer::test_train_with_off_policy_mask
    off-policy masking of the GRPO loss
TestGRPOTrainer::test_train_with_off_policy_mask_with_liger
    off-policy masking of the GRPO loss
TestGRPOTrainer::test_train_with_bias_correction_kl
    beta and use_bias_correction_kl: the KL estimator
TestGRPOTrainer::test_train_with_static_entropy
    entropy bonus in the loss (entropy_coef)
TestGRPOTrainer::test_train_with_adaptive_entropy
    adaptive entropy bonus in the loss
TestGRPOTrainer::test_entropy_bonus_scale
    entropy bonus in the loss, per loss type
TestGRPOTrainer::test_train_with_adaptive_entropy_gradient_accumulation
    adaptive entropy bonus under gradient accumulation
TestGRPOTrainer::test_train_with_entropy_filter
    top_entropy_quantile: token masking of the loss
TestGRPOTrainer::test_train_normalize_then_sum_aggregation
    multi_objective_aggregation: per-function normalisation within a prompt's group (GRPO advantages)
TestGRPOTrainer::test_reward_metric_reflects_reward_weights[normalize_then_sum]
    multi_objective_aggregation="normalize_then_sum" (GRPO advantages)
TestGRPOTrainer::test_train_scale_rewards
    scale_rewards: GRPO advantage normalisation
TestGRPOTrainer::test_train_with_mask_truncated_completions_all_masked
    mask_truncated_completions with loss_type="dapo": masking tokens of the GRPO loss
TestGRPOTrainer::test_warning_raised_sequence_level_with_token_summed_loss
    importance_sampling_level with loss_type
TestGRPOTrainer::test_train_delta_clipping
    delta: two-sided clipping of the importance ratio
TestGRPOTrainer::test_train_sequence_importance_sampling
    sequence-level importance sampling
""")

# -----------------------------------------------------------------------------------------------------------
# Tiny models. Every causal LM gets these sizes (filtered by what its config class accepts).
# -----------------------------------------------------------------------------------------------------------
SIZES: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=2048,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=0,
    n_shared_experts=1,
    # hybrid Mamba models (NemotronH)
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=1,
    mamba_n_groups=1,
    # sliding-window models
    sliding_window=512,
)
EXTRA_TOKENS = ["<|finetune_right_pad_id|>"]  # the Llama reward tokenizer's pad token, set by one test
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Own text for the local zen rows: 19 short lines in the tokenizer's alphabet (lower case).
LINES = [
    "a small model learns to count",
    "the river runs past the mill",
    "seven birds sat on a wire",
    "rain is better than dust",
    "keep the garden tidy",
    "the clock strikes nine",
    "bread rises in a warm room",
    "two plus three makes five",
    "a lamp burns by the door",
    "the road turns left at the hill",
    "cold tea is still tea",
    "the cat sleeps in the sun",
    "every map leaves something out",
    "wind moves the tall grass",
    "short answers are easy to check",
    "the boat waits at the dock",
    "a letter came on tuesday",
    "green apples fall in autumn",
    "the last train leaves at ten",
]


def cache_dir() -> Path:
    """Where the tiny models live: $FASTES_CACHE_DIR/trl-tests, else ~/.cache/fastes/trl-tests."""
    root = os.environ.get("FASTES_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastes"
    )
    return Path(root) / "trl-tests"


def class_name(hub_id: str) -> str:
    """'trl-internal-testing/tiny-Qwen2ForCausalLM-2.5' -> 'Qwen2ForCausalLM'."""
    name = hub_id.split("/", 1)[1]
    name = name.removeprefix("tiny-")
    return name.split("-", 1)[0]


def hub_ids(source: str) -> list[str]:
    """The trl-internal-testing/tiny-* model ids a test file names, sorted."""
    return sorted(set(re.findall(r"trl-internal-testing/tiny-[A-Za-z0-9_.-]+", source)))


def zen_rows(config: str) -> dict[str, list[dict[str, Any]]]:
    """Rows shaped like trl-internal-testing/zen's CONFIG: {"train": 17 rows, "test": 2 rows}."""

    def prompt(line: str) -> str:
        words = line.split()
        return " ".join(words[: max(1, len(words) // 2 + 1)])

    def completion(line: str) -> str:
        words = line.split()
        return " " + " ".join(words[max(1, len(words) // 2 + 1) :])

    rows = []
    for line in LINES:
        if config == "standard_prompt_only":
            rows.append({"prompt": prompt(line)})
        elif config == "conversational_prompt_only":
            rows.append({"prompt": [{"role": "user", "content": f"what comes after {prompt(line)}"}]})
        elif config == "standard_prompt_completion":
            rows.append({"prompt": prompt(line), "completion": completion(line)})
        elif config == "conversational_prompt_completion":
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"what comes after {prompt(line)}"}],
                    "completion": [{"role": "assistant", "content": completion(line).strip()}],
                }
            )
        elif config == "standard_language_modeling":
            rows.append({"text": line})
        elif config == "conversational_language_modeling":
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"what comes after {prompt(line)}"},
                        {"role": "assistant", "content": completion(line).strip()},
                    ]
                }
            )
        else:
            raise ValueError(f"no local rows for zen config {config!r}")
    return {"train": rows[:17], "test": rows[17:]}


def zen_dataset(
    zen: dict[str, Any], name: str | None, split: str | None = None, streaming: bool = False
) -> Any:
    """What load_dataset("trl-internal-testing/zen", name, split=..., streaming=...) returns, from local rows
    (zen: {config: {split: rows}}): a Dataset, or a DatasetDict when split is None; Iterable* when
    streaming."""
    import datasets

    if name not in zen:
        raise ValueError(f"scripts/trl_tests.py has no local rows for zen config {name!r}")
    splits = {s: datasets.Dataset.from_list(rows) for s, rows in zen[name].items()}
    if split is not None:
        ds = splits[split]
        return ds.to_iterable_dataset() if streaming else ds
    if streaming:
        return datasets.IterableDatasetDict({s: d.to_iterable_dataset() for s, d in splits.items()})
    return datasets.DatasetDict(splits)


def tokenizer():
    """fastes' offline character tokenizer, with a chat template, a pad token and room for 2048 positions."""
    from fastes.models.loading import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 2048
    return tok


def _config(cls: Any, tok: Any, classifier: bool) -> Any:
    import inspect

    config_cls = cls.config_class
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    kwargs = {k: v for k, v in SIZES.items() if k in accepted}
    if (
        "layers_block_type" in accepted
    ):  # NemotronH: a Mamba (linear attention) layer, then an attention layer
        kwargs["layers_block_type"] = ["linear_attention", "full_attention"]
    ids = dict(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    config = config_cls(**kwargs, **ids)
    for key, value in {**kwargs, **ids}.items():  # configs that take **kwargs without these names
        if not hasattr(config, key) or key in ids:
            setattr(config, key, value)
    if hasattr(config, "layer_types") and isinstance(config.layer_types, list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    if classifier:
        config.num_labels = 1
    config.tie_word_embeddings = False
    return config


def _end_completions(model: Any, tok: Any, mean_length: int) -> None:
    """Raise the EOS logit so that sampled completions end after about `mean_length` tokens.

    The EOS row of the output head is set to the mean final hidden state (over some text), scaled so that EOS
    gets probability 1/mean_length at that mean; the other rows keep their random weights.
    """
    import torch

    head = model.get_output_embeddings()
    text = [" ".join(LINES[i : i + 3]) for i in range(0, len(LINES), 3)]
    batch = tok(text, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        hidden = out.hidden_states[-1][
            batch["attention_mask"].bool()
        ]  # (tokens, hidden), after the final norm
        mean = hidden.mean(0)
        logits = out.logits[batch["attention_mask"].bool()]
        others = torch.logsumexp(logits, dim=-1).mean()  # about log(vocab) for random weights
        target = others + torch.log(torch.tensor(1.0 / (mean_length - 1)))
        head.weight[tok.eos_token_id] = 0.0
        projection = (hidden @ mean).mean()
        if projection.abs() > 1e-6:
            head.weight[tok.eos_token_id] = mean * (target / projection)


def build_model(hub_id: str, root: Path) -> tuple[Path | None, str]:
    """Build and save the tiny model for `hub_id` under root (once); (path, "") or (None, why not)."""
    name = class_name(hub_id)
    target = root / hub_id
    if (target / "config.json").exists() and (target / "done").exists():
        return target, ""
    if "ConditionalGeneration" in name or name.startswith("Remote"):
        return None, f"needs a hub model ({name} is a vision-language or custom-code model)"
    import torch
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        return None, f"needs a hub model (transformers {transformers.__version__} has no {name})"
    tok = tokenizer()
    classifier = "SequenceClassification" in name
    try:
        torch.manual_seed(0)
        model = cls(_config(cls, tok, classifier)).float()
        if not classifier:
            _end_completions(model, tok, EOS_MEAN_LENGTH)
            model.generation_config.pad_token_id = tok.pad_token_id
            model.generation_config.eos_token_id = tok.eos_token_id
            model.generation_config.bos_token_id = tok.bos_token_id
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        model.save_pretrained(target)
        tok.save_pretrained(target)
        (target / "done").write_text(hub_id + "\n")
    except Exception as exc:  # an architecture transformers cannot build small from its config class
        shutil.rmtree(target, ignore_errors=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"needs a hub model (cannot build {name} from its config: {type(exc).__name__}: {first})"
    return target, ""


# -----------------------------------------------------------------------------------------------------------
# Preparing the copy
# -----------------------------------------------------------------------------------------------------------
def swap_import(source: str, trainer: str) -> str:
    """The test file with TRL's trainer import replaced by `trainer`'s; refuses a file without that import."""
    if TRL_IMPORT not in source:
        raise SystemExit(f"{TEST_FILE} has no line {TRL_IMPORT!r}: is this a TRL checkout of 2025 or later?")
    return source.replace(TRL_IMPORT, IMPORTS[trainer], 1)


def substitute_ids(source: str, paths: dict[str, Path]) -> str:
    """Replace each hub id by its local path (longest ids first, so no id is a prefix of another's match)."""
    for hub_id in sorted(paths, key=len, reverse=True):
        source = re.sub(re.escape(hub_id) + r"(?![A-Za-z0-9_.-])", str(paths[hub_id]), source)
    return source


PLUGIN = r'''
"""Written by fastes' scripts/trl_tests.py: local zen rows, a per-test alarm and a progress log."""
import json, os, signal, sys

import pytest

_ZEN = json.load(open(os.environ["FASTES_TRL_ZEN"]))
if _ZEN:  # local rows to serve (none: leave datasets alone)
    import datasets

    from trl_tests import zen_dataset

    _real_load_dataset = datasets.load_dataset

    def _local(path, name=None, *args, split=None, streaming=False, **kwargs):
        if path != "trl-internal-testing/zen":
            return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
        return zen_dataset(_ZEN, name, split=split, streaming=streaming)

    datasets.load_dataset = _local
_TIMEOUT = int(os.environ.get("FASTES_TRL_TIMEOUT", "300"))
_PROGRESS = os.environ.get("FASTES_TRL_PROGRESS")


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"timed out after {_TIMEOUT} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _PROGRESS:
        with open(_PROGRESS, "a") as f:
            f.write(json.dumps({"start": item.nodeid}) + "\n")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(_TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def pytest_runtest_logreport(report):
    if _PROGRESS and (report.when == "call" or report.outcome != "passed" or report.when == "teardown"):
        with open(_PROGRESS, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "duration": report.duration,
                                "longrepr": str(report.longrepr)[-4000:] if report.longrepr else ""}) + "\n")
'''


def prepare(
    trl: Path, trainer: str, workdir: Path, trl_from: str = "checkout"
) -> tuple[Path, dict[str, str]]:
    """Copy trl/tests into workdir and prepare it; returns (test file, {hub id: why not buildable}).

    With trl_from="checkout" the checkout's own `trl` package is copied to workdir/trl-src too, and run_pytest
    puts it first on the path: the tests then meet the TRL they were written for (their testing_utils imports
    names that other TRL releases lack).
    """
    shutil.copytree(trl / "tests", workdir / "tests")
    if trl_from == "checkout":
        shutil.copytree(trl / "trl", workdir / "trl-src" / "trl")
    test_file = workdir / "tests" / TEST_FILE
    source = swap_import(test_file.read_text(), trainer)
    root = cache_dir()
    paths, missing = {}, {}
    for hub_id in hub_ids(source):
        path, why = build_model(hub_id, root)
        if path is None:
            missing[hub_id] = why
        else:
            paths[hub_id] = path
    test_file.write_text(substitute_ids(source, paths))
    zen = {c: zen_rows(c) for c in ("standard_prompt_only", "conversational_prompt_only")}
    (workdir / "zen.json").write_text(json.dumps(zen))
    (workdir / "fastes_trl_plugin.py").write_text(PLUGIN)
    return test_file, missing


# -----------------------------------------------------------------------------------------------------------
# Running
# -----------------------------------------------------------------------------------------------------------
def run_pytest(
    workdir: Path, k: str | None, timeout: int, run_timeout: int, paths_root: Path
) -> tuple[list[dict[str, Any]], float]:
    """Run the copied file; returns (one outcome dict per test, seconds). Restarts after a stuck test."""
    env = dict(os.environ)
    path = [str(workdir), str(REPO), str(REPO / "scripts")]
    if (workdir / "trl-src").exists():
        path.insert(0, str(workdir / "trl-src"))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(
        FASTES_TRL_ZEN=str(workdir / "zen.json"),
        FASTES_TRL_TIMEOUT=str(timeout),
        FASTES_TRL_PROGRESS=str(workdir / "progress.jsonl"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        # The models are tiny: a second thread costs more than it gives, and more so on a shared machine.
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        WANDB_DISABLED="true",
    )
    results: dict[str, dict[str, Any]] = {}
    deselect: list[str] = []
    start = time.monotonic()
    for attempt in range(50):
        junit = workdir / f"junit-{attempt}.xml"
        progress = workdir / "progress.jsonl"
        progress.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            f"tests/{TEST_FILE}",
            "-p",
            "fastes_trl_plugin",
            "-q",
            "-rN",
            "-p",
            "no:cacheprovider",
            "--disable-warnings",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
        ]
        if k:
            cmd += ["-k", k]
        for nodeid in deselect:
            cmd += ["--deselect", nodeid]
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, start_new_session=True)
        try:
            proc.wait(timeout=run_timeout)
            stuck = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            stuck = True
        if junit.exists() and not stuck:
            for case in parse_junit(junit.read_text(), paths_root):
                results[case["id"]] = case
            break
        # Killed or crashed: keep what the progress log says, mark the test in flight, start again
        # without both.
        done, current = read_progress(progress, paths_root)
        results.update(done)
        if current is None:
            break
        results[current[0]] = {
            "id": current[0],
            "outcome": "failed",
            "message": f"timed out (whole run killed after {run_timeout} s)"
            if stuck
            else "the pytest process died during this test",
            "seconds": None,
        }
        deselect += [c["nodeid"] for c in done.values()] + [current[1]]
        deselect = sorted(set(deselect))
    return list(results.values()), time.monotonic() - start


def _name(classname: str, name: str, paths_root: Path) -> str:
    cls = classname.rsplit(".", 1)[-1]
    return f"{cls}::{name}".replace(str(paths_root) + "/", "")


WORKDIR = re.compile(r"/\S*?fastes-trl-tests-[^/\s]+/")  # the temporary copy, in error lines


def local_names(text: str, paths_root: Path | str) -> str:
    """text with this machine's model paths back to hub ids and the temporary copy's path dropped."""
    return WORKDIR.sub("", text.replace(str(paths_root) + "/", ""))


def first_line(text: str | None) -> str:
    """The first non-empty line of an error message."""
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def parse_junit(xml: str, paths_root: Path | str = "/nonexistent") -> list[dict[str, Any]]:
    """One dict per testcase: id ("Class::test[param]" with the hub ids restored), outcome, message, seconds.

    outcome is "passed", "failed" (a failure or an error element) or "skipped" (skip, or xfail with its
    reason).
    """
    out = []
    for case in ET.fromstring(xml).iter("testcase"):
        cid = _name(case.get("classname", ""), case.get("name", ""), Path(paths_root))
        entry = {"id": cid, "outcome": "passed", "message": "", "seconds": float(case.get("time") or 0.0)}
        for child in case:
            if child.tag in ("failure", "error"):
                entry["outcome"] = "failed"
                entry["message"] = first_line(child.get("message")) or first_line(child.text)
                entry["message"] = local_names(entry["message"], paths_root)  # hub ids, not local paths
                break
            if child.tag == "skipped":
                entry["outcome"] = "skipped"
                kind = child.get("type", "")
                reason = first_line(child.get("message")) or first_line(child.text)
                entry["message"] = ("xfail: " if "xfail" in kind else "") + reason
        out.append(entry)
    return out


def read_progress(path: Path, paths_root: Path) -> tuple[dict[str, dict[str, Any]], tuple[str, str] | None]:
    """Finished tests, and the (id, nodeid) of the test in flight if any, from the plugin's progress log."""

    def test_id(nodeid: str) -> str:
        return nodeid.split("::", 1)[1].replace(str(paths_root) + "/", "")

    done: dict[str, dict[str, Any]] = {}
    current = None
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        if "start" in rec:
            current = rec["start"]
            continue
        cid = test_id(rec["nodeid"])
        entry = done.setdefault(
            cid, {"id": cid, "nodeid": rec["nodeid"], "outcome": "passed", "message": "", "seconds": 0.0}
        )
        entry["seconds"] += rec["duration"]
        if rec["outcome"] == "failed" and entry["outcome"] != "failed":
            message = local_names(last_line(rec["longrepr"]), paths_root)
            entry["outcome"], entry["message"] = "failed", message
        elif rec["outcome"] == "skipped" and entry["outcome"] == "passed":
            skip = re.fullmatch(r"\(.*, \d+, ['\"](.*)['\"]\)", rec["longrepr"].strip())  # (path, line, why)
            why = skip.group(1) if skip else first_line(rec["longrepr"])
            entry["outcome"], entry["message"] = "skipped", why.removeprefix("Skipped: ")
        if rec["when"] == "teardown":
            current = None
    return done, (None if current is None else (test_id(current), current))


def last_line(text: str | None) -> str:
    """The error of a pytest traceback: its first "E   ..." line without the "E" (else its last line)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    errors = [line.removeprefix("E").strip() for line in lines if line.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "")[:300]


# -----------------------------------------------------------------------------------------------------------
# Classifying
# -----------------------------------------------------------------------------------------------------------
def lookup(table: dict[str, str], test_id: str) -> str | None:
    """The reason `table` gives for test_id ("Class::test[param]"): for the case, the test or the class."""
    base = test_id.split("[", 1)[0]
    cls = base.split("::", 1)[0]
    for key in (test_id, base, f"{cls}::*"):
        if key in table:
            return table[key]
    return None


def classify(
    cases: list[dict[str, Any]],
    trainer: str,
    baseline: dict[str, dict[str, Any]] | None = None,
    missing: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each case with "status" (passed / failed / not applicable) and "reason" (error line or why n.a.)."""
    out = []
    for case in cases:
        test_id, outcome, message = case["id"], case["outcome"], case.get("message", "")
        reason = None
        if outcome == "skipped":
            reason = (
                f"skipped by TRL's marker: {message}"
                if not message.startswith("xfail")
                else (f"marked xfail by TRL ({message[len('xfail: ') :]})")
            )
        if reason is None:
            reason = lookup(TRL_INTERNALS, test_id)
            reason = f"TRL internals: {reason}" if reason else None
        if reason is None:
            hub = [h for h in (missing or {}) if h in test_id]
            reason = f"{missing[hub[0]]}: {hub[0]}" if hub else None
        if reason is None and trainer == "es":
            reason = lookup(GRPO_ONLY, test_id)
            reason = f"GRPO only: {reason}" if reason else None
        if reason is None and trainer != "trl" and baseline is not None:
            base = baseline.get(test_id)
            if base is not None and base["status"] == "failed":
                reason = f"fails with TRL too under the local models and data: {base['reason']}"
        if reason is not None:
            status = "not applicable"
        elif outcome == "passed":
            status, reason = "passed", ""
        else:
            status, reason = "failed", message or "(no message)"
        out.append({**case, "status": status, "reason": reason})
    return sorted(out, key=lambda c: c["id"])


def names_passed(source: str) -> dict[str, dict[str, set[str]]]:
    """{"Class::test": {"GRPOConfig": keyword names, "GRPOTrainer": keyword names}} of a test file's calls."""
    import ast

    out: dict[str, dict[str, set[str]]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            names: dict[str, set[str]] = {"GRPOConfig": set(), "GRPOTrainer": set()}
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                    names[node.func.id] |= {k.arg for k in node.keywords if k.arg}
            out[f"{cls.name}::{fn.name}"] = names
    return out


def names_missing(
    source: str, trainer: str, results: list[dict[str, Any]]
) -> dict[str, dict[str, list[str]]]:
    """The keyword names that failing tests pass to GRPOConfig(...) / GRPOTrainer(...) and `trainer`'s
    classes do not take: {"GRPOConfig": {name: [tests]}, "GRPOTrainer": {...}}. A test stops at the first
    unknown name; this lists them all, read from the test source."""
    import dataclasses
    import inspect

    import fastes

    config, cls = (
        (fastes.ESConfig, fastes.ESTrainer) if trainer == "es" else (fastes.GRPOConfig, fastes.GRPOTrainer)
    )
    taken = {
        "GRPOConfig": {f.name for f in dataclasses.fields(config)},
        "GRPOTrainer": set(inspect.signature(cls.__init__).parameters),
    }
    failing = {r["id"].split("[", 1)[0] for r in results if r["status"] == "failed"}
    out: dict[str, dict[str, list[str]]] = {"GRPOConfig": {}, "GRPOTrainer": {}}
    for test, names in names_passed(source).items():
        if test not in failing:
            continue
        for what, passed in names.items():
            for name in sorted(passed - taken[what]):
                out[what].setdefault(name, []).append(test)
    return {what: dict(sorted(d.items(), key=lambda kv: (-len(kv[1]), kv[0]))) for what, d in out.items()}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "not applicable")}
    applicable = counts["passed"] + counts["failed"]
    return {
        **counts,
        "applicable": applicable,
        "total": len(results),
        "percent_passed_of_applicable": round(100.0 * counts["passed"] / applicable, 1)
        if applicable
        else None,
    }


def git_commit(git_dir_or_tree: Path) -> str | None:
    for args in (["-C", str(git_dir_or_tree)], ["--git-dir", str(git_dir_or_tree)]):
        r = subprocess.run(["git", *args, "rev-parse", "HEAD"], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip()
    return None


def default_baseline() -> Path | None:
    files = sorted((REPO / "benchmarks" / "results").glob("trl-tests-trl-*.json"))
    return files[-1] if files else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--trl", type=Path, required=True, help="a TRL checkout (its tests/ is copied, not changed)"
    )
    p.add_argument("--trainer", choices=sorted(IMPORTS), required=True)
    p.add_argument("-k", dest="k", help="pytest -k expression: run only these tests")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--commit", help="the checkout's TRL commit, when it has no .git")
    p.add_argument("--baseline", type=Path, help="--trainer trl results (default: the newest committed one)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per test (default 300)")
    p.add_argument(
        "--run-timeout",
        type=int,
        default=4 * 3600,
        help="seconds for the whole run before it is restarted without the test in flight (default 4 h)",
    )
    p.add_argument(
        "--trl-from",
        choices=["checkout", "installed"],
        default="checkout",
        help="import trl from the checkout (default; the tests' own TRL) or the installed package",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="run nothing: classify the outcomes of an earlier --json file again (current tables and "
        "baseline)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))  # this checkout's fastes, as the tests get it (not an installed one)

    trl = args.trl.resolve()
    if not (trl / "tests" / TEST_FILE).exists():
        p.error(f"{trl}/tests/{TEST_FILE} not found: pass a TRL checkout")
    trl_commit = args.commit or git_commit(trl)
    baseline = None
    if args.trainer != "trl":
        path = args.baseline or default_baseline()
        if path is not None:
            baseline = {r["id"]: r for r in json.loads(path.read_text())["tests"]}
            print(f"baseline: {path}")
    import trl as trl_pkg

    earlier: dict[str, Any] = {}
    if args.from_json:  # several files: the union of their tests (a later file's outcome wins)
        runs = [json.loads(path.read_text()) for path in args.from_json]
        earlier = runs[0]
        by_id: dict[str, dict[str, Any]] = {}
        for path, run in zip(args.from_json, runs):
            if run["trainer"] != args.trainer:
                p.error(f"{path} is a --trainer {run['trainer']} run, not {args.trainer}")
            for t in run["tests"]:
                by_id[t["id"]] = {k: t[k] for k in ("id", "outcome", "message", "seconds")}
        cases = list(by_id.values())
        for case in cases:  # runs before error lines were cleaned
            case["message"] = local_names(case["message"], cache_dir())
        missing = {k: v for run in runs for k, v in run.get("models_not_built", {}).items()}
        seconds = sum(run["seconds"] for run in runs)
        trl_commit = earlier["trl_commit"]
        args.k = None if len(runs) > 1 else earlier["k"]
    else:
        workdir = Path(tempfile.mkdtemp(prefix="fastes-trl-tests-"))
        try:
            _, missing = prepare(trl, args.trainer, workdir, args.trl_from)
            cases, seconds = run_pytest(workdir, args.k, args.timeout, args.run_timeout, cache_dir())
        finally:
            if args.keep:
                print(f"kept {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    results = classify(cases, args.trainer, baseline, missing)
    for r in results:
        secs = f"{r['seconds']:7.1f}s" if r.get("seconds") is not None else "      -"
        print(f"{r['status']:<15} {secs}  {r['id']}" + (f"  -- {r['reason']}" if r["reason"] else ""))
    s = summary(results)
    info = {
        "trainer": args.trainer,
        "import": IMPORTS[args.trainer],
        "trl_commit": trl_commit,
        "trl_installed_version": trl_pkg.__version__,
        "trl_imported_from": args.trl_from,
        "trl_checkout_version": (trl / "VERSION").read_text().strip() if (trl / "VERSION").exists() else None,
        "fastes_commit": git_commit(REPO),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(seconds, 1),
        "k": args.k,
        "python": sys.version.split()[0],
        "models_not_built": missing,
    }
    for key in ("fastes_commit", "date", "trl_imported_from", "python", "trl_installed_version"):
        info[key] = earlier.get(key, info[key])  # a reclassification keeps the run's own facts
    if earlier:
        info["reclassified_from"] = [str(path) for path in args.from_json]
    print(
        f"\n{s['passed']} passed, {s['failed']} failed, {s['not applicable']} not applicable "
        f"({s['percent_passed_of_applicable']}% of {s['applicable']} applicable passed) in {seconds:.0f} s\n"
        f"trainer {args.trainer}: {IMPORTS[args.trainer]}\n"
        f"TRL commit {trl_commit} (checkout version {info['trl_checkout_version']}, trl imported from the "
        f"{info['trl_imported_from']}), installed TRL {info['trl_installed_version']}, fastes commit "
        f"{info['fastes_commit']}"
    )
    if args.trainer != "trl":
        info["names_missing"] = names_missing((trl / "tests" / TEST_FILE).read_text(), args.trainer, results)
        for what, names in info["names_missing"].items():
            listed = ", ".join(f"{name} ({len(tests)})" for name, tests in names.items())
            print(f"{what} keywords that failing tests pass and fastes does not take: {listed or 'none'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "summary": s, "tests": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
