"""Kernel-level suites: noise generation, perturb + restore, and the update vs population size."""

from __future__ import annotations

import pytest

from benchmarks.suites import noise_variants, perturb_variants, preserved, update_variants


@pytest.mark.parametrize("variant", ["fastes", "torch.randn"])
def test_noise(timed, benchmark, bench_model, device, variant):
    benchmark.group = f"noise {bench_model.name} ({bench_model.numel} normals)"
    benchmark.extra_info["normals"] = bench_model.numel
    timed(noise_variants(bench_model.numel, device)[variant])


@pytest.mark.parametrize("variant", ["fastes", "naive", "copy", "copy_foreach"])
def test_perturb_restore(timed, benchmark, bench_model, variant):
    benchmark.group = f"perturb+restore {bench_model.name}"
    benchmark.extra_info["bytes_moved"] = 2 * bench_model.nbytes
    variants = perturb_variants(bench_model, "auto")
    if variant not in variants:
        pytest.skip(f"{variant} is not available in this torch")
    with preserved(bench_model):
        timed(variants[variant])


@pytest.mark.parametrize("population", [8, 30, 128])
@pytest.mark.parametrize("variant", ["fastes", "naive"])
def test_update(timed, benchmark, bench_model, device, population, variant):
    benchmark.group = f"update {bench_model.name} N={population}"
    benchmark.extra_info["element_members"] = bench_model.numel * population
    # The CPU reference regenerates each noise at a few million normals/s: a handful of rounds there.
    rounds = 3 if device.type == "cpu" else None
    with preserved(bench_model):
        timed(update_variants(bench_model, population, "auto")[variant], rounds=rounds)
