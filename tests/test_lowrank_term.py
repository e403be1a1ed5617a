"""The low-rank population's term added after a product computed elsewhere (cpu_library.lowrank_term,
csrc/packed_linear_cpu.c), and `cpu_linear.linear`, which runs a linear layer with or without the term
by the product chosen for its rows, against the plain-torch reference in float64.

Row counts from one to past the packed linear's, widths around the 16-float vectors, members with unequal
and empty row groups, ranks 1 to 3, several seeds; a row's bits depend neither on the threads nor on the
rows beside it; `linear` takes each of its paths where its rules say; both refuse what they cannot take.
"""

import pytest
import torch
from conftest import library_calls, linear_problem, linear_reference, linear_tolerance

from fastes.engine import cpu_library, cpu_linear
from fastes.engine.cpu_library import LowRankTerm

SEEDS = [0, 1, 31337]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", [1, 2, 9, 64, 300])
@pytest.mark.parametrize("members,rank", [(1, 1), (3, 1), (4, 2), (5, 3)])
def test_lowrank_term_adds_each_members_term_in_place(seed, rows, members, rank):
    for k, n in ((17, 5), (65, 33), (577, 64)):
        x, w, bias, term = linear_problem(rows, k, n, seed, True, members, rank)
        y = torch.nn.functional.linear(x, w, bias)
        got = cpu_library.lowrank_term(x, y, term)
        assert got is y  # in place
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, term), **linear_tolerance(k, rank)
        )


def test_a_rows_term_depends_on_neither_the_threads_nor_the_rows_beside_it():
    x, w, bias, term = linear_problem(200, 576, 192, seed=4, with_bias=False, members=8, rank=2)
    base = torch.nn.functional.linear(x, w)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = cpu_library.lowrank_term(x, base.clone(), term)
        torch.set_num_threads(1)
        assert torch.equal(cpu_library.lowrank_term(x, base.clone(), term), together)
        for row in (0, 77, 199):
            member = int(torch.searchsorted(term.offsets, row, right=True)) - 1
            alone = LowRankTerm(
                term.inputs[member : member + 1], term.outputs[member : member + 1], torch.tensor([0, 1])
            )
            assert torch.equal(
                cpu_library.lowrank_term(x[row : row + 1], base[row : row + 1].clone(), alone)[0],
                together[row],
            )
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    "x, y, term, message",
    [
        (torch.zeros(2, 4), torch.zeros(3, 5), None, "do not match"),
        (torch.zeros(2, 4), torch.zeros(5, 2).T, None, "contiguous fp32"),
        (torch.zeros(2, 4).double(), torch.zeros(2, 5).double(), None, "contiguous fp32"),
        (
            torch.zeros(2, 4),
            torch.zeros(2, 5),
            (torch.zeros(1, 1, 4), torch.zeros(1, 1, 6), [0, 2]),
            "do not match",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(2, 5),
            (torch.zeros(2, 1, 4), torch.zeros(2, 1, 5), [0, 1, 3]),
            "do not split",
        ),
        (
            torch.zeros(2, 4),
            torch.zeros(2, 5),
            (torch.zeros(2, 1, 4), torch.zeros(2, 1, 5), [1, 1, 2]),
            "do not split",
        ),
    ],
)
def test_lowrank_term_refuses_what_it_cannot_take(x, y, term, message):
    inputs, outputs, offsets = term or (torch.zeros(1, 1, 4), torch.zeros(1, 1, 5), [0, 2])
    with pytest.raises(ValueError, match=message):
        cpu_library.lowrank_term(x, y, LowRankTerm(inputs, outputs, torch.tensor(offsets)))


