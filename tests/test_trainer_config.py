"""fastes.GRPOConfig / ESConfig take every field of TRL's GRPOConfig, each with one outcome (honoured,
choices, inert, refused) that docs/trainer.md lists; inert values warn in one line, refused ones fail
in one line before any work."""

import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from fastes import ESConfig, GRPOConfig
from fastes.errors import ConfigError
from fastes.trainer.configs import OUTCOMES, fields_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
# TRL's defaults that fastes' GRPOConfig does not take, and why.
OWN_DEFAULTS = {
    "output_dir": "TRL's None becomes 'trainer_output' in its __post_init__; fastes states it",
    "logging_steps": "TRL's type is float",
}


def test_docs_hold_the_table_the_configs_give():
    text = DOCS.read_text()
    start = text.index("<!-- fields table: python -m fastes.trainer.configs -->\n")
    end = text.index("<!-- end of the fields table -->")
    assert text[start:end].split("\n", 1)[1] == fields_table()


@pytest.mark.parametrize("config", [ESConfig, GRPOConfig])
def test_every_field_has_one_outcome_and_a_reason(config):
    for f in dataclasses.fields(config):
        assert f.metadata.get("outcome") in OUTCOMES, f.name
        assert f.metadata.get("note"), f.name


@pytest.mark.parametrize("config", [ESConfig, GRPOConfig])
def test_every_field_of_the_installed_trl_is_a_field_here(config):
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'fastes[trl]')")
    ours = {f.name for f in dataclasses.fields(config)}
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert theirs - ours == set(), f"TRL {trl.__version__} has fields fastes.{config.__name__} lacks"
    assert all(f"| `{name}` |" in DOCS.read_text() for name in theirs)


def test_grpo_defaults_are_trls():
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'fastes[trl]')")
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    differ = []
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.name in OWN_DEFAULTS:
            continue
        theirs = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        mine = ours[f.name]
        mine = mine.default if mine.default is not dataclasses.MISSING else mine.default_factory()
        if mine != theirs:
            differ.append((f.name, mine, theirs))
    assert differ == []


@pytest.mark.parametrize("config", [ESConfig, GRPOConfig])
def test_an_inert_field_set_warns_in_one_line_and_changes_nothing(config, tmp_path):
    base = config(output_dir=str(tmp_path))
    with pytest.warns(UserWarning) as caught:
        args = config(output_dir=str(tmp_path), gradient_checkpointing=False, dataloader_num_workers=4)
    reason = "changes nothing in fastes: speed or memory only; the result is the same"
    assert [str(w.message) for w in caught] == [
        f"gradient_checkpointing=False {reason}",
        f"dataloader_num_workers=4 {reason}",
    ]
    assert args.overrides(8) == base.overrides(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # defaults, given or not, say nothing
        config(output_dir=str(tmp_path), gradient_checkpointing=True, dataloader_num_workers=0)


@pytest.mark.parametrize(
    "config, field, value, message",
    [
        (GRPOConfig, "push_to_hub", True, "push_to_hub=True is not supported by GRPOConfig (fastes does not"),
        (
            GRPOConfig,
            "neftune_noise_alpha",
            5.0,
            "neftune_noise_alpha=5.0 is not supported by GRPOConfig (no",
        ),
        (
            GRPOConfig,
            "generation_kwargs",
            {"num_beams": 2},
            "generation_kwargs: fastes samples with temperature",
        ),
        (
            GRPOConfig,
            "deepspeed",
            "ds.json",
            "deepspeed='ds.json' is not supported by GRPOConfig (launch with",
        ),
        (ESConfig, "beta", 0.04, "beta=0.04 is not supported by ESConfig (GRPO only: ES has no loss"),
        (ESConfig, "loss_type", "grpo", "loss_type='grpo' is not supported by ESConfig (GRPO only"),
        (ESConfig, "gradient_accumulation_steps", 4, "gradient_accumulation_steps=4 is not supported by ES"),
        (ESConfig, "lr_scheduler_kwargs", {"num_cycles": 2}, "lr_scheduler_kwargs={'num_cycles': 2} is not"),
        (GRPOConfig, "save_strategy", "epoch", "save_strategy: 'epoch' is not supported by GRPOConfig"),
        (GRPOConfig, "model_init_kwargs", {"attn_implementation": "sdpa"}, "model_init_kwargs: fastes takes"),
        (GRPOConfig, "use_vllm", True, "use_vllm=True: vLLM is not installed"),
    ],
)
def test_a_refused_value_fails_in_one_line_naming_the_field(config, field, value, message, tmp_path):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as caught:
        config(output_dir=str(tmp_path), **{field: value})
    assert "\n" not in str(caught.value)


def test_a_refused_value_set_after_construction_fails_when_used(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path))
    args.push_to_hub = True
    with pytest.raises(ConfigError, match="^push_to_hub=True is not supported"):
        args.check()


