"""Exact multinomial draws of N samples over a large vocabulary (the simulator's N API calls)."""

from __future__ import annotations

import numpy as np

from nv.errors import NVError

_POISSON_MIN_N = 10_000


def multinomial_counts(rng: np.random.Generator, n: int, p: np.ndarray) -> np.ndarray:
    """Counts of ``n`` i.i.d. draws from the categorical distribution ``p`` (int64, len(p)).

    For large ``n``: independent Poisson(lambda p_i) counts with lambda = n - 3 sqrt(n) (redrawn
    in the rare case their total S exceeds n), topped up with n - S categorical draws. Given S,
    Poisson counts are Multinomial(S, p), so the sum is exactly Multinomial(n, p); it beats
    ``Generator.multinomial`` (one binomial per category), see benchmarks/bench_simulator.py.
    """
    if n < 1:
        raise NVError(f"number of samples N must be >= 1, got {n}")
    p = np.asarray(p, dtype=np.float64)
    if n < _POISSON_MIN_N:
        return rng.multinomial(n, p / p.sum())
    lam = (n - 3.0 * np.sqrt(n)) * p / p.sum()
    while True:
        counts = rng.poisson(lam)
        rest = n - int(counts.sum())
        if rest >= 0:
            break
    cdf = np.cumsum(p)
    extra = np.searchsorted(cdf, np.sort(rng.random(rest)) * cdf[-1], side="right")
    counts += np.bincount(np.minimum(extra, len(p) - 1), minlength=len(p))
    return counts
