"""fastes' decoding loop against transformers' greedy `generate`: the same tokens while every row decodes,
and, while finished rows leave the batch, the same tokens in float64, where another batch size cannot
round a logit across a greedy choice; members leaving population layers against each member alone."""

import pytest
import torch
import transformers
from conftest import fastes_greedy, transformers_greedy

import fastes
from fastes.es.population import population_batched
from fastes.models.decoding import _kept

VOCAB = 61
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)
KV = dict(num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1
    ),
    "llama": lambda: transformers.LlamaConfig(**SHAPE, **KV),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, **KV),
    "phi3": lambda: transformers.Phi3Config(**SHAPE, **KV, pad_token_id=0),
    "gemma": lambda: transformers.GemmaConfig(**SHAPE, **KV, head_dim=8),
}
# Hybrids whose cache holds a recurrent state (a short convolution, Mamba) beside the attention's keys
HYBRIDS = {
    "lfm2": lambda: transformers.Lfm2Config(**SHAPE, **KV, layer_types=["conv", "full_attention"]),
    "bamba": lambda: transformers.BambaConfig(
        **SHAPE, **KV, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8
    ),
}


def _model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = {**CONFIGS, **HYBRIDS}[name]()
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _prompts(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 2-9 tokens (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return ids * mask, mask


def _batch_sizes(model):
    """(the rows of every forward call of `model`, as a hook records them; the hook's handle)."""
    sizes = []

    def record(_module, _args, kwargs):
        sizes.append(kwargs["input_ids"].shape[0])

    return sizes, model.register_forward_pre_hook(record, with_kwargs=True)


def _an_eos_that_stops_rows_at_different_steps(tokens: torch.Tensor) -> int:
    """A token whose first appearance falls on different steps of different rows, and that some rows
    never produce: as EOS, rows finish one after another and some run to the end."""
    best, spread = None, -1
    for token in range(1, VOCAB):
        hits = tokens == token
        if not hits.any() or hits.any(dim=1).all():
            continue
        firsts = {int(row.nonzero()[0]) for row in hits if row.any()}
        if len(firsts) > spread:
            best, spread = token, len(firsts)
    assert best is not None and spread >= 2
    return best


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_decoding_gives_transformers_tokens_bit_for_bit(name):
    """No EOS: no row finishes, nothing leaves, and the tokens are transformers' exactly (float32)."""
    model = _model(name)
    ids, mask = _prompts(6, seed=1)
    ours = fastes_greedy(model, ids, mask, 10, eos=[])
    assert torch.equal(ours, transformers_greedy(model, ids, mask, 10, eos=[]))
    assert len(set(ours[:, -1].tolist())) > 1  # the rows differ: the comparison is not vacuous


@pytest.mark.parametrize("name,seed", [("llama", 0), ("gpt2", 2), ("qwen2", 1)])
def test_finished_rows_leave_the_batch_and_the_rest_decode_as_transformers(name, seed):
    model = _model(name, torch.float64, seed)
    ids, mask = _prompts(8, seed=seed)
    eos = _an_eos_that_stops_rows_at_different_steps(fastes_greedy(model, ids, mask, 12, eos=[]))
    sizes, handle = _batch_sizes(model)
    try:
        ours = fastes_greedy(model, ids, mask, 12, eos=[eos])
    finally:
        handle.remove()
    assert torch.equal(ours, transformers_greedy(model, ids, mask, 12, eos=[eos]))
    assert sizes[0] == 8 and min(sizes) < 8  # rows left the batch
    assert sizes == sorted(sizes, reverse=True)
    finished_at = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in ours]
    # after the last step at which any row finished, only rows without EOS are left
    assert sizes[-1] == sum(step is None for step in finished_at)


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_rows_stay_where_the_cache_cannot_drop_them(name):
    """A recurrent state that takes no row selection: every row decodes until the last stops, as in
    transformers' generate, whose tokens these are bit for bit (float32)."""
    model = _model(name)
    ids, mask = _prompts(8, seed=0)
    unstopped = fastes_greedy(model, ids, mask, 12, eos=[])
    eos = sorted(set(unstopped[:2, 2].tolist()))  # rows 0 and 1 end by step 2
    sizes, handle = _batch_sizes(model)
    try:
        ours = fastes_greedy(model, ids, mask, 12, eos=eos)
    finally:
        handle.remove()
    assert torch.equal(ours, transformers_greedy(model, ids, mask, 12, eos=eos))
    lengths = [_length(row, eos) for row in ours]
    assert min(lengths) <= 3 and max(lengths) > 6  # rows finished early, and others went on
    assert set(sizes) == {8} and len(sizes) == max(lengths)


@pytest.mark.parametrize(
    "noise_type,mode,backend",
    [
        ("lowrank", "lowrank", "auto"),
        ("lowrank", "lowrank", "torch"),
        ("full", "materialised", "torch"),
        ("full", "materialised", "auto"),
    ],
)
def test_members_whose_rows_all_finished_leave_the_population_layers(noise_type, mode, backend):
    """Under population_batched the batch shrinks to the live members' live columns, and the population
    layers go on with those members; with the compiled CPU products (backend "auto" on the CPU: the
    materialised layer's matmul, the low-rank layer's term), which take groups of any size, to the rows
    still going. Every member's tokens are its own generation's. (ES evolves float32 weights; at these
    sizes no logit lies within float32 rounding of a greedy choice.)"""
    model = _model("llama", torch.float32, seed=3)
    es = fastes.ES(
        fastes.linear_weights(model),
        sigma=0.3,
        lr=0.01,
        population=4,
        seed=5,
        noise_type=noise_type,
        rank=2,
        backend=backend,
    )
    ids, mask = _prompts(3, seed=4)
    alone = []
    for member in es.members():
        with member:
            alone.append(fastes_greedy(model, ids, mask, 12, eos=[]))
    # EOS: the tokens member 1 writes at step 2, so that its rows all finish by then (others go on)
    eos = sorted(set(alone[1][:, 2].tolist()))
    expected = []
    for member in es.members():
        with member:
            expected.append(fastes_greedy(model, ids, mask, 12, eos=eos))
    with population_batched(es, model, mode=mode) as members:
        unequal = {m.takes_unequal_groups for m in model.modules() if hasattr(m, "keep_members")}
        sizes, handle = _batch_sizes(model)
        try:
            together = fastes_greedy(
                model, ids.repeat(len(members), 1), mask.repeat(len(members), 1), 12, eos=eos
            )
        finally:
            handle.remove()
    assert torch.equal(together, torch.cat(expected))
    lengths = torch.tensor([[_length(row, eos) for row in member] for member in expected])
    assert lengths[1].max() <= 3 and lengths.max() == 12  # member 1 left, others ran to the end
    assert sizes[0] == 12
    assert unequal == {backend == "auto"}
    for step, size in enumerate(sizes[1:]):
        going = lengths > step + 1
        if unequal == {True}:  # the rows still going
            assert size == int(going.sum())
        else:  # the members with a row still going times the columns still going in one
            assert size == int(going.any(dim=1).sum()) * int(going.any(dim=0).sum())
    assert sizes[1:] != [12] * (len(sizes) - 1)  # rows left
    assert not torch.equal(expected[0], expected[1])  # the members differ


def _length(row: torch.Tensor, eos: list[int]) -> int:
    hits = torch.isin(row, torch.tensor(eos)).nonzero()
    return int(hits[0]) + 1 if len(hits) else row.shape[0]


def test_the_kept_rows_are_the_live_groups_live_columns():
    unfinished = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool).flatten()
    groups, rows = _kept(unfinished, 4)
    assert groups == [1, 2]
    assert rows.tolist() == [3, 4, 6, 7]  # groups 1 and 2, columns 0 and 1
    assert _kept(torch.zeros(6, dtype=torch.bool), 2) == ([], None)
    groups, rows = _kept(torch.tensor([True, False, False]), 1)  # one group: every finished row leaves
    assert groups == [0] and rows.tolist() == [0]


