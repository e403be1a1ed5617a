"""Whole ES iteration on the tiny model and countdown: fastes vs the naive loop vs generation alone."""

from __future__ import annotations

import pytest

from benchmarks.common import IterationSetting, load_bench_model
from benchmarks.suites import iteration_variants

SETTING = IterationSetting(population=8, batch=16, max_new_tokens=8)
# Eval modes this fastes does not have, or this device cannot run, are skipped.
VARIANTS = ["fastes", "fastes-member", "fastes-virtual", "fastes-lowrank", "naive", "generate-only"]


@pytest.fixture(scope="module")
def variants(device, dtype):
    found, _ = iteration_variants(load_bench_model("tiny", device, dtype), SETTING, "auto")
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_es_iteration(timed, benchmark, variants, variant):
    if variant not in variants:
        pytest.skip(f"{variant} is not an eval mode of this fastes")
    benchmark.group = f"ES iteration tiny {SETTING.population}x{SETTING.batch}x{SETTING.max_new_tokens}"
    timed(variants[variant], rounds=3)
