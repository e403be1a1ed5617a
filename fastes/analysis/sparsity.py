"""Which weights did training actually change, and do the biggest changes carry the gain?

All functions take two state dicts (name -> tensor) of the same model, base theta_0 and trained theta_1,
and work on the update delta = theta_1 - theta_0 computed in fp32. Only floating-point tensors count;
integer or bool buffers are ignored by the measurements and copied unchanged from the trained state.

- Update sparsity at tolerance tol: share of elements with |delta| <= tol (Mukherjee et al. 2025 report
  1 - ||delta||_0 / n, which is tol = 0). In bf16 part of it is a rounding artefact: updates below half a
  bf16 step round away.
- Functional sparsity: theta_k = theta_0 + M_k * delta with M_k a 0/1 mask keeping a fraction k of the
  elements: those of largest |delta| ("top"), smallest |delta| ("bottom" control) or a random set of the
  same density ("random" control), counted over all tensors ("global") or within each tensor
  ("per_tensor"). Then gain retained = (acc(theta_k) - acc(theta_0)) / (acc(theta_1) - acc(theta_0)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike

StateDict = Mapping[str, torch.Tensor]

KEEP_FRACTIONS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)
DEFAULT_TOLERANCES = (0.0, 1e-8, 1e-6, 1e-4)
SCOPES = ("global", "per_tensor")
KINDS = ("top", "bottom", "random")


def _compared_names(base: StateDict, trained: StateDict) -> list[str]:
    """Names of the floating-point tensors to compare, in the base's order, after checking both match."""
    if set(base) != set(trained):
        only_base = sorted(set(base) - set(trained))
        only_trained = sorted(set(trained) - set(base))
        raise ValueError(
            f"state dicts differ in names: only in base {only_base[:5]}, only in trained {only_trained[:5]}"
        )
    names = []
    for name, tensor in base.items():
        other = trained[name]
        if tensor.shape != other.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} in base, {tuple(other.shape)} in trained")
        if tensor.is_floating_point() != other.is_floating_point():
            raise ValueError(f"{name}: floating point in one state dict and not in the other")
        if tensor.is_floating_point():
            names.append(name)
    if not names:
        raise ValueError("the state dicts hold no floating-point tensors")
    return names


def _delta(base: StateDict, trained: StateDict, name: str) -> torch.Tensor:
    """delta = theta_1 - theta_0 for one tensor, in fp32 on the trained tensor's device."""
    after = trained[name]
    return after.float() - base[name].to(after.device).float()


def update_deltas(base: StateDict, trained: StateDict) -> dict[str, torch.Tensor]:
    """delta = trained - base in fp32 for every floating-point tensor (name -> tensor)."""
    return {name: _delta(base, trained, name) for name in _compared_names(base, trained)}


@dataclass(frozen=True)
class UpdateSparsity:
    """Share of unchanged elements (|delta| <= tol) for each tolerance, overall and per tensor."""

    overall: dict[float, float]  # tol -> share over all floating-point elements
    per_tensor: dict[str, dict[float, float]]  # name -> tol -> share within that tensor
    n_elements: int  # elements counted overall


def update_sparsity(
    base: StateDict, trained: StateDict, tolerances: Sequence[float] = DEFAULT_TOLERANCES
) -> UpdateSparsity:
    """Update sparsity: share of elements with |theta_1 - theta_0| <= tol, for each tol in `tolerances`.

    tol = 0 gives 1 - ||delta||_0 / n. A NaN delta counts as changed. An empty tensor gets NaN shares.
    """
    tolerances = tuple(float(tol) for tol in tolerances)
    if any(not tol >= 0 for tol in tolerances):
        raise ValueError(f"tolerances must be >= 0, got {tolerances}")
    unchanged_total = dict.fromkeys(tolerances, 0)
    per_tensor: dict[str, dict[float, float]] = {}
    n_total = 0
    for name in _compared_names(base, trained):
        magnitude = _delta(base, trained, name).abs()
        n = magnitude.numel()
        shares = {}
        for tol in tolerances:
            unchanged = int((magnitude <= tol).sum())
            unchanged_total[tol] += unchanged
            shares[tol] = unchanged / n if n > 0 else math.nan
        per_tensor[name] = shares
        n_total += n
    overall = {tol: (unchanged_total[tol] / n_total if n_total > 0 else math.nan) for tol in tolerances}
    return UpdateSparsity(overall=overall, per_tensor=per_tensor, n_elements=n_total)


