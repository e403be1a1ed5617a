"""The packed linear of a prefill's many rows and its low-rank term (cpu_library.packed_linear,
csrc/packed_linear_cpu.c) against the plain-torch reference in float64: x W^T (+ bias), plus each row's
member's sum_j (x . inputs[m, j]) outputs[m, j].

Row counts around the register block (ROW_BLOCK: 12 with AVX-512, 6 without), widths around the 16-float
vectors, outputs in whole panels and with the last columns one by one, members with unequal and empty row
groups, ranks 1 to 3, with and without a bias, several seeds; a row's bits depend neither on the threads
nor on the rows beside it; the layers that use it (DecodingLinear, LowRankLinear) give their torch
results; it refuses what it cannot take.
"""

import pytest
import torch
from conftest import kernel_llama, linear_problem, linear_reference, linear_tolerance

import fastes
from fastes.engine import cpu_library, cpu_linear
from fastes.engine.cpu_library import LowRankTerm
from fastes.es.population import LowRankLinear, population_batched
from fastes.models.decoding_linears import DecodingLinear

SEEDS = [0, 1, 31337]
ROWS = [1, 5, 6, 7, 12, 13, 25]  # one, around AVX2's block of 6 and AVX-512's of 12, and several blocks
WIDTHS = [1, 17, 64, 65, 130]  # k: below, around and at the four 16-float sums of the products' dot
OUTPUTS = [32, 64, 50, 96 + 7]  # n: whole 32-column panels, and panels with the last columns one by one


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_the_reference(seed, rows, with_bias):
    for k in WIDTHS:
        for n in OUTPUTS:
            x, w, bias, _ = linear_problem(rows, k, n, seed, with_bias)
            got = cpu_library.packed_linear(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), linear_reference(x, w, bias), **linear_tolerance(k))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("members,rank", [(1, 1), (3, 1), (4, 2), (5, 3)])
def test_the_low_rank_term_is_added_to_each_members_rows(seed, rows, members, rank):
    for k in (17, 65):
        for n in (32, 50):
            x, w, bias, term = linear_problem(rows, k, n, seed, True, members, rank)
            got = cpu_library.packed_linear(x, w, bias, term)
            torch.testing.assert_close(
                got.double(), linear_reference(x, w, bias, term), **linear_tolerance(k, rank)
            )


@pytest.mark.parametrize("threads", [1, 2])
def test_a_smollm2_sized_layer_over_the_threads_matches_the_reference(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, bias, term = linear_problem(300, 576, 192, seed=threads, with_bias=True, members=8)
        got = cpu_library.packed_linear(x, w, bias, term)
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, term), **linear_tolerance(576, 1)
        )
    finally:
        torch.set_num_threads(previous)


