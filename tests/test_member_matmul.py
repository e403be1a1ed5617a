"""The materialised population's compiled matmul (cpu_library.member_matmul, csrc/member_matmul_cpu.c)
against the plain-torch reference: each member's rows times its own weights, in float64.

Odd sizes on every axis (rows around the row blocks of 6 and 12, columns around the 16- and 32-wide
panels, a member with no rows), with and without a bias, several seeds; the thread count and the rows
beside a row never change its bits (also where neighbouring members' rows share row blocks); and the
population layer reads unequal row groups with it. With the
low-rank population's factors (`MemberMatmul(w, bias, (inputs, outputs))`), each member's weight is
w + sum_j inputs[m, j]^T outputs[m, j], against the same reference on those weights.
"""

import pytest
import torch

from fastes.engine import cpu_library
from fastes.es.population import PopulationLinear

SEEDS = [0, 1, 31337]
COLUMNS = [1, 15, 16, 17, 31, 32, 33, 47, 64, 100]
ROW_GROUPS = [[1], [5, 0, 7], [6, 12, 13], [25, 32, 11, 1]]


def reference(x: torch.Tensor, w: torch.Tensor, counts: list[int], bias: torch.Tensor | None) -> torch.Tensor:
    """Member m's rows (the m-th of the consecutive groups of counts[m] rows) times w[m], in float64."""
    parts = [rows.double() @ w_m.double() for rows, w_m in zip(x.split(counts), w)]
    y = torch.cat(parts)
    return y if bias is None else y + bias.double()


def offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)


def problem(counts: list[int], k: int, n: int, seed: int, with_bias: bool):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=generator)
    w = torch.randn(len(counts), k, n, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    return x, w, bias


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("counts", ROW_GROUPS, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])  # the larger problems are shared by torch's threads
def test_member_matmul_matches_the_reference(seed, counts, with_bias, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (1, 17, 64):
            for n in COLUMNS:
                x, w, bias = problem(counts, k, n, seed, with_bias)
                got = cpu_library.member_matmul(x, w, offsets_of(counts), bias)
                assert got.dtype == torch.float32 and got.shape == (sum(counts), n)
                # fp32 products summed over k: the error grows with sqrt(k) times the terms' size
                expected = reference(x, w, counts, bias)
                torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6 * k)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("counts", ROW_GROUPS, ids=str)