def per_tensor_delta_norms(base: StateDict, trained: StateDict, relative: bool = False) -> dict[str, float]:
    """||theta_1 - theta_0||_2 per tensor (fp32); with relative=True divided by ||theta_0||_2.

    A relative norm of a tensor whose base is all zeros is inf (or NaN when it did not change either).
    """
    norms = {}
    for name in _compared_names(base, trained):
        norm = float(torch.linalg.vector_norm(_delta(base, trained, name)))
        if relative:
            base_norm = float(torch.linalg.vector_norm(base[name].float()))
            norm = norm / base_norm if base_norm > 0 else (math.nan if norm == 0 else math.inf)
        norms[name] = norm
    return norms


def _check_fraction(keep_fraction: float) -> None:
    if not 0.0 <= keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must lie in [0, 1], got {keep_fraction}")


def kept_count(keep_fraction: float, n_elements: int) -> int:
    """Elements kept by a mask of density keep_fraction: round(keep_fraction * n_elements), halves up."""
    _check_fraction(keep_fraction)
    return min(n_elements, int(math.floor(keep_fraction * n_elements + 0.5)))


def _keep_largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask over a 1-D tensor keeping exactly its k largest scores.

    Ties at the threshold are broken deterministically: the earliest positions are kept first.
    """
    n = scores.numel()
    if k == 0:
        return torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k == n:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    threshold = torch.kthvalue(scores, n - k + 1).values  # the k-th largest score
    above = scores > threshold
    ties_needed = k - int(above.sum())
    at_threshold = scores == threshold
    rank_among_ties = torch.cumsum(at_threshold, dim=0)  # 1, 2, ... along the tied positions
    return above | (at_threshold & (rank_among_ties <= ties_needed))


def _mask_scores(delta: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Flat fp32 scores whose largest entries a mask of this kind keeps."""
    if kind == "top":
        return delta.abs().reshape(-1)
    if kind == "bottom":
        return -delta.abs().reshape(-1)
    # random: uniform scores from a CPU generator, so the mask is the same on every device
    return torch.rand(delta.numel(), generator=generator).to(delta.device)


