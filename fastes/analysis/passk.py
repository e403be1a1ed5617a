"""Unbiased pass@k (Chen et al. 2021) and Pass@K curves.

For one problem with n sampled completions of which c are correct, the chance that at least one of k
completions drawn without replacement from those n is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)

and it equals 1 when n - c < k (every draw of k must contain a correct completion). The ratio of binomials
is computed in the stable product form

    C(n - c, k) / C(n, k) = prod_{i = n-c+1 .. n} (1 - k / i)

which never forms the huge binomial coefficients themselves.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _as_counts(values: ArrayLike, name: str) -> np.ndarray:
    """`values` as an int64 array of whole, non-negative numbers, or a ValueError saying what is wrong."""
    array = np.asarray(values)
    if array.dtype == bool:
        raise ValueError(f"{name} must hold counts (whole numbers), got booleans")
    if not np.issubdtype(array.dtype, np.integer):
        is_whole = (
            np.issubdtype(array.dtype, np.floating)
            and bool(np.all(np.isfinite(array)))
            and bool(np.all(array == np.round(array)))
        )
        if not is_whole:
            raise ValueError(f"{name} must hold whole numbers, got {array.dtype} values {array!r}")
    array = array.astype(np.int64)
    if np.any(array < 0):
        raise ValueError(f"{name} must be >= 0, got {array[array < 0].tolist()[:5]}")
    return array


def _pass_at_k_single(n: int, c: int, k: int) -> float:
    """pass@k of one problem: 1 - prod_{i=n-c+1..n} (1 - k/i), or 1.0 when n - c < k."""
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return 1.0 - float(np.prod(1.0 - k / i))


def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float | np.ndarray:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1..n} (1 - k/i); 1.0 if n - c < k.

    n: completions sampled per problem, c: how many of them are correct. Both may be python ints or
    array-likes (broadcast against each other, one entry per problem); k is one int >= 1.
    Returns a float when n and c are both scalars, else a float64 array of their broadcast shape.
    Raises ValueError when k < 1, k > n, n or c is negative or not a whole number, or c > n.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an int, got {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_array = _as_counts(n, "n")
    c_array = _as_counts(c, "c")
    n_array, c_array = np.broadcast_arrays(n_array, c_array)
    if np.any(c_array > n_array):
        raise ValueError("c (correct completions) cannot exceed n (sampled completions)")
    if np.any(n_array < k):
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, got n={int(n_array.min())}")

    result = np.empty(n_array.shape, dtype=np.float64)
    if result.size > 0:
        # Problems share few distinct (n, c) pairs: compute each pair's product once.
        pairs = np.stack([n_array.ravel(), c_array.ravel()], axis=1)
        unique_pairs, inverse = np.unique(pairs, axis=0, return_inverse=True)
        values = np.array([_pass_at_k_single(int(ni), int(ci), k) for ni, ci in unique_pairs])
        result = values[inverse.reshape(-1)].reshape(n_array.shape)
    if np.ndim(n) == 0 and np.ndim(c) == 0:
        return float(result)
    return result


def k_values(n: int) -> list[int]:
    """The k of a Pass@K curve for n samples per problem: 1, 2, 4, ... (powers of two below n), then n."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(int(n))
    return ks


def pass_at_k_curve(correct_counts: ArrayLike, n: int) -> dict[int, float]:
    """Pass@K curve: {k: mean over problems of pass_at_k(n, c_problem, k)} for k in k_values(n).

    correct_counts: one count of correct completions per problem, each out of the same n samples.
    """
    counts = _as_counts(correct_counts, "correct_counts").ravel()
    if counts.size == 0:
        raise ValueError("correct_counts is empty: a Pass@K curve needs at least one problem")
    return {k: float(np.mean(pass_at_k(n, counts, k))) for k in k_values(n)}
