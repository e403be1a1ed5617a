"""The few-rows linear of decoding steps (cpu_library.few_rows_linear, csrc/few_rows_linear_cpu.c)
against the plain-torch reference, x w^T (+ bias) in float64, and with the low-rank population's term
(each row's member's sum_j (x . inputs[m, j]) outputs[m, j]).

Every row count of one pass (1 to FEW_ROWS) and several passes' worth (the rows in groups of FEW_ROWS),
widths around the 16-float vectors (the last k % 16 summed one by one), outputs around the threads'
split and the weight blocks, with and without a bias, members with unequal and empty row groups, and
groups across the passes' boundaries, ranks 1 to 3, several seeds; a row's bits depend neither on the
threads nor on the rows beside it; it refuses what it cannot take.
"""

import pytest
import torch
from conftest import linear_problem, linear_reference, linear_tolerance

from fastes.engine import cpu_library
from fastes.engine.cpu_library import LowRankTerm

SEEDS = [0, 1, 31337]
WIDTHS = [1, 15, 16, 17, 33, 100, 577]  # k: below, at and around a vector, and a real model's odd width
OUTPUTS = [1, 2, 3, 65, 300]  # n: fewer outputs than threads, an odd split, several weight blocks a thread
# one pass (1 to FEW_ROWS rows), then several: a pass and one row, two and an odd part, eight
ROWS = [*range(1, cpu_library.FEW_ROWS + 1), cpu_library.FEW_ROWS + 1, 2 * cpu_library.FEW_ROWS + 5, 64]


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def problem(rows: int, k: int, n: int, seed: int, with_bias: bool):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    return x, w, bias


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_linear_matches_the_reference(seed, rows, with_bias):
    for k in WIDTHS:
        for n in OUTPUTS:
            x, w, bias = problem(rows, k, n, seed, with_bias)
            got = cpu_library.few_rows_linear(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            # fp32 products summed over k: the error grows with sqrt(k) times the terms' size
            torch.testing.assert_close(got.double(), reference(x, w, bias), rtol=1e-5, atol=2e-6 * k)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_layer_is_shared_by_the_threads_and_matches_the_reference(threads):
    """A weight big enough that torch's threads share it (a SmolLM2 projection's shape)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, cpu_library.FEW_ROWS, 64):
            x, w, bias = problem(rows, 576, 1536, seed=rows, with_bias=True)
            got = cpu_library.few_rows_linear(x, w, bias)
            torch.testing.assert_close(got.double(), reference(x, w, bias), rtol=1e-5, atol=2e-6 * 576)
    finally:
        torch.set_num_threads(previous)


def test_a_rows_result_depends_on_neither_the_threads_nor_the_rows_beside_it():
    """Two passes and an odd part against each row alone: the same bits, though a pass of FEW_ROWS rows
    reads two weight rows at a time and a pass of one row one."""
    x, w, bias = problem(2 * cpu_library.FEW_ROWS + 5, 577, 1000, seed=5, with_bias=True)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = cpu_library.few_rows_linear(x, w, bias)
        torch.set_num_threads(1)
        for row in range(x.shape[0]):
            alone = cpu_library.few_rows_linear(x[row : row + 1], w, bias)
            assert torch.equal(alone[0], together[row])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("members,rank", [(1, 1), (3, 1), (4, 2), (5, 3)])
def test_the_low_rank_term_is_added_to_each_members_rows(seed, rows, members, rank):
    for k in (17, 65, 577):
        for n in (1, 3, 65, 300):
            x, w, bias, term = linear_problem(rows, k, n, seed, seed % 2 == 0, members, rank)
            got = cpu_library.few_rows_linear(x, w, bias, term)
            torch.testing.assert_close(
                got.double(), linear_reference(x, w, bias, term), **linear_tolerance(k, rank)
            )


@pytest.mark.parametrize("threads", [1, 2])
def test_the_term_over_the_threads_matches_the_reference_and_depends_on_no_neighbour(threads):
    """A SmolLM2 projection's shape, its weight shared by the threads; each row alone, a one-row group
    of its own member, gives the same bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, bias, term = linear_problem(
            2 * cpu_library.FEW_ROWS + 5, 576, 1536, seed=threads, with_bias=True, members=3
        )
        together = cpu_library.few_rows_linear(x, w, bias, term)
        torch.testing.assert_close(
            together.double(), linear_reference(x, w, bias, term), **linear_tolerance(576, 1)
        )
        for row in range(x.shape[0]):
            member = int(torch.searchsorted(term.offsets, row, right=True)) - 1
            alone_term = LowRankTerm(
                term.inputs[member : member + 1], term.outputs[member : member + 1], torch.tensor([0, 1])
            )
            assert torch.equal(
                cpu_library.few_rows_linear(x[row : row + 1], w, bias, alone_term)[0], together[row]
            )
    finally:
        torch.set_num_threads(previous)


def test_few_rows_linear_refuses_a_term_that_does_not_fit():
    x, w = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="do not split 3 rows"):
        cpu_library.few_rows_linear(
            x, w, None, LowRankTerm(torch.zeros(2, 1, 4), torch.zeros(2, 1, 5), torch.tensor([0, 2, 4]))
        )
    with pytest.raises(ValueError, match="do not match"):
        cpu_library.few_rows_linear(
            x, w, None, LowRankTerm(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.tensor([0, 2, 3]))
        )
    with pytest.raises(ValueError, match="fp32"):
        term = LowRankTerm(torch.zeros(2, 1, 4).double(), torch.zeros(2, 1, 5), torch.tensor([0, 2, 3]))
        cpu_library.few_rows_linear(x, w, None, term)


def test_few_rows_linear_reads_a_strided_input():
    """A slice of a larger activation (the last position of each row) is read as its values."""
    x, w, _ = problem(12, 40, 9, seed=2, with_bias=False)
    view = x.view(4, 3, 40)[:, -1]  # 4 rows, strided
    got = cpu_library.few_rows_linear(view, w)
    torch.testing.assert_close(got.double(), reference(view, w, None), rtol=1e-5, atol=2e-6 * 40)


@pytest.mark.parametrize(
    "x, w, message",
    [
        (torch.zeros(0, 4), torch.zeros(3, 4), "rows of the weight's width"),
        (torch.zeros(2, 4), torch.zeros(3, 5), "rows of the weight's width"),
        (torch.zeros(1, 2, 4), torch.zeros(3, 4), "rows of the weight's width"),
        (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), "fp32"),
        (torch.zeros(2, 4), torch.zeros(4, 3).T, "contiguous weight"),
    ],
)
def test_few_rows_linear_refuses_what_it_cannot_take(x, w, message):
    with pytest.raises(ValueError, match=message):
        cpu_library.few_rows_linear(x, w)
