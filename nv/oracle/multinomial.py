"""Exact multinomial draws of N samples over a large vocabulary (the simulator's N API calls)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nv.errors import NVError

_POISSON_MIN_N = 10_000
_POOL = ThreadPoolExecutor(max_workers=1)  # the second half of the vocabulary, beside the caller's thread


def _poisson_halves(rng: np.random.Generator, lam: np.ndarray) -> np.ndarray:
    """Independent Poisson(lam_i) counts, the two halves of ``lam`` drawn on two threads.

    Each half has its own generator spawned from ``rng`` (numpy releases the GIL while drawing), so
    the draws depend only on the seed, never on the machine's core count.
    """
    first, second = rng.spawn(2)
    half = len(lam) // 2
    upper = _POOL.submit(second.poisson, lam[half:])
    return np.concatenate([first.poisson(lam[:half]), upper.result()])


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
        counts = _poisson_halves(rng, lam)
        rest = n - int(counts.sum())
        if rest >= 0:
            break
    cdf = np.cumsum(p)
    extra = np.searchsorted(cdf, np.sort(rng.random(rest)) * cdf[-1], side="right")
    counts += np.bincount(np.minimum(extra, len(p) - 1), minlength=len(p))
    return counts