def keep_masks(
    base: StateDict,
    trained: StateDict,
    keep_fraction: float,
    scope: str = "global",
    kind: str = "top",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Bool masks M (name -> tensor of the tensor's shape) selecting which elements of delta to keep.

    kind "top" keeps the largest |delta|, "bottom" the smallest, "random" a uniformly random set (seeded).
    scope "global" keeps exactly kept_count(keep_fraction, n) elements counted over all floating-point
    tensors; "per_tensor" keeps kept_count(keep_fraction, n_t) in each tensor. Ties are broken by position:
    tensors in the base state dict's order, elements in row-major order, earliest first.
    Deltas must be finite.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    _check_fraction(keep_fraction)
    names = _compared_names(base, trained)
    generator = torch.Generator().manual_seed(seed)
    scores = {}
    for name in names:
        delta = _delta(base, trained, name)
        if not bool(torch.isfinite(delta).all()):
            raise ValueError(f"{name}: delta has NaN or inf entries; masks need finite updates")
        scores[name] = _mask_scores(delta, kind, generator)

    if scope == "per_tensor":
        masks = {}
        for name in names:
            flat_mask = _keep_largest(scores[name], kept_count(keep_fraction, scores[name].numel()))
            masks[name] = flat_mask.reshape(base[name].shape)
        return masks
    device = scores[names[0]].device
    all_scores = torch.cat([scores[name].to(device) for name in names])
    flat_mask = _keep_largest(all_scores, kept_count(keep_fraction, all_scores.numel()))
    pieces = flat_mask.split([scores[name].numel() for name in names])
    return {
        name: piece.reshape(base[name].shape).to(scores[name].device)
        for name, piece in zip(names, pieces, strict=True)
    }


def topk_mask_state(
    base: StateDict,
    trained: StateDict,
    keep_fraction: float,
    scope: str = "global",
    kind: str = "top",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """theta_k = theta_0 + M * delta as a new state dict, M from keep_masks (see there for the arguments).

    Computed as where(M, theta_1, theta_0), which is the same value without rounding: kept elements are
    bit-identical to the trained weights, the others to the base weights. Each tensor has the trained
    tensor's dtype and device (the base is cast when they differ). keep_fraction 1.0 reproduces the
    trained state exactly and 0.0 the base state. Non-floating tensors are copied from the trained state.
    """
    masks = keep_masks(base, trained, keep_fraction, scope=scope, kind=kind, seed=seed)
    result = {}
    for name, after in trained.items():
        if name in masks:
            before = base[name].to(device=after.device, dtype=after.dtype)
            result[name] = torch.where(masks[name], after, before)
        else:
            result[name] = after.clone()
    return result


def gain_retained(acc_k: float | ArrayLike, acc_base: float, acc_trained: float) -> float | np.ndarray:
    """Gain retained = (acc(theta_k) - acc(theta_0)) / (acc(theta_1) - acc(theta_0)).

    acc_k may be one accuracy or an array (e.g. one per kept fraction). When training gained nothing
    (acc_trained == acc_base) the ratio is undefined and NaN is returned, without a warning or error.
    """
    acc_k_array = np.asarray(acc_k, dtype=np.float64)
    gain = float(acc_trained) - float(acc_base)
    if gain == 0.0 or math.isnan(gain):
        retained = np.full(acc_k_array.shape, math.nan)
    else:
        retained = (acc_k_array - float(acc_base)) / gain
    return float(retained) if retained.ndim == 0 else retained


@dataclass(frozen=True)
class DeltaHistogram:
    """Histogram of log10|delta| over all floating-point elements; exact zeros are counted apart."""

    edges: np.ndarray  # bin edges in log10 units, length bins + 1
    counts: np.ndarray  # elements per bin (values outside [edges[0], edges[-1]] go to the end bins)
    n_zero: int  # elements with delta exactly 0 (log10 0 = -inf has no bin)
    n_elements: int  # all elements counted, zeros included


def delta_log10_histogram(
    base: StateDict, trained: StateDict, bins: int = 65, low: float = -12.0, high: float = 1.0
) -> DeltaHistogram:
    """Histogram of log10|theta_1 - theta_0| with `bins` equal bins over [low, high], one tensor at a time.

    Non-zero magnitudes outside the range are clamped into the first or last bin; exact zeros are
    reported as n_zero. NaN deltas are left out of the bins (but counted in n_elements).
    """
    if bins < 1 or not low < high:
        raise ValueError(f"need bins >= 1 and low < high, got bins={bins}, low={low}, high={high}")
    bin_width = (high - low) / bins
    counts = np.zeros(bins, dtype=np.int64)
    n_zero = 0
    n_elements = 0
    for name in _compared_names(base, trained):
        magnitude = _delta(base, trained, name).abs().reshape(-1)
        n_elements += magnitude.numel()
        n_zero += int((magnitude == 0).sum())
        nonzero = magnitude[magnitude > 0]  # also drops NaN
        # bin index floor((log10|delta| - low) / width), clamped into 0 .. bins-1; integer counts stay exact
        position = (torch.log10(nonzero.double()) - low) / bin_width
        index = position.floor().clamp(0, bins - 1).long()
        counts += torch.bincount(index, minlength=bins).cpu().numpy()
    return DeltaHistogram(
        edges=np.linspace(low, high, bins + 1), counts=counts, n_zero=n_zero, n_elements=n_elements
    )