@pytest.mark.parametrize("rank", [1, 2, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_member_matmul_forms_each_members_weight_from_its_factors(seed, counts, rank, threads):
    """One shared weight [k, n] and the members' factors: the reference on the members' weights formed in
    float64, w + inputs[m]^T outputs[m], over odd sizes, ranks, row groups and seeds."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (1, 17, 64):
            for n in COLUMNS:
                x, w, bias = problem(counts, k, n, seed, with_bias=seed != 1)
                generator = torch.Generator().manual_seed(seed + 7)
                inputs = torch.randn(len(counts), rank, k, generator=generator)
                outputs = torch.randn(len(counts), rank, n, generator=generator) * 0.1
                product = cpu_library.MemberMatmul(w[0].contiguous(), bias, (inputs, outputs))
                got = product(x, offsets_of(counts))
                members_weights = w[0].double() + inputs.double().transpose(1, 2) @ outputs.double()
                expected = reference(x, members_weights, counts, bias)
                torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=4e-6 * k)
    finally:
        torch.set_num_threads(previous)


def test_member_matmul_refuses_factors_that_do_not_match():
    x, w, _ = problem([3, 4], 8, 16, seed=0, with_bias=False)
    inputs, outputs = torch.randn(2, 1, 8), torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="are not"):  # factors need one shared weight [k, n]
        cpu_library.MemberMatmul(w, None, (inputs, outputs))
    with pytest.raises(ValueError, match="are not"):
        cpu_library.MemberMatmul(w[0], None, (inputs[:, :, :5].contiguous(), outputs))
    with pytest.raises(ValueError, match="are not"):
        cpu_library.MemberMatmul(w[0], None, (inputs, torch.randn(2, 2, 16)))
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_library.MemberMatmul(w[0], None, (inputs.double(), outputs))
    with pytest.raises(ValueError, match="do not match"):  # 3 members' offsets for 2 members' factors
        cpu_library.MemberMatmul(w[0].contiguous(), None, (inputs, outputs))(x, offsets_of([3, 2, 2]))


def test_a_rows_result_depends_on_neither_the_threads_nor_the_rows_beside_it():
    counts = [13, 7, 30, 2]  # enough work for torch's threads to share it
    x, w, bias = problem(counts, 96, 80, seed=5, with_bias=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_library.member_matmul(x, w, offsets_of(counts), bias)
        torch.set_num_threads(2)
        split = cpu_library.member_matmul(x, w, offsets_of(counts), bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)
    # member 2's row 20 by itself, as the only row of the only member
    row = sum(counts[:2]) + 20
    single = cpu_library.member_matmul(x[row : row + 1], w[2:3].contiguous(), offsets_of([1]), bias)
    assert torch.equal(single[0], alone[row])


def test_with_factors_a_rows_result_depends_on_its_members_row_count_only():
    """With the members' factors, a member's rows get the term added to their sums (few rows) or the
    member's weights formed once (many rows: k = 8, n = 16 forms from 17 rows on). Either way each equals
    the reference, and a row's bits depend on neither the threads nor the other members' rows."""
    counts = [16, 17, 40, 3]  # the term, formed weights, formed weights, the term
    x, w, bias = problem(counts, 8, 16, seed=4, with_bias=True)
    inputs, outputs = torch.randn(4, 2, 8), torch.randn(4, 2, 16) * 0.1
    product = cpu_library.MemberMatmul(w[0].contiguous(), bias, (inputs, outputs))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(x, offsets_of(counts))
        torch.set_num_threads(2)
        split = product(x, offsets_of(counts))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)
    members_weights = w[0].double() + inputs.double().transpose(1, 2) @ outputs.double()
    torch.testing.assert_close(
        alone.double(), reference(x, members_weights, counts, bias), rtol=1e-5, atol=2e-5
    )
    for m in (0, 1):  # member m's rows among other members' rows, or with none beside them
        start, end = sum(counts[:m]), sum(counts[: m + 1])
        by_itself = [0, 0, 0, 0]
        by_itself[m] = counts[m]
        own = product(x[start:end].contiguous(), offsets_of(by_itself))
        assert torch.equal(own, alone[start:end])


@pytest.mark.parametrize("threads", [1, 2])
def test_members_taking_the_term_share_row_blocks_and_keep_their_own_bits(threads):
    """Neighbouring members that take the term run in shared row blocks (segments of up to 8 blocks of
    rows, here several: 7 members of 16 rows), a member whose weights are formed (40 rows: k = 8,
    n = 23 forms from 18 rows on) by itself; 23 columns include the last ones summed one by one. Each
    member's rows are the bits of the same rows computed with no other member's rows, and the reference's
    to tolerance."""
    counts = [5, 7, 0, 3, 40, 16, 16, 16, 16, 16, 16, 16, 1]
    x, w, bias = problem(counts, 8, 23, seed=threads, with_bias=True)
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(len(counts), 2, 8, generator=generator)
    outputs = torch.randn(len(counts), 2, 23, generator=generator) * 0.1
    product = cpu_library.MemberMatmul(w[0].contiguous(), bias, (inputs, outputs))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = product(x, offsets_of(counts))
        for m, count in enumerate(counts):
            start = sum(counts[:m])
            by_itself = [0] * len(counts)
            by_itself[m] = count
            own = product(x[start : start + count].contiguous(), offsets_of(by_itself))
            assert torch.equal(own, together[start : start + count])
    finally:
        torch.set_num_threads(previous)
    members_weights = w[0].double() + inputs.double().transpose(1, 2) @ outputs.double()
    torch.testing.assert_close(
        together.double(), reference(x, members_weights, counts, bias), rtol=1e-5, atol=2e-5
    )


def test_member_matmul_refuses_what_it_cannot_compute():
    x, w, _ = problem([3, 4], 8, 16, seed=0, with_bias=False)
    with pytest.raises(ValueError, match="fp32"):
        cpu_library.member_matmul(x.double(), w.double(), offsets_of([3, 4]))
    with pytest.raises(ValueError, match="do not match"):
        cpu_library.member_matmul(x, w, offsets_of([7]))
    with pytest.raises(ValueError, match="do not match"):
        cpu_library.member_matmul(x[:, :5], w, offsets_of([3, 4]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_library.member_matmul(x, w.transpose(1, 2).contiguous().transpose(1, 2), offsets_of([3, 4]))
    with pytest.raises(ValueError, match="int64"):
        cpu_library.member_matmul(x, w, offsets_of([3, 4]).int())
    with pytest.raises(ValueError, match="do not split 7 rows"):  # checked in C, before anything is read
        cpu_library.member_matmul(x, w, offsets_of([3, 5]))
    with pytest.raises(ValueError, match="do not split 7 rows"):  # a member's rows past the end
        cpu_library.member_matmul(x, w, torch.tensor([0, 8, 7]))


@torch.no_grad()
@pytest.mark.parametrize("bias", [False, True])
def test_the_population_layer_reads_unequal_row_groups(bias):
    """set_member_rows([2, 0, 3]): member 0's two rows, none of member 1's, member 2's three, each
    through its own weights; None reads equal groups again."""
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=bias)
    weights = torch.randn(3, 40, 24)  # [members, out, in], the projection's own layout
    layer = PopulationLinear(base, weights)
    assert layer.compiled and layer.takes_unequal_groups
    x = torch.randn(5, 4, 24)  # 5 batch rows of 4 positions
    layer.set_member_rows([2, 0, 3])
    got = layer(x)
    expected = torch.cat(
        [
            torch.nn.functional.linear(x[:2], weights[0], base.bias),
            torch.nn.functional.linear(x[2:], weights[2], base.bias),
        ]
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="set_member_rows gave 5"):
        layer(torch.randn(6, 1, 24))
    layer.set_member_rows(None)
    equal = layer(x[:3])
    expected = torch.cat([torch.nn.functional.linear(x[i : i + 1], weights[i], base.bias) for i in range(3)])
    torch.testing.assert_close(equal, expected, rtol=1e-5, atol=1e-5)


def test_without_the_compiled_matmul_the_layer_keeps_equal_groups():
    base = torch.nn.Linear(8, 8)
    layer = PopulationLinear(base, torch.randn(2, 8, 8), backend="torch")  # torch.bmm
    assert not layer.compiled and not layer.takes_unequal_groups
    with pytest.raises(ValueError, match="compiled CPU products"):
        layer.set_member_rows([1, 1])
    float64 = PopulationLinear(base.double(), torch.randn(2, 8, 8, dtype=torch.float64))
    assert not float64.takes_unequal_groups  # the library's matmul is fp32


@torch.no_grad()
@pytest.mark.parametrize("faster", ["library", "torch"])
def test_the_layer_takes_the_member_matmul_only_where_it_measured_faster(monkeypatch, fresh_answer, faster):
    """Where torch's batched matmul measured faster, the layer runs it on equal groups (finished rows
    leave by whole columns); either way each member's rows go through its own weights."""
    from conftest import library_calls, measured_faster

    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    measured_faster(monkeypatch, {"member_matmul"} if faster == "library" else set())
    taken = library_calls(monkeypatch)
    torch.manual_seed(1)
    base = torch.nn.Linear(24, 40)
    weights = torch.randn(3, 40, 24)
    layer = PopulationLinear(base, weights)
    assert layer.compiled == layer.takes_unequal_groups == (faster == "library")
    x = torch.randn(6, 2, 24)  # two batch rows a member, of 2 positions
    expected = torch.cat(
        [torch.nn.functional.linear(x[2 * m : 2 * m + 2], weights[m], base.bias) for m in range(3)]
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert taken == (["member_matmul"] if faster == "library" else [])
