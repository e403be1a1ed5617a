"""The linear layers of a decoding step (fastes.models.decoding_linears): `DecodingLinear` against the
nn.Linear it stands for at every row count and both of its own paths; which layers `decoding_linears`
swaps, and that it puts them back; and decoding through it gives transformers' greedy tokens."""

import pytest
import torch
import transformers
from conftest import fastes_greedy, transformers_greedy

from fastes.engine import cpu_library, cpu_linear
from fastes.engine.cpu_linear import MIN_WEIGHT_BYTES, VOCABULARY_ROWS
from fastes.engine.cpu_linear import linear_applies as applies
from fastes.models.decoding_linears import DecodingLinear, decoding_linears


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [300, VOCABULARY_ROWS + 1])  # a projection, a vocabulary
def test_decoding_linear_gives_the_linear_layers_result_at_every_row_count(seed, bias, out_features):
    base = _linear(out_features, 257, bias, seed)
    layer = DecodingLinear(base)
    with torch.inference_mode():
        for rows in (1, 2, cpu_library.FEW_ROWS, cpu_library.FEW_ROWS + 1, 23, cpu_linear.PACKED_MIN_ROWS):
            x = torch.randn(rows, 3, 257)[:, -1:]  # the last position of each row, as a model slices it
            got, expected = layer(x), base(x)
            assert got.shape == expected.shape == (rows, 1, out_features)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            # from the packed linear's rows, 300 outputs (not whole panels) take torch's own linear
            if rows >= cpu_linear.PACKED_MIN_ROWS and out_features < VOCABULARY_ROWS:
                flat = torch.nn.functional.linear(x.reshape(rows, 257), base.weight, base.bias)
                assert torch.equal(got, flat.view(rows, 1, out_features))
    assert layer.weight is base.weight and layer.bias is base.bias


@pytest.mark.parametrize("small_packed", [False, True])
def test_only_fp32_cpu_linear_layers_without_hooks_apply_and_small_ones_where_chosen(
    monkeypatch, small_packed
):
    use = cpu_linear.Products(*[True] * 5, small_packed=small_packed, vocabulary=True)
    monkeypatch.setattr(cpu_linear, "products", lambda threads: use)
    side = int((MIN_WEIGHT_BYTES / 4) ** 0.5)
    assert applies(torch.nn.Linear(side, side))
    # below the threshold the weight stays in the caches: the packed linear's, where measured faster
    assert applies(torch.nn.Linear(side, side - 1)) == small_packed
    assert not applies(torch.nn.Linear(side, side).double())
    assert not applies(torch.nn.Conv1d(side, side, 1))
    hooked = torch.nn.Linear(side, side)
    hooked.register_forward_hook(lambda *args: None)
    assert not applies(hooked)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.large = torch.nn.Linear(256, 256)
        self.small = torch.nn.Linear(16, 16)
        self.inner = torch.nn.Sequential(torch.nn.Linear(256, 512))


def test_decoding_linears_swaps_the_layers_that_apply_and_puts_them_back(monkeypatch):
    use = cpu_linear.Products(*[True] * 5, small_packed=False, vocabulary=True)
    monkeypatch.setattr(cpu_linear, "products", lambda threads: use)
    block = _Block()
    originals = dict(block.named_modules())
    with decoding_linears(block):
        assert isinstance(block.large, DecodingLinear) and block.large.base is originals["large"]
        assert isinstance(block.inner[0], DecodingLinear)
        assert block.small is originals["small"]
    assert dict(block.named_modules()) == originals
    with pytest.raises(RuntimeError, match="inside"), decoding_linears(block):
        raise RuntimeError("inside")
    assert dict(block.named_modules()) == originals  # put back after an error too


def _model(seed: int) -> transformers.PreTrainedModel:
    """A Llama whose projections (256 x 256 and up) and vocabulary (8192) take both paths."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCABULARY_ROWS,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _greedy_both_ways(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fastes' greedy tokens, transformers' greedy `generate` tokens) for unpadded prompts `ids`."""
    mask = torch.ones_like(ids)
    return fastes_greedy(model, ids, mask, new_tokens, []), transformers_greedy(
        model, ids, mask, new_tokens, []
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_decoding_through_them_gives_transformers_greedy_tokens(seed, monkeypatch):
    model = _model(seed)
    calls = []
    few_rows_linear = cpu_library.few_rows_linear
    monkeypatch.setattr(cpu_library, "few_rows_linear", lambda *a: calls.append(1) or few_rows_linear(*a))
    assert sum(applies(m) for m in model.modules()) == 2 * 7 + 1  # every projection and the vocabulary
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCABULARY_ROWS, (cpu_library.FEW_ROWS + 4, 6), generator=g)
    for rows in (1, 3, ids.shape[0]):  # few rows, and more than the few-rows pass takes
        ours, theirs = _greedy_both_ways(model, ids[:rows], new_tokens=8)
        assert torch.equal(ours, theirs)
    assert calls  # the few-rows pass ran
    assert not any(isinstance(m, DecodingLinear) for m in model.modules())


def test_a_prefill_of_many_rows_takes_the_packed_linear_and_gives_transformers_greedy_tokens(monkeypatch):
    model = _model(2)
    calls = []
    packed_linear = cpu_library.packed_linear
    monkeypatch.setattr(cpu_library, "packed_linear", lambda *a: calls.append(1) or packed_linear(*a))
    ids = torch.randint(1, VOCABULARY_ROWS, (8, 40), generator=torch.Generator().manual_seed(2))
    assert ids.numel() >= cpu_linear.PACKED_MIN_ROWS
    ours, theirs = _greedy_both_ways(model, ids, new_tokens=4)
    assert torch.equal(ours, theirs)
    assert len(calls) == 2 * 7  # every projection of the prefill; the vocabulary sees the last positions


def test_with_torchs_products_decoding_gives_transformers_greedy_tokens(monkeypatch, fresh_answer):
    """Where torch's products are the faster ones (cpu_linear.products), no library product runs."""
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "torch")
    for name in ("few_rows_linear", "packed_linear"):
        monkeypatch.setattr(cpu_library, name, lambda *a, _name=name: pytest.fail(f"{_name} ran"))
    model = _model(4)
    ids = torch.randint(1, VOCABULARY_ROWS, (8, 40), generator=torch.Generator().manual_seed(4))
    for rows in (1, 3, ids.shape[0]):  # few rows, and a prefill of many
        ours, theirs = _greedy_both_ways(model, ids[:rows], new_tokens=6)
        assert torch.equal(ours, theirs)


def test_a_lora_wrapped_model_decodes_through_them_as_transformers_does():
    """peft's LoRA layer calls its base layer, which is swapped like any other projection."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(3), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    for name, parameter in model.named_parameters():  # lora_B starts at zero: give the adapter an effect
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)
    model.eval()
    ids = torch.randint(1, VOCABULARY_ROWS, (3, 5), generator=torch.Generator().manual_seed(3))
    ours, theirs = _greedy_both_ways(model, ids, new_tokens=6)
    assert torch.equal(ours, theirs)
    assert not any(isinstance(m, DecodingLinear) for m in model.modules())
