"""peft_config, as TRL's GRPOTrainer takes it: GRPO trains a LoRA adapter, ES evolves its weights, the base
model never changes, resume is exact, and save_model writes an adapter that PEFT loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import is_timing
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import fastes
from fastes import ESConfig, ESTrainer, GRPOConfig, GRPOTrainer
from fastes.checkpoint import latest_checkpoint
from fastes.errors import ConfigError, MissingPackageError
from fastes.es.population import population_batched
from fastes.models import adapters
from fastes.models.loading import (
    ModelError,
    build_tiny_model,
    build_tokenizer,
    char_llama_config,
    load_model,
    tiny_model_path,
)
from fastes.run.rundir import RunDirError
from fastes.tasks import task_dataset

peft = pytest.importorskip("peft")  # the test extra installs it: CI runs every test here
# peft's own calls into transformers 5 warn on every wrap (fastes.models.adapters hides it for its own calls).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

MODEL = str(tiny_model_path())
ROWS, CORRECT = task_dataset("countdown", limit=8)
PROMPTS = ["cd 2 4 8 > 24:", "12+34=", "rev 123:", "cmp 5 7:"]


def lora(**extra) -> peft.LoraConfig:
    """A fresh config each time: peft records the base model's path in the one it is given."""
    return peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, **extra)


def digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def small(tmp_path, config, name="run", **extra):
    """A run of a few seconds on the tiny model, with settings large enough to move the adapter."""
    sizes = (
        {"population_size": 4, "sigma": 0.05, "learning_rate": 0.05}
        if config is ESConfig
        else {"num_generations": 4, "learning_rate": 0.05, "beta": 0.5, "temperature": 1.5}
    )
    # A constant rate: TRL's linear decay would stretch when a resume raises max_steps.
    sizes.update({"lr_scheduler_type": "constant"} if config is GRPOConfig else {})
    settings = {"max_steps": 2, "per_device_train_batch_size": 8, "max_completion_length": 6, **sizes}
    return config(output_dir=str(tmp_path / name), disable_tqdm=True, use_cpu=True, **{**settings, **extra})


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under their own names (a PeftModel's base_layer under the plain name)."""
    if adapters.is_peft_model(model):
        model = model.get_base_model()
    return {
        k.replace(".base_layer", ""): v.clone() for k, v in model.state_dict().items() if "lora_" not in k
    }


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in adapters.trainable(model)}


@torch.no_grad()
def logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    return model(**tokenizer(PROMPTS, return_tensors="pt", padding=True)).logits


def trainer_class(config):
    return ESTrainer if config is ESConfig else GRPOTrainer


@pytest.mark.parametrize("config", [GRPOConfig, ESConfig])
def test_only_the_adapter_trains_and_the_base_stays_bit_identical(config, tmp_path):
    original, _ = load_model(MODEL)
    args = small(tmp_path, config, save_steps=2)
    trainer = trainer_class(config)(
        MODEL, [CORRECT, digits], args=args, train_dataset=ROWS, peft_config=lora()
    )
    start = adapter_weights(trainer._loaded()[0])  # the run's starting adapter (the same seed)
    trainer.train()
    model = trainer.model
    assert adapters.is_peft_model(model)
    trained = adapter_weights(model)
    assert sorted(trained) == sorted(start) and all("lora_" in name for name in trained)
    assert any(not torch.equal(trained[k], start[k]) for k in trained), "the adapter did not move"
    before, after = base_weights(original), base_weights(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # The checkpoint holds the adapter alone, and GRPO's optimizer state only the adapter's tensors.
    _, tensors, state = latest_checkpoint(tmp_path / "run")
    assert {k.removeprefix("model.") for k in tensors if k.startswith("model.")} == set(trained)
    if config is GRPOConfig:
        assert len(state["optimizer"]["layout"]) == len(trained)
        assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(trained)))
        # beta > 0: the KL to the base model (adapter off) is 0 at the first step, then measured.
        kl = [r["kl"] for r in trainer.state.log_history if "kl" in r]
        assert kl[0] == 0.0 and kl[1] > 0.0
    else:  # ES evolved the adapter's lora_A / lora_B, evaluated as one population (materialised)
        assert trainer._loaded()[2].es.eval_mode == "materialised"  # "auto" chosen as the run chose
        evolved = [name for name, _ in fastes.linear_weights(model)]
        assert evolved == [name for name, _ in adapters.trainable(model)]