@pytest.mark.parametrize("with_term", [False, True])
def test_linear_takes_each_path_where_its_rules_say_and_matches_the_reference(monkeypatch, with_term):
    taken = library_calls(monkeypatch)
    side = 576  # SmolLM2's projections: a weight of 1.3 MB, in whole panels
    cases = {
        1: ["few_rows_linear"],
        cpu_library.FEW_ROWS: ["few_rows_linear"],
        cpu_library.FEW_ROWS + 1: ["few_rows_linear"],
        cpu_linear.PACKED_MIN_ROWS - 1: ["few_rows_linear"],
        cpu_linear.PACKED_MIN_ROWS: ["packed_linear"],
    }
    for rows, expected in cases.items():
        x, w, bias, term = linear_problem(
            rows, side, side, seed=rows, with_bias=True, members=3 if with_term else 0
        )
        taken.clear()
        got = cpu_linear.linear(x, w, bias, term)
        assert taken == [path for path in expected if with_term or path != "lowrank_term"]
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, term), **linear_tolerance(side, 1)
        )
    # a vocabulary-wide output: the few-rows linear below VOCABULARY_PACKED_MIN_ROWS rows (the tests'
    # products are the library's), the packed linear from there, the term in either
    for rows, expected in (
        (40, ["few_rows_linear"]),
        (cpu_linear.PACKED_MIN_ROWS, ["few_rows_linear"]),
        (cpu_linear.VOCABULARY_PACKED_MIN_ROWS, ["packed_linear"]),
    ):
        x, w, bias, term = linear_problem(
            rows, 64, cpu_linear.VOCABULARY_ROWS, seed=9, with_bias=True, members=3 if with_term else 0
        )
        taken.clear()
        got = cpu_linear.linear(x, w, bias, term)
        assert taken == [path for path in expected if with_term or path != "lowrank_term"]
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, term), **linear_tolerance(64, 1)
        )
    # a weight that stays in the caches (below MIN_WEIGHT_BYTES): the packed linear at a prefill's rows
    # (the tests' products are the library's), torch's linear below them
    for rows, expected in (
        (400, ["packed_linear"]),
        (cpu_linear.SMALL_PACKED_MIN_ROWS - 1, ["lowrank_term"]),
    ):
        x, w, bias, term = linear_problem(
            rows, 64, 256, seed=3, with_bias=False, members=2 if with_term else 0
        )
        taken.clear()
        got = cpu_linear.linear(x, w, bias, term)
        assert taken == [path for path in expected if with_term or path != "lowrank_term"]
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, term), **linear_tolerance(64, 1)
        )


def test_a_term_is_checked_once_and_a_layer_keeps_one_per_grouping_of_its_rows(monkeypatch):
    """A low-rank layer runs for every token: it makes its term once per row grouping (as its row
    offsets), and the term's checks run on its first use only, not at every decoding step. (A layer this
    small takes the member matmul where that is the machine's product: not here.)"""
    from fastes.engine import cpu_linear
    from fastes.es.population import LowRankLinear

    monkeypatch.setattr(
        cpu_linear, "products", lambda threads: cpu_linear.Products(True, True, True, True, False, True, True)
    )

    checks = []
    original = LowRankTerm._check
    monkeypatch.setattr(LowRankTerm, "_check", lambda self, *a: checks.append(id(self)) or original(self, *a))
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 16, bias=False)
    factors = [(torch.randn(16, 1), torch.randn(24, 1)) for _ in range(3)]
    layer = LowRankLinear.from_factors(base, factors, [1e-2, -1e-2, 2e-2], backend="cpu")
    x = torch.randn(6, 24)
    first = layer(x)
    assert torch.equal(layer(x), first) and torch.equal(layer(x), first)
    assert len(checks) == 1  # three calls at six rows: one term, checked once
    layer(torch.randn(9, 24))
    assert len(checks) == 2 and checks[0] != checks[1]  # nine rows: another grouping, another term
    expected = base(x) + torch.cat(
        [
            (x[2 * m : 2 * m + 2] @ b) @ a.T * s
            for m, ((a, b), s) in enumerate(zip(factors, [1e-2, -1e-2, 2e-2]))
        ]
    )
    torch.testing.assert_close(layer(x), expected)
