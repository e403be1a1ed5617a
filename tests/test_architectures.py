"""Common Hugging Face architectures (small random models from configs, no downloads): ES selects every
projection matrix, and population-batched evaluation equals member-by-member evaluation on each."""

import warnings

import pytest
import torch
import transformers

import fastes
from fastes.es.params import projections
from fastes.es.population import population_batched

SHAPE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def _config(name: str):
    if name == "gpt2":  # Conv1D projections with [in, out] weights, tied lm_head
        return transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    if name == "gpt2-untied":
        return transformers.GPT2Config(
            vocab_size=61, n_embd=32, n_layer=1, n_head=4, n_positions=32, tie_word_embeddings=False
        )
    kv = dict(num_key_value_heads=2, max_position_embeddings=32)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**SHAPE, **kv, tie_word_embeddings=False),
        "qwen2": lambda: transformers.Qwen2Config(**SHAPE, **kv),  # q/k/v biases
        "qwen3": lambda: transformers.Qwen3Config(**SHAPE, **kv, head_dim=8),  # q_norm / k_norm
        "mistral": lambda: transformers.MistralConfig(**SHAPE, **kv),
        "phi3": lambda: transformers.Phi3Config(**SHAPE, **kv, pad_token_id=0),  # fused qkv and gate_up
        "gemma": lambda: transformers.GemmaConfig(**SHAPE, **kv, head_dim=8),
    }
    return configs[name]()


ARCHITECTURES = ["gpt2", "gpt2-untied", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma"]
# Projection matrices per layer: GPT-2 c_attn, c_proj, c_fc, mlp.c_proj; Phi-3 qkv, o, gate_up, down.
PER_LAYER = {"gpt2": 4, "gpt2-untied": 4, "phi3": 4}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    torch.manual_seed(0)
    config = _config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return request.param, model


def test_every_projection_matrix_is_selected_without_warnings(arch):
    name, model = arch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out, so no "not evolved" warning
        chosen = dict(fastes.linear_weights(model))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2 and id(p) not in embeddings}
    assert set(chosen) == matrices  # every matrix that is not an embedding (or tied to one)
    layers = model.config.num_hidden_layers
    untied_head = 0 if model.config.tie_word_embeddings else 1
    assert len(chosen) == PER_LAYER.get(name, 7) * layers + untied_head
    assert ("lm_head.weight" in chosen) == bool(untied_head)
    assert all(id(p) in projections(model) for p in chosen.values())


def test_the_cli_choices_add_and_filter(arch):
    name, model = arch
    options = dict(include_embeddings=True, include_norms=True, include_biases=True)
    every = dict(fastes.linear_weights(model, **options))
    plain = dict(fastes.linear_weights(model))
    extra = set(every) - set(plain)
    assert any("emb" in n or "wte" in n for n in extra)
    assert any("norm" in n or "ln_" in n for n in extra)
    assert any(n.endswith(".bias") for n in extra) == (name in ("gpt2", "gpt2-untied", "qwen2"))
    with pytest.warns(UserWarning, match="do not match names"):
        layer0 = dict(fastes.linear_weights(model, names=r"\.0\."))
    assert layer0 and all(".0." in n for n in layer0)
    assert len(layer0) == PER_LAYER.get(name, 7)
    with pytest.raises(ValueError, match="no parameter name matches names='no-such-layer'"):
        fastes.linear_weights(model, names="no-such-layer")


@torch.no_grad()
@pytest.mark.parametrize("noise_type,mode", [("full", "materialised"), ("lowrank", "lowrank")])
def test_batched_logits_equal_member_by_member(arch, noise_type, mode):
    _, model = arch
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=1, noise_type=noise_type, rank=2
    )
    ids = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(0))
    expected = []
    for member in es.members():
        with member:
            expected.append(model(input_ids=ids).logits)
    with population_batched(es, model, mode=mode) as members:
        logits = model(input_ids=ids.repeat(len(members), 1)).logits
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert (expected[0] - expected[1]).abs().max() > 1e-3  # the members differ: not a vacuous comparison


@torch.no_grad()
def test_virtual_evaluation_of_gpt2_conv1d():
    """The interpreted virtual kernel on GPT-2's transposed Conv1D weights equals member by member."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    es = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2, seed=3, backend="triton")
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = []
    for member in es.members():
        with member:
            expected.append(model(input_ids=ids).logits)
    with population_batched(es, model, mode="virtual") as members:
        logits = model(input_ids=ids.repeat(len(members), 1)).logits
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert (expected[0] - expected[1]).abs().max() > 1e-3


def test_a_matrix_in_an_unknown_layer_type_is_reported():
    class Fused(torch.nn.Module):  # e.g. a custom or quantised projection that is not an nn.Linear
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 4))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Fused())
    with pytest.warns(UserWarning, match="neither nn.Linear nor Conv1D.*1.weight"):
        chosen = fastes.linear_weights(model)
    assert [n for n, _ in chosen] == ["0.weight"]


@pytest.mark.parametrize("mode", ["materialised", "member"])
def test_fastes_train_runs_es_on_a_gpt2_directory(tmp_path, mode):
    """The command line path end to end on a GPT-2 checkpoint: Conv1D layers generate with the KV cache."""
    from fastes.models.loading import build_tokenizer, save_model
    from fastes.run.config import load_config
    from fastes.run.train import train

    tokenizer = build_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    save_model(transformers.GPT2LMHeadModel(config), tokenizer, tmp_path / "gpt2")
    # A random model never answers correctly: reward the variety of its characters, so members differ.
    (tmp_path / "rewards.py").write_text(
        "def variety(completions, **_):\n    return [len(set(c)) for c in completions]\n"
    )
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "cmp {i} 5:"}}\n' for i in range(8)))
    options = {"es.iterations": 2, "es.population": 4, "es.sigma": 0.05, "es.lr": 0.01, "es.eval_mode": mode}
    cfg = load_config(
        None,
        {
            "model": str(tmp_path / "gpt2"),
            "task": f"jsonl:{tmp_path / 'prompts.jsonl'}",
            "reward": f"{tmp_path / 'rewards.py'}:variety",
            "out_dir": str(tmp_path / "run"),
            "batch_size": 4,
            "max_new_tokens": 4,
            "eval_size": 4,
            "progress": False,
            **options,
        },
    )
    train(cfg)
    before = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").state_dict()
    after = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "final").state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {k for k in before if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))}


def test_a_name_filter_that_matches_nothing_is_a_configuration_error(tmp_path, capsys):
    from fastes import cli

    code = cli.main(["train", "--es.evolve", "no_such_layer", "--out_dir", str(tmp_path / "run")])
    assert code == 2
    error = capsys.readouterr().err
    assert "configuration error: es.evolve: LlamaForCausalLM: no parameter name matches" in error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any work
