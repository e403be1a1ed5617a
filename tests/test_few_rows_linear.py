"""The few-rows linear of late decoding steps (cpu_library.few_rows_linear, csrc/few_rows_linear_cpu.c)
against the plain-torch reference, x w^T (+ bias) in float64.

Every row count it takes (1 to FEW_ROWS), widths around the 16-float vectors (the last k % 16 summed one
by one), outputs around the threads' split, with and without a bias, several seeds; a row's bits depend
neither on the threads nor on the rows beside it; it refuses what it cannot take.
"""

import pytest
import torch

from fastes.engine import cpu_library

SEEDS = [0, 1, 31337]
WIDTHS = [1, 15, 16, 17, 33, 100, 577]  # k: below, at and around a vector, and a real model's odd width
OUTPUTS = [1, 2, 3, 65]  # n: fewer outputs than threads, and an odd split


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
@pytest.mark.parametrize("rows", range(1, cpu_library.FEW_ROWS + 1))
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
        for rows in (1, 3, cpu_library.FEW_ROWS):
            x, w, bias = problem(rows, 576, 1536, seed=rows, with_bias=True)
            got = cpu_library.few_rows_linear(x, w, bias)
            torch.testing.assert_close(got.double(), reference(x, w, bias), rtol=1e-5, atol=2e-6 * 576)
    finally:
        torch.set_num_threads(previous)


def test_a_rows_result_depends_on_neither_the_threads_nor_the_rows_beside_it():
    x, w, bias = problem(cpu_library.FEW_ROWS, 577, 1000, seed=5, with_bias=True)
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


def test_few_rows_linear_reads_a_strided_input():
    """A slice of a larger activation (the last position of each row) is read as its values."""
    x, w, _ = problem(12, 40, 9, seed=2, with_bias=False)
    view = x.view(4, 3, 40)[:, -1]  # 4 rows, strided
    got = cpu_library.few_rows_linear(view, w)
    torch.testing.assert_close(got.double(), reference(view, w, None), rtol=1e-5, atol=2e-6 * 40)


@pytest.mark.parametrize(
    "x, w, message",
    [
        (torch.zeros(cpu_library.FEW_ROWS + 1, 4), torch.zeros(3, 4), "1 to 8 rows"),
        (torch.zeros(0, 4), torch.zeros(3, 4), "1 to 8 rows"),
        (torch.zeros(2, 4), torch.zeros(3, 5), "1 to 8 rows"),
        (torch.zeros(1, 2, 4), torch.zeros(3, 4), "1 to 8 rows"),
        (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), "fp32"),
        (torch.zeros(2, 4), torch.zeros(4, 3).T, "contiguous weight"),
    ],
)
def test_few_rows_linear_refuses_what_it_cannot_take(x, w, message):
    with pytest.raises(ValueError, match=message):
        cpu_library.few_rows_linear(x, w)
