"""Every measured figure has its source: results files are dated and never overwritten in place, and a
page that states a timing or a rate links the results file it comes from (CONTRIBUTING.md)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT_DIRS = [ROOT / "docs" / "results", ROOT / "benchmarks" / "results"]
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# A measured time or rate: "0.85 s", "241 ms", "8.9 min", "414 M/s", "350 GFLOP/s".
TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|min|minutes|[kMG]/s|GB/s|GFLOP/s)(?![\w/])")
# A link to a dated results file, a results folder's page, or the study's committed report.
# Pages whose timings are not yet sourced (none now; a page listed here must state a timing and link no
# results file, so that it is taken out once fixed).
NOT_YET_SOURCED: set[str] = set()
SOURCE = re.compile(r"\]\([^)]*(?:results/[^)]*\d{4}-\d{2}-\d{2}|experiment/(?:[^)]*/)?report\.md)")


def result_files():
    return sorted(p for d in RESULT_DIRS for p in d.rglob("*") if p.is_file())


def prose(text: str) -> str:
    """The page without its fenced blocks (commands and code state settings, not measurements)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_there_are_results_files():
    assert len(result_files()) > 10


@pytest.mark.parametrize("path", result_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_is_dated_or_a_copy_of_a_dated_one(path):
    """A dated name, so that a later run gets a new file; latest-*.md may only copy a dated report."""
    if DATE.search(path.name):
        return
    assert path.name.startswith("latest-") and path.suffix == ".md", f"{path}: no date in the name"
    dated = [p for p in path.parent.glob("*.md") if DATE.search(p.name)]
    assert any(p.read_bytes() == path.read_bytes() for p in dated), f"{path} copies no dated report"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_that_states_a_timing_links_a_results_file(page):
    text = prose(page.read_text())
    timings = TIMING.findall(text)
    if page.parent.name == "results" or page.parent.name in ("experiment", "seed1", "smollm2"):
        return  # a results page is the source itself
    if page.name in NOT_YET_SOURCED:
        assert timings and not SOURCE.search(text), f"{page.name} is fixed: take it out of NOT_YET_SOURCED"
        return
    assert not timings or SOURCE.search(text), f"{page.name} states {timings[:5]} but links no results file"


def test_the_check_finds_an_unsourced_timing():
    """The check above can fail: a timing with no link is caught, one with a link passes."""
    assert TIMING.search("one ES iteration took 6.7 s") and TIMING.search("414 M/s")
    assert not TIMING.search("a 2-core CPU, 3 seeds, 500 problems")
    assert not SOURCE.search("took 6.7 s ([docs](docs/backends.md))")
    assert SOURCE.search("took 6.7 s ([results](../benchmarks/results/real-model-cpu-2026-12-03.md))")