@pytest.mark.parametrize(
    "settings, dtype",
    [
        ({"bf16": True}, "bfloat16"),
        ({"fp16": True}, "float16"),
        ({"model_init_kwargs": {"dtype": "bfloat16"}}, "bfloat16"),
        ({}, "float32"),
    ],
)
def test_precision_fields_choose_the_dtype_a_model_path_loads_in(settings, dtype, tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), **settings).overrides(8)["dtype"] == dtype


def test_epochs_count_prompts_and_max_steps_wins(tmp_path):
    es = ESConfig(output_dir=str(tmp_path), max_steps=-1, num_train_epochs=3.0, per_device_train_batch_size=4)
    assert es.overrides(10)["es.iterations"] == 8  # ceil(3 * 10 / 4)
    grpo = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3)
    assert grpo.overrides(17)["grpo.steps"] == 26  # ceil(3 epochs * 17 rows / 2 prompts)
    assert GRPOConfig(output_dir=str(tmp_path), max_steps=5).overrides(17)["grpo.steps"] == 5


@pytest.mark.parametrize(
    "value, key", [(True, "group"), (False, "none"), ("batch", "batch"), ("none", "none")]
)
def test_scale_rewards_takes_trls_values(value, key, tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), scale_rewards=value).overrides(8)["grpo.scale_rewards"] == key


def test_es_samples_at_trls_temperature_only_when_asked_for_several(tmp_path):
    one = ESConfig(output_dir=str(tmp_path)).overrides(8)
    several = ESConfig(output_dir=str(tmp_path), num_generations=3).overrides(8)
    assert (one["es.num_generations"], one["es.temperature"]) == (1, 0.0)
    assert (several["es.num_generations"], several["es.temperature"]) == (3, 1.0)


def test_eval_strategy_steps_evaluates_every_eval_steps(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path)).overrides(8)["eval_every"] == 0
    steps = GRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=2)
    assert steps.overrides(8)["eval_every"] == 2
    assert GRPOConfig(output_dir=str(tmp_path), eval_strategy="steps").overrides(8)["eval_every"] == 10


@pytest.mark.parametrize("config, section", [(ESConfig, "es"), (GRPOConfig, "grpo")])
def test_sampling_fields_and_generation_kwargs_reach_the_section(config, section, tmp_path):
    args = config(output_dir=str(tmp_path), num_generations=2, top_k=5, min_p=None, repetition_penalty=1.3)
    values = args.overrides(8)
    assert (values[f"{section}.top_k"], values[f"{section}.min_p"]) == (5, 0.0)
    assert values[f"{section}.repetition_penalty"] == 1.3
    kwargs = {"top_k": 7, "min_p": 0.05, "temperature": 0.7, "max_new_tokens": 9, "do_sample": True}
    values = config(output_dir=str(tmp_path), num_generations=2, top_k=5, generation_kwargs=kwargs).overrides(
        8
    )
    assert (values[f"{section}.top_k"], values[f"{section}.min_p"]) == (7, 0.05)  # as in TRL, they win
    assert (values[f"{section}.temperature"], values["max_new_tokens"]) == (0.7, 9)