@pytest.mark.parametrize("config", [GRPOConfig, ESConfig])
def test_a_resumed_adapter_run_equals_the_uninterrupted_one(config, tmp_path):
    def run(name, steps, resume=False):
        args = small(tmp_path, config, name=name, max_steps=steps, save_steps=1)
        trainer = trainer_class(config)(MODEL, digits, args=args, train_dataset=ROWS, peft_config=lora())
        trainer.train(resume_from_checkpoint=resume)
        history = [{k: v for k, v in r.items() if not is_timing(k)} for r in trainer.state.log_history]
        return history, load_file(str(tmp_path / name / "final" / "adapter_model.safetensors"))

    straight, straight_adapter = run("straight", 3)
    run("resumed", 2)
    resumed, resumed_adapter = run("resumed", 3, resume=True)
    assert resumed == straight
    assert straight_adapter.keys() == resumed_adapter.keys()
    assert all(torch.equal(straight_adapter[k], resumed_adapter[k]) for k in straight_adapter)
    with pytest.raises(RunDirError, match="starting model .* has changed"):  # another adapter: another run
        args = small(tmp_path, config, name="resumed", max_steps=4)
        other = trainer_class(config)(
            MODEL, digits, args=args, train_dataset=ROWS, peft_config=lora(lora_alpha=16)
        )
        other.train(resume_from_checkpoint=True)


def test_save_model_writes_an_adapter_that_peft_and_fastes_load(tmp_path):
    args = small(tmp_path, GRPOConfig, max_steps=1)
    trainer = GRPOTrainer(MODEL, digits, args=args, train_dataset=ROWS, peft_config=lora())
    trainer.train()
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = trainer.save_model(tmp_path / "saved")
    tokenizer = build_tokenizer()
    expected = logits(trainer.model, tokenizer)
    for path in (final, saved):
        base, _ = load_model(MODEL)
        by_peft = peft.PeftModel.from_pretrained(base, path)
        torch.testing.assert_close(logits(by_peft, tokenizer), expected, rtol=0, atol=0)
        loaded, loaded_tokenizer = load_model(path)  # fastes eval --model final/ reads it the same way
        assert adapters.is_peft_model(loaded) and adapters.trainable(loaded)  # trainable again
        torch.testing.assert_close(logits(loaded, loaded_tokenizer), expected, rtol=0, atol=0)
    base, _ = load_model(MODEL)
    assert not torch.equal(logits(base, tokenizer), expected)  # the adapter is really in there


def test_a_peft_model_given_as_the_model_trains_its_own_adapter(tmp_path):
    base, tokenizer = load_model(MODEL)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora())
    with torch.no_grad():  # an adapter trained before: it starts away from the base model
        for name, p in adapters.trainable(model):
            p.normal_(std=0.2 if "lora_B" in name else 0.5)
    start, start_logits = adapter_weights(model), logits(model, tokenizer)
    reference = adapters.StartingAdapter(model)
    assert reference.start is not None  # not the identity: the starting adapter is kept, not switched off
    args = small(tmp_path, GRPOConfig, max_steps=2)
    trainer = GRPOTrainer(model, digits, args=args, train_dataset=ROWS, processing_class=tokenizer)
    trainer.train()
    assert trainer.model is model
    assert any(not torch.equal(p, start[name]) for name, p in adapters.trainable(model))
    torch.testing.assert_close(
        reference(**tokenizer(PROMPTS, return_tensors="pt", padding=True)).logits, start_logits
    )
    assert not torch.equal(logits(model, tokenizer), start_logits)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["start_model"]["path"] == "<in-memory PeftModel>"


