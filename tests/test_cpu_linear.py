"""Which product computes a model's CPU linear layer (fastes.engine.cpu_linear): FASTES_CPU_PRODUCTS sets
it, or it is measured once per machine and kept in the cache directory; `linear` follows the answer and
gives the reference's result whichever product runs. (The library products' own paths: test_lowrank_term.)"""

import json

import pytest
import torch
from conftest import library_calls, linear_problem, linear_reference, linear_tolerance, measured_faster

from fastes.engine import cpu_library, cpu_linear
from fastes.engine.cpu_linear import Products


@pytest.mark.parametrize(
    "setting,expected", [("library", Products(*[True] * 7)), ("torch", Products(*[False] * 7))]
)
def test_the_setting_gives_the_products_without_measuring(monkeypatch, fresh_answer, setting, expected):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", setting)
    asked = measured_faster(monkeypatch, set())
    assert cpu_linear.products(1) == expected
    assert asked == [] and not (fresh_answer / cpu_linear.CACHE_FILE).exists()


def test_without_the_compiled_library_torchs_products_are_the_answer(monkeypatch, fresh_answer):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    monkeypatch.setattr(cpu_library, "available", lambda: False)
    asked = measured_faster(monkeypatch, set(Products._fields))
    assert cpu_linear.products(1) == Products(*[False] * 7)
    assert asked == []


def test_an_unknown_setting_is_refused_in_one_line(monkeypatch, fresh_answer):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "mkl")
    with pytest.raises(
        ValueError, match="FASTES_CPU_PRODUCTS must be one of measure, library, torch; got 'mkl'"
    ):
        cpu_linear.products(1)


def test_the_measured_answer_is_kept_on_disk_and_read_back(monkeypatch, fresh_answer):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    asked = measured_faster(monkeypatch, {"packed"})
    assert cpu_linear.products(1) == Products(
        few_rows=False,
        weight_major=False,
        packed=True,
        member_matmul=False,
        lowrank_member_matmul=False,
        small_packed=False,
        vocabulary=False,
    )
    saved = json.loads((fresh_answer / cpu_linear.CACHE_FILE).read_text())
    assert saved[cpu_linear.machine_key(1)]["packed"] is True
    assert saved[cpu_linear.machine_key(1)]["seconds"]["packed"] == {"library": 1.0, "torch": 2.0}
    cpu_linear.products.cache_clear()  # a new process: the file answers
    assert cpu_linear.products(1) == Products(False, False, True, False, False, False, False)
    assert asked == [1]
    # another thread count: another answer
    measured_faster(monkeypatch, {"few_rows", "lowrank_member_matmul", "small_packed", "vocabulary"})
    assert cpu_linear.products(2) == Products(True, False, False, False, True, True, True)
    saved = json.loads((fresh_answer / cpu_linear.CACHE_FILE).read_text())
    assert set(saved) == {cpu_linear.machine_key(1), cpu_linear.machine_key(2)}
    assert cpu_linear.machine_key(1) != cpu_linear.machine_key(2)


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"KEY": {"packed": "yes"}}'])
def test_a_damaged_cache_file_is_measured_again_and_rewritten(monkeypatch, fresh_answer, damage):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    path = fresh_answer / cpu_linear.CACHE_FILE
    path.write_text(damage.replace("KEY", cpu_linear.machine_key(1)))
    asked = measured_faster(monkeypatch, {"weight_major"})
    assert cpu_linear.products(1) == Products(False, True, False, False, False, False, False)
    assert asked == [1]
    assert json.loads(path.read_text())[cpu_linear.machine_key(1)]["weight_major"] is True