def test_a_rows_result_depends_on_neither_the_threads_nor_the_rows_beside_it():
    x, w, bias, term = linear_problem(300, 200, 96 + 7, seed=5, with_bias=True, members=3, rank=2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = cpu_library.packed_linear(x, w, bias, term)
        torch.set_num_threads(1)
        assert torch.equal(cpu_library.packed_linear(x, w, bias, term), together)
        for row in (0, 13, 299):  # alone: a one-row group of its own member
            member = int(torch.searchsorted(term.offsets, row, right=True)) - 1
            alone_term = LowRankTerm(
                term.inputs[member : member + 1], term.outputs[member : member + 1], torch.tensor([0, 1])
            )
            alone = cpu_library.packed_linear(x[row : row + 1], w, bias, alone_term)
            assert torch.equal(alone[0], together[row])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_row_blocks_across_members_give_each_member_its_own_bits(threads):
    """The register blocks run over all rows, across the members' boundaries (16 members of 7 rows: every
    block holds several members' rows, each adding its own member's term); each member's rows are the
    bits of the same rows computed as the only member, and the float64 reference's to tolerance."""
    x, w, bias, _ = linear_problem(16 * 7, 200, 96 + 7, seed=threads, with_bias=True)
    generator = torch.Generator().manual_seed(7)
    inputs, outputs = (
        torch.randn(16, 2, 200, generator=generator),
        torch.randn(16, 2, 96 + 7, generator=generator),
    )
    term = LowRankTerm(inputs, outputs, torch.arange(0, 16 * 7 + 1, 7))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu_library.packed_linear(x, w, bias, term)
        for member in range(16):
            rows = slice(7 * member, 7 * (member + 1))
            alone_term = LowRankTerm(
                inputs[member : member + 1], outputs[member : member + 1], torch.tensor([0, 7])
            )
            assert torch.equal(cpu_library.packed_linear(x[rows], w, bias, alone_term), together[rows])
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(
        together.double(), linear_reference(x, w, bias, term), **linear_tolerance(200, 2)
    )


def test_decoding_linear_takes_it_at_a_prefills_rows():
    base = torch.nn.Linear(576, 192)  # SmolLM2's k projection: a weight of 432 KiB
    layer = DecodingLinear(base)
    for rows in (cpu_linear.PACKED_MIN_ROWS - 1, cpu_linear.PACKED_MIN_ROWS):
        x = torch.randn(rows, 576)
        got, expected = layer(x), base(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        # below the rows, the few-rows linear; from them, the packed linear (each its own bits)
        product = (
            cpu_library.packed_linear if rows >= cpu_linear.PACKED_MIN_ROWS else cpu_library.few_rows_linear
        )
        assert torch.equal(got, product(x, base.weight, base.bias))
        assert cpu_linear.packs(rows, base.weight) == (rows >= cpu_linear.PACKED_MIN_ROWS)
    assert not cpu_linear.packs(1000, torch.nn.Linear(576, 200).weight)  # the last columns one by one
    assert cpu_linear.packs(1000, torch.nn.Linear(64, 256).weight)  # the tiny model's, where small_packed


def _low_rank_layers(bias: bool, members: int = 8):
    """A SmolLM2-sized low-rank layer on the compiled CPU backend, and the same on torch's ops."""
    torch.manual_seed(0)
    base = torch.nn.Linear(576, 192, bias=bias)
    factors = [(torch.randn(192, 2), torch.randn(576, 2)) for _ in range(members)]
    scales = [0.1 * (m + 1) for m in range(members)]
    return LowRankLinear.from_factors(base, factors, scales), LowRankLinear.from_factors(
        base, factors, scales, backend="torch"
    )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_member", [1, 2, 40])  # few rows, torch's linear, the packed linear
def test_the_low_rank_layer_gives_its_torch_result(bias, rows_per_member):
    compiled, reference_layer = _low_rank_layers(bias)
    assert compiled.library_base and not reference_layer.library_base
    x = torch.randn(8 * rows_per_member, 1, 576)
    torch.testing.assert_close(compiled(x), reference_layer(x), rtol=1e-5, atol=1e-4)
    compiled.keep_members([1, 4, 6])
    reference_layer.keep_members([1, 4, 6])
    x = torch.randn(3 * 100, 576)  # three members' 100 rows each: the packed path, new row groups
    torch.testing.assert_close(compiled(x), reference_layer(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "counts", [[0, 1, 0, 0, 0, 0, 0, 0], [2, 0, 1, 3, 0, 1, 0, 1], [40, 0, 50, 60, 2, 80, 0, 30]]
)
def test_the_low_rank_layer_takes_unequal_row_groups(counts):
    """After set_member_rows, each member's rows (none for some) get that member's term, at few rows,
    torch's linear's and the packed linear's row counts: what each member's rows give alone."""
    compiled, reference_layer = _low_rank_layers(bias=True)
    assert compiled.takes_unequal_groups and not reference_layer.takes_unequal_groups
    compiled.set_member_rows(counts)
    x = torch.randn(sum(counts), 576)
    got = compiled(x)
    start = 0
    for member, count in enumerate(counts):
        alone, _ = _low_rank_layers(bias=True)
        alone.keep_members([member])
        torch.testing.assert_close(
            got[start : start + count], alone(x[start : start + count]), rtol=1e-5, atol=1e-4
        )
        start += count
    with pytest.raises(ValueError, match="set_member_rows gave"):
        compiled(torch.randn(sum(counts) + 1, 576))
    compiled.set_member_rows(None)  # equal groups again
    x = torch.randn(16, 576)
    torch.testing.assert_close(compiled(x), reference_layer(x), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="one count per member"):
        compiled.set_member_rows([1, 2])
    with pytest.raises(ValueError, match="compiled CPU products"):
        reference_layer.set_member_rows(counts)


def test_the_layers_share_one_offsets_tensor_per_grouping():
    """Every layer asks for the members' row offsets whenever rows leave the batch: one tensor serves all
    the layers with the same groups, and each row count (a row's positions at a prefill) gets its own."""
    first, _ = _low_rank_layers(bias=False)
    second, _ = _low_rank_layers(bias=False)
    counts = [2, 0, 1, 3, 0, 1, 0, 1]
    for layer in (first, second):
        layer.set_member_rows(counts)
    assert first._row_offsets(8) is second._row_offsets(8)
    assert first._row_offsets(8).tolist() == [0, 2, 2, 3, 6, 6, 7, 7, 8]
    assert second._row_offsets(16).tolist() == [0, 4, 4, 6, 12, 12, 14, 14, 16]  # two positions a row
    first.set_member_rows(None)
    assert first._row_offsets(16).tolist() == list(range(0, 17, 2))


def test_the_low_rank_layer_keeps_its_base_when_it_is_more_than_a_linear():
    base = torch.nn.Linear(576, 192)
    base.register_forward_hook(lambda module, args, out: out * 2)
    layer = LowRankLinear.from_factors(base, [(torch.randn(192, 1), torch.randn(576, 1))], [0.0])
    assert not layer.library_base and layer.compiled
    for rows in (3, 300):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(layer(x), base(x))  # the hook ran: the term is zero


@pytest.mark.parametrize(
    "x, w, term, message",
    [
        (torch.zeros(0, 4), torch.zeros(3, 4), None, "rows of the weight's width"),
        (torch.zeros(2, 4), torch.zeros(3, 5), None, "rows of the weight's width"),
        (torch.zeros(1, 2, 4), torch.zeros(3, 4), None, "rows of the weight's width"),
        (torch.zeros(2, 0), torch.zeros(3, 0), None, "rows of the weight's width"),
        (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), None, "fp32"),
        (torch.zeros(2, 4), torch.zeros(4, 3).T, None, "contiguous weight"),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(1, 1, 5), torch.zeros(1, 1, 3), torch.tensor([0, 2])),
            "do not match",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(1, 1, 4), torch.zeros(1, 1, 3), torch.tensor([0, 1, 2])),
            "do not match",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(1, 1, 4).double(), torch.zeros(1, 1, 3), torch.tensor([0, 2])),
            "fp32",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(1, 1, 4), torch.zeros(1, 1, 3), torch.tensor([0.0, 2.0])),
            "int64",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(2, 1, 4), torch.zeros(2, 1, 3), torch.tensor([0, 3, 2])),
            "do not split 2 rows",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            LowRankTerm(torch.zeros(2, 1, 4), torch.zeros(2, 1, 3), torch.tensor([0, 2, 1])),
            "do not split 2 rows",
        ),
    ],
)
def test_packed_linear_refuses_what_it_cannot_take(x, w, term, message):
    with pytest.raises(ValueError, match=message):
        cpu_library.packed_linear(x, w, None, term)


def test_a_low_rank_population_through_it_gives_each_members_own_logits(monkeypatch):
    """A prefill of 4 members x 8 prompts x 40 positions: every low-rank layer takes the packed linear
    with its term, and each member's logits equal those of its own perturbed weights."""
    # projections of 256 x 256 and up: 256 KiB or more, in whole panels
    model, tokenizer = kernel_llama(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, noise_type="lowrank", rank=2, seed=3
    )
    ids = torch.randint(1, len(tokenizer), (8, 40), generator=torch.Generator().manual_seed(1))
    calls = []
    packed_linear = cpu_library.packed_linear
    monkeypatch.setattr(cpu_library, "packed_linear", lambda *a: calls.append(a[3]) or packed_linear(*a))
    with torch.inference_mode():
        with population_batched(es, model, mode="lowrank") as members:
            together = model(input_ids=ids.repeat(len(members), 1)).logits
        assert calls and all(term is not None for term in calls)  # each layer with its members' term
        for index, member in enumerate(es.members()):
            with member:
                alone = model(input_ids=ids).logits
            torch.testing.assert_close(together[index * 8 : (index + 1) * 8], alone, rtol=1e-4, atol=1e-4)