@torch.no_grad()
@pytest.mark.parametrize(
    "noise_type,mode,backend",
    [
        ("lowrank", "lowrank", "auto"),
        ("lowrank", "lowrank", "triton"),  # the fused GEMM, interpreted
        ("full", "materialised", "auto"),
        ("full", "virtual", "triton"),
    ],
)
def test_a_population_layer_goes_on_with_the_kept_members(noise_type, mode, backend):
    """After keep_members([1, 3]) the layers take two members' rows and give members 1 and 3's logits."""
    model = _model("llama")
    es = fastes.ES(
        fastes.linear_weights(model),
        sigma=0.1,
        lr=0.01,
        population=4,
        seed=2,
        noise_type=noise_type,
        backend=backend,
    )
    ids, _ = _prompts(2, seed=6)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(input_ids=ids).logits)
    with population_batched(es, model, mode=mode):
        layers = [m for m in model.modules() if hasattr(m, "keep_members")]
        for layer in layers:
            layer.keep_members([1, 3])
        assert {layer.population_members for layer in layers} == {2}
        if mode == "lowrank":  # the fused kernel where asked for, torch ops otherwise
            assert {layer.fused for layer in layers} == {backend == "triton"}
        logits = model(input_ids=ids.repeat(2, 1)).logits
    torch.testing.assert_close(logits, torch.cat([expected[1], expected[3]]), rtol=1e-4, atol=1e-5)
    assert (expected[1] - expected[3]).abs().max() > 1e-3