def test_a_cache_directory_that_cannot_be_written_still_gives_the_answer(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FASTES_CACHE_DIR", str(blocker / "cache"))  # under a file: mkdir fails
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    cpu_linear.products.cache_clear()
    try:
        measured_faster(monkeypatch, {"few_rows", "packed"})
        assert cpu_linear.products(1) == Products(True, False, True, False, False, False, False)
    finally:
        cpu_linear.products.cache_clear()


def test_measure_times_each_product_against_torchs_with_and_without_the_term():
    seconds = cpu_linear.measure(1, repeats=1)
    assert set(seconds) == set(Products._fields)
    both = {"library", "torch", "library with term", "torch with term"}
    assert set(seconds["few_rows"]) == set(seconds["packed"]) == both
    assert set(seconds["weight_major"]) == {"library", "torch"}  # the term follows either the same way
    assert set(seconds["member_matmul"]) == {"library", "torch"}  # the materialised layer: no term
    # the small low-rank layer: the member matmul with the factors, or torch's linear with the term after
    assert set(seconds["lowrank_member_matmul"]) == {"library", "torch"}
    assert set(seconds["small_packed"]) == {"library", "torch"}  # a small plain layer: no term
    assert set(seconds["vocabulary"]) == {"library", "torch"}  # the vocabulary's projection: no term
    assert all(s > 0 for pair in seconds.values() for s in pair.values())


def test_the_library_wins_over_every_way_both_were_timed():
    # faster plain, slower with the term: plain and ES generation together decide
    assert cpu_linear.library_wins(
        {"library": 1.0, "torch": 1.1, "library with term": 1.2, "torch with term": 1.5}
    )
    assert not cpu_linear.library_wins(
        {"library": 1.0, "torch": 1.1, "library with term": 1.7, "torch with term": 1.5}
    )
    assert not cpu_linear.library_wins({"library": 2.0, "torch": 2.0})  # a tie keeps torch's
    assert not cpu_linear.library_wins({"library": 21.22, "torch": 21.82})  # and so does a near-tie
    assert cpu_linear.library_wins({"library": 2.0, "torch": 2.1})


@pytest.mark.parametrize("with_term", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_torchs_products_linear_takes_torchs_at_every_row_count(
    monkeypatch, fresh_answer, with_term, seed
):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "torch")
    taken = library_calls(monkeypatch)
    for rows, k, n in (
        (1, 576, 576),
        (cpu_library.FEW_ROWS, 577, 192),
        (300, 576, 576),
        (40, 64, cpu_linear.VOCABULARY_ROWS),
    ):
        x, w, bias, term = linear_problem(
            rows, k, n, seed=seed, with_bias=True, members=3 if with_term else 0
        )
        taken.clear()
        got = cpu_linear.linear(x, w, bias, term)
        assert taken == (["lowrank_term"] if with_term else [])
        if not with_term:  # torch's own product, bit for bit
            assert torch.equal(got, torch.nn.functional.linear(x, w, bias))
        torch.testing.assert_close(got.double(), linear_reference(x, w, bias, term), **linear_tolerance(k, 1))


def test_each_library_product_is_taken_only_where_chosen(monkeypatch, fresh_answer):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    measured_faster(monkeypatch, {"packed"})  # the packed linear faster here, the few-rows pass not
    taken = library_calls(monkeypatch)
    x, w, bias, _ = linear_problem(2, 576, 576, seed=4, with_bias=False)
    cpu_linear.linear(x, w, bias)
    x, w, bias, _ = linear_problem(cpu_linear.PACKED_MIN_ROWS, 576, 576, seed=5, with_bias=False)
    cpu_linear.linear(x, w, bias)
    assert taken == ["packed_linear"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chosen", [set(), {"weight_major"}, {"vocabulary"}, {"vocabulary", "weight_major"}])
def test_a_vocabulary_wide_output_takes_the_library_from_the_packed_linears_rows_only_where_chosen(
    monkeypatch, fresh_answer, chosen, seed
):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    measured_faster(monkeypatch, {"few_rows", "packed"} | chosen)
    taken = library_calls(monkeypatch)
    n, least = cpu_linear.VOCABULARY_ROWS, cpu_linear.PACKED_MIN_ROWS
    for rows in (
        least - 1,
        least,
        cpu_linear.VOCABULARY_PACKED_MIN_ROWS - 1,
        cpu_linear.VOCABULARY_PACKED_MIN_ROWS,
    ):
        x, w, bias, _ = linear_problem(rows, 64, n, seed=seed, with_bias=True)
        taken.clear()
        got = cpu_linear.linear(x, w, bias)
        if rows < least:  # a decoding step's rows: the few-rows linear, vocabulary or not
            expected = ["few_rows_linear"]
        elif "vocabulary" in chosen:
            expected = [
                "packed_linear" if rows >= cpu_linear.VOCABULARY_PACKED_MIN_ROWS else "few_rows_linear"
            ]
        else:  # as without the vocabulary's choice: weight-major (torch's mm), else the packed linear
            expected = [] if "weight_major" in chosen else ["packed_linear"]
        assert taken == expected
        torch.testing.assert_close(
            got.double(), linear_reference(x, w, bias, None), **linear_tolerance(64, 1)
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("small_packed", [False, True])
def test_a_small_weight_takes_the_packed_linear_only_where_chosen_and_at_a_prefills_rows(
    monkeypatch, fresh_answer, small_packed, seed
):
    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    # every other product faster here: a small weight takes none of them
    faster = {"few_rows", "weight_major", "packed"} | ({"small_packed"} if small_packed else set())
    measured_faster(monkeypatch, faster)
    taken = library_calls(monkeypatch)
    # few rows, one short of the packed linear's, a prefill's, and output columns not in whole panels
    for rows, k, n in (
        (2, 64, 64),
        (cpu_linear.SMALL_PACKED_MIN_ROWS - 1, 64, 256),
        (640, 256, 64),
        (640, 64, 80),
    ):
        x, w, bias, _ = linear_problem(rows, k, n, seed=seed, with_bias=True)
        assert cpu_linear.is_small(w)
        taken.clear()
        got = cpu_linear.linear(x, w, bias)
        packed = small_packed and rows >= cpu_linear.SMALL_PACKED_MIN_ROWS and n % 32 == 0
        assert taken == (["packed_linear"] if packed else [])
        if not packed:  # torch's own product, bit for bit
            assert torch.equal(got, torch.nn.functional.linear(x, w, bias))
        torch.testing.assert_close(got.double(), linear_reference(x, w, bias, None), **linear_tolerance(k, 1))


def test_a_process_that_waits_for_anothers_measurement_takes_its_answer(monkeypatch, fresh_answer):
    """torchrun's ranks start together: one measures while the others wait, then read its answer."""
    fcntl = pytest.importorskip("fcntl")
    import threading

    monkeypatch.setenv("FASTES_CPU_PRODUCTS", "measure")
    asked = measured_faster(monkeypatch, set())
    with open(fresh_answer / (cpu_linear.CACHE_FILE + ".lock"), "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # another process is measuring
        answers: list[Products] = []
        waiting = threading.Thread(target=lambda: answers.append(cpu_linear.products(1)))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and not answers  # it waits for the lock
        (fresh_answer / cpu_linear.CACHE_FILE).write_text(
            json.dumps(
                {
                    cpu_linear.machine_key(1): {
                        **dict.fromkeys(Products._fields, False),
                        **{"few_rows": True, "packed": True},
                    }
                }
            )
        )
        fcntl.flock(other, fcntl.LOCK_UN)
    waiting.join(timeout=10)
    assert answers == [Products(True, False, True, False, False, False, False)]
    assert asked == []  # it did not measure again
