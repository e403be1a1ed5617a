"""Prompting for instruct models: the chat template on, off or auto, the system prompt, and the settings
fastes chooses from the model (fastes.run.auto_settings)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastes.models.loading import (
    ModelError,
    build_tiny_model,
    build_tokenizer,
    format_prompt,
    is_character_tokenizer,
)
from fastes.run import auto_settings
from fastes.run.config import TrainConfig, load_config, validate

# A template like SmolLM2's: a default system turn when the messages bring none.
TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}[system]Be SmolLM.[/]{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
NO_SYSTEM_ROLE = (  # a template that refuses system turns, as some do
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}[assistant]"
)


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_no_system_prompt_replaces_the_templates_default(chat_tokenizer):
    assert format_prompt(chat_tokenizer, "2+2?") == "[system][/][user]2+2?[/][assistant]"


def test_system_prompt_text_and_the_templates_own(chat_tokenizer):
    text = format_prompt(chat_tokenizer, "2+2?", system_prompt="Answer briefly.")
    assert text == "[system]Answer briefly.[/][user]2+2?[/][assistant]"
    kept = format_prompt(chat_tokenizer, "2+2?", system_prompt="<default>")
    assert kept == "[system]Be SmolLM.[/][user]2+2?[/][assistant]"


def test_chat_messages_are_used_as_given(chat_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert format_prompt(chat_tokenizer, messages) == "[system]S[/][user]U[/][assistant]"


def test_template_off_on_and_auto(chat_tokenizer):
    assert format_prompt(chat_tokenizer, "2+2?", chat_template="off") == "2+2?"
    plain = build_tokenizer()
    assert format_prompt(plain, "2+2?") == "2+2?"  # auto without a template
    with pytest.raises(ModelError, match="has no chat template"):
        format_prompt(plain, "2+2?", chat_template="on")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    assert format_prompt(plain, messages) == "s\nx"  # no template: the contents, one per line


def test_a_template_without_system_role_gets_no_system_turn():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = NO_SYSTEM_ROLE
    assert format_prompt(tokenizer, "hi") == "[user]hi[/][assistant]"


def test_system_prompt_needs_the_template(tmp_path):
    with pytest.raises(Exception, match="system_prompt"):
        load_config(None, {"system_prompt": "x", "chat_template": "off", "out_dir": str(tmp_path)})
    with pytest.raises(Exception, match="instruction"):
        load_config(None, {"instruction": "x", "task": "jsonl:a.jsonl", "out_dir": str(tmp_path)})
    with pytest.raises(Exception, match="answer_prefix"):
        load_config(None, {"answer_prefix": "", "task": "countdown", "prompt_style": "plain"})


def test_character_tokenizer_is_recognised(chat_tokenizer):
    assert is_character_tokenizer(build_tokenizer())


def test_auto_settings_of_the_tiny_model_are_the_old_defaults():
    tokenizer = build_tokenizer()
    cfg = auto_settings.resolve(TrainConfig(), build_tiny_model("tiny", tokenizer), tokenizer)
    assert (cfg.prompt_style, cfg.max_new_tokens, cfg.es.eval_mode, cfg.es.noise_type) == (
        "plain",
        12,
        "materialised",
        "full",
    )
    assert cfg.grpo.lr == 3e-4 and cfg.eval_batch_size == 256 and cfg.es.materialise_mb > 0
    validate(cfg)  # what a run chooses passes the config's own checks


def test_auto_settings_of_a_real_sized_instruct_model():
    """SmolLM2-135M's shape (on the meta device: no memory, no weights)."""
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    cfg = auto_settings.resolve(TrainConfig(), model, tokenizer)
    assert (cfg.prompt_style, cfg.max_new_tokens, cfg.es.eval_mode, cfg.es.noise_type) == (
        "instruct",
        auto_settings.INSTRUCT_NEW_TOKENS,
        "lowrank",
        "lowrank",
    )
    assert cfg.grpo.lr == 1e-6
    validate(cfg)
    chosen = TrainConfig(max_new_tokens=7, prompt_style="plain")
    chosen.es.eval_mode = "member"
    kept = auto_settings.resolve(chosen, model, tokenizer)  # what the user set is never changed
    assert (kept.max_new_tokens, kept.prompt_style, kept.es.eval_mode, kept.es.noise_type) == (
        7,
        "plain",
        "member",
        "full",
    )
    validate(kept)
    extra = TrainConfig()
    extra.es.include_norms = True  # auto then means member mode, the only one that evolves norms
    validate(auto_settings.resolve(extra, model, tokenizer))


def test_a_resume_takes_the_first_starts_choices():
    tokenizer = build_tokenizer()
    model = build_tiny_model("tiny", tokenizer)
    saved = auto_settings.resolve(TrainConfig(), model, tokenizer)
    saved.es.materialise_mb = 12345.0  # chosen on a machine with other free memory
    from fastes.run.config import config_dict

    again = auto_settings.resolve(TrainConfig(), model, tokenizer, saved=config_dict(saved))
    assert again.es.materialise_mb == 12345.0