def test_a_model_object_with_peft_config_is_wrapped_the_same_way_each_time(tmp_path):
    made = []
    for name in ("a", "b"):
        model, tokenizer = load_model(MODEL)
        args = small(tmp_path, ESConfig, name=name, max_steps=1)
        trainer = ESTrainer(
            model, digits, args=args, train_dataset=ROWS, processing_class=tokenizer, peft_config=lora()
        )
        assert adapters.is_peft_model(trainer.model)
        made.append(adapter_weights(trainer.model))
    assert all(torch.equal(made[0][k], made[1][k]) for k in made[0])  # the seed alone: a resume matches


@torch.no_grad()
@pytest.mark.parametrize("mode", ["materialised", "lowrank", "virtual"])
def test_batched_evaluation_of_adapter_members_equals_member_by_member(mode):
    """Every batched mode swaps lora_A / lora_B for population layers inside peft's LoRA layers: each
    member's logits are those of its perturbed adapter (virtual: the Triton kernel, interpreted here)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    shape = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    base = LlamaForCausalLM(char_llama_config(tokenizer, **shape))
    model = peft.get_peft_model(base, lora(init_lora_weights="gaussian")).eval()
    noise_type = "lowrank" if mode == "lowrank" else "full"
    backend = "triton" if mode == "virtual" else "auto"
    weights = fastes.linear_weights(model)
    es = fastes.ES(weights, sigma=0.05, lr=0.01, population=4, noise_type=noise_type, backend=backend)
    batch = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(**batch).logits)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
    if mode != "virtual":  # what es.eval_mode "auto" chooses for an adapter
        assert adapters.auto_eval_mode(model, noise_type) == mode
    with population_batched(es, model, mode=mode):
        got = model(**grouped).logits
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert (expected[0] - expected[1]).abs().max() > 1e-4  # the members differ: the check is not vacuous


def test_mistakes_are_one_line_before_any_work(tmp_path, monkeypatch):
    def make(config=ESConfig, model=MODEL, **extra):
        args = small(tmp_path, config, **extra.pop("args", {}))
        return trainer_class(config)(model, digits, args=args, train_dataset=ROWS, **extra)

    with pytest.raises(ConfigError, match="peft_config: expected a peft.PeftConfig"):
        make(peft_config={"r": 4})
    with pytest.raises(ConfigError, match="PromptTuningConfig is prompt learning"):
        make(peft_config=peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    base, tokenizer = load_model(MODEL)
    wrapped = peft.get_peft_model(base, lora())
    with pytest.raises(ConfigError, match="already a PeftModel"):
        make(model=wrapped, processing_class=tokenizer, peft_config=lora())
    with pytest.raises(ConfigError, match="LoRA variant .DoRA"):
        make(peft_config=lora(use_dora=True), args={"eval_mode": "materialised"}).train()
    with pytest.raises(ModelError, match="no trainable projection weights to evolve.*use algorithm = 'grpo'"):
        make(peft_config=peft.LoHaConfig(target_modules=["q_proj"])).train()  # LoHa has no nn.Linear
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    frozen_base, _ = load_model(MODEL)
    frozen = peft.get_peft_model(frozen_base, lora()).requires_grad_(False)
    with pytest.raises(ConfigError, match="adapter is frozen"):
        make(model=frozen, processing_class=tokenizer).train()
    # An adapter without a local base model: load_model says what to do.
    adapter_dir = tmp_path / "adapter"
    peft.get_peft_model(build_tiny_model("tiny", tokenizer), lora()).save_pretrained(adapter_dir)
    with pytest.raises(ModelError, match="base model None .* is not a local model directory"):
        load_model(adapter_dir)
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(MissingPackageError, match=r"pip install 'fastes\[peft\]'"):
        make(peft_config=lora())
    with pytest.raises(MissingPackageError, match="is a PEFT adapter directory"):
        load_model(adapter_dir)


def test_dora_is_evaluated_member_by_member_by_default(tmp_path):
    args = small(tmp_path, ESConfig, max_steps=1)
    trainer = ESTrainer(MODEL, digits, args=args, train_dataset=ROWS, peft_config=lora(use_dora=True))
    trainer.train()
    assert json.loads(Path(tmp_path / "run" / "config.json").read_text())["es"]["eval_mode"] == "member"
