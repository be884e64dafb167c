"""Sample complexity of the common-set attack (§4.1.2 Theorem 1, App. F Corollary 1, §5.2 Fig. expected-N-vs-D).

Notation as in the paper: D prompts, N samples per prompt, vocabulary V, target common-set size d,
failure probability delta, p_q^(i) the probability of token v_i under prompt q. Everything is
computed in log space (log1p / expm1), so it stays finite for |V| up to 262,144, D up to 20,000 and
N up to 1e7; D x |V| matrices are read in row chunks, never copied whole.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
from scipy import optimize, sparse, special

from nv.errors import NVError

_CHUNK_BYTES = 1 << 25  # float64 working set per row chunk (32 MiB)
_CACHE_BYTES = 1 << 28  # log(1 - p) of the kept tokens stays in memory during root finding if it fits (256 MiB)
_PRUNE_EPS = 1e-12  # tokens dropped before root finding shift mu by at most _PRUNE_EPS * d


def _log1mexp(a: np.ndarray) -> np.ndarray:
    """log(1 - exp(a)) for a <= 0, accurate on both sides of -ln 2 (Maechler's log1mexp)."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a > -math.log(2.0), np.log(-np.expm1(a)), np.log1p(-np.exp(a)))


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise NVError(f"delta must be in (0, 1), got {delta}")


def required_mean(d: float, delta: float) -> float:
    """m = d + sqrt(2 d ln(1/delta)) + 2 ln(1/delta), the mean that guarantees |C| >= d w.p. 1 - delta (Eq. mu-condition)."""
    _check_delta(delta)
    if d <= 0:
        raise NVError(f"target common-set size d must be positive, got {d}")
    log_inv = -math.log(delta)
    return d + math.sqrt(2.0 * d * log_inv) + 2.0 * log_inv


def corollary1_samples(d: float, D: int, V_sub: int, t: float, delta: float = 0.05) -> int:
    """Corollary 1 (App. F): smallest integer N with N >= ln[1 - (m/|V'|)^(1/D)] / ln(1 - t).

    Every prompt distribution is t-flat over a sub-vocabulary V' of size ``V_sub`` (p_q^(i) >= t on V');
    then |C| >= d with probability >= 1 - delta. m is ``required_mean(d, delta)``. The 1/D root of
    m/|V'| (close to 1) goes through expm1, the denominator through log1p.
    """
    if D < 1 or V_sub < 1:
        raise NVError(f"need D >= 1 and |V'| >= 1, got D={D}, |V'|={V_sub}")
    if not 0.0 < t < 1.0 or t * V_sub > 1.0 + 1e-6:
        raise NVError(f"flatness t must be in (0, 1) with t |V'| <= 1, got t={t}, |V'|={V_sub}")
    m = required_mean(d, delta)
    if m >= V_sub:
        raise NVError(f"d={d} unreachable: d + sqrt(2d ln(1/delta)) + 2 ln(1/delta) = {m:.1f} >= |V'| = {V_sub}")
    n_star = _log1mexp(math.log(m / V_sub) / D) / math.log1p(-t)
    return _smallest_integer(n_star, lambda n: _log_mean_lower(n, D, V_sub, t) >= math.log(m))


def theorem1_samples(d: float, D: int, V: int, delta: float = 0.05) -> int:
    """Theorem 1 (Eq. uniform-sample-complexity-bound): smallest integer N with
    N >= ln[1 - ((d + sqrt(2 d ln(1/delta)) + 2 ln(1/delta))/|V|)^(1/D)] / ln(1 - 1/|V|),
    so that D uniform subsets of N draws from V share >= d tokens with probability >= 1 - delta.
    """
    return corollary1_samples(d, D, V, 1.0 / V, delta)


def guaranteed_common_size(N: int, D: int, V: int, delta: float = 0.05) -> int:
    """Largest d with d + sqrt(2 d ln(1/delta)) + 2 ln(1/delta) <= mu(N) (Theorem 1, uniform over V).

    Solved as a quadratic in sqrt(d); 0 when even d = 1 is not guaranteed.
    """
    mu, L = float(mu_uniform(N, D, V)), math.log(1 / delta)
    disc = 4 * mu - 6 * L
    if disc <= 0:
        return 0
    d = int(((math.sqrt(disc) - math.sqrt(2 * L)) / 2) ** 2)
    while d > 0 and required_mean(d, delta) > mu:
        d -= 1
    return d


def _log_mean_lower(N: float, D: int, V_sub: int, t: float) -> float:
    """log of |V'| (1 - (1 - t)^N)^D, the lower bound on mu' in Corollary 1's proof."""
    return math.log(V_sub) + D * float(_log1mexp(N * math.log1p(-t)))


def _smallest_integer(n_star: float, holds: Callable[[int], bool]) -> int:
    """ceil(n_star), corrected by one step either way where rounding put it off the exact condition."""
    n = max(1, math.ceil(n_star))
    if not holds(n):
        return n + 1
    return n - 1 if n > 1 and holds(n - 1) else n


def mu_uniform(N: float | np.ndarray, D: int, V: int) -> np.ndarray:
    """Eq. mu-uniform: E|C| = |V| (1 - (1 - 1/|V|)^N)^D for D uniform subsets of N draws."""
    return np.exp(math.log(V) + D * _log1mexp(np.asarray(N, dtype=np.float64) * math.log1p(-1.0 / V)))


def _log_miss_chunks(logp: np.ndarray, cols: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """log(1 - p_q^(i)) = log1p(-exp(log p)) in float64 row chunks of about 32 MiB (optionally some columns).

    Near p = 1 the absolute error in log(1 - p) is ~1e-16 / (1 - p): negligible, since such tokens
    are then present with probability 1 - (1 - p)^N ~ 1.
    """
    n_cols = logp.shape[1] if cols is None else len(cols)
    step = max(1, _CHUNK_BYTES // (8 * max(n_cols, 1)))
    for r0 in range(0, logp.shape[0], step):
        block = logp[r0 : r0 + step]
        block = block if cols is None else block[:, cols]
        yield np.log1p(-np.exp(np.minimum(block, 0.0, dtype=np.float64)))


def _log_presence(log_miss_chunks: Iterable[np.ndarray], N: np.ndarray, n_cols: int) -> np.ndarray:
    """S[k, i] = sum_q log(1 - (1 - p_q^(i))^{N_k}) = log prod_q P(v_i in T_q), at each N_k.

    Each term is log(-expm1(N log(1 - p))): absolute error ~1e-16, which is what a sum of logs needs.
    """
    S = np.zeros((len(N), n_cols))
    for log_miss in log_miss_chunks:
        term = np.empty_like(log_miss)
        for k, n in enumerate(N):
            np.multiply(log_miss, n, out=term)
            np.expm1(term, out=term)
            np.negative(term, out=term)
            with np.errstate(divide="ignore"):
                np.log(term, out=term)
            S[k] += term.sum(axis=0)
    return S


def _check_logp(logp: np.ndarray) -> np.ndarray:
    logp = np.asarray(logp)
    if logp.ndim != 2 or logp.size == 0:
        raise NVError(f"log-probabilities must be a non-empty D x |V| matrix, got shape {logp.shape}")
    return logp


def log_expected_common_size(logp: np.ndarray, N: float | np.ndarray) -> np.ndarray:
    """log mu(N), mu(N) = sum_i prod_q (1 - (1 - p_q^(i))^N) (§5.2; Step 1 of the proof of Theorem 1).

    ``logp`` is the D x |V| matrix of log p_q^(i) (float32 is fine; -inf for impossible tokens);
    ``N`` a scalar or 1-D array of sample counts, all evaluated in one pass over the rows.
    """
    logp = _check_logp(logp)
    flat = np.ravel(np.asarray(N, dtype=np.float64))
    if np.any(flat <= 0):
        raise NVError("sample counts N must be positive")
    log_mu = special.logsumexp(_log_presence(_log_miss_chunks(logp), flat, logp.shape[1]), axis=1)
    return log_mu.reshape(np.shape(N)) if np.ndim(N) else float(log_mu[0])


def expected_common_size(logp: np.ndarray, N: float | np.ndarray) -> np.ndarray:
    """mu(N), the expected strict common-set size; see ``log_expected_common_size``."""
    return np.exp(log_expected_common_size(logp, N))


def expected_samples(logp: np.ndarray, d: float | np.ndarray, integer: bool = False) -> np.ndarray:
    """Expected N of Fig. expected-N-vs-D: the root of mu(N) = d (real), or smallest integer N with mu(N) >= d.

    Bisection (Brent) on log N, bracketed by the per-token floors pmin_i = min_q p_q^(i):
    sum_i (1-(1-pmin_i)^N)^D <= mu(N) <= sum_i (1-(1-pmin_i)^N). Tokens whose presence probability
    at the upper bracket is below 1e-12 d/|V| are dropped before the search. ``d`` may be an array.
    Cost: about 15 passes over the matrix per target, over the kept columns' cached log(1 - p)
    when that fits in 256 MiB.
    """
    logp = _check_logp(logp)
    log_pmin = np.asarray(logp.min(axis=0), dtype=np.float64)
    n_support = int(np.count_nonzero(np.isfinite(log_pmin)))
    targets = np.atleast_1d(np.asarray(d, dtype=np.float64))
    if np.any(targets <= 0) or np.any(targets >= n_support):
        raise NVError(f"targets d must lie in (0, {n_support}), the number of tokens possible under every prompt")
    out = np.array([_solve_mu(logp, log_pmin, t, integer) for t in targets])
    return out.reshape(np.shape(d)) if np.ndim(d) else out[0]


def _solve_mu(logp: np.ndarray, log_pmin: np.ndarray, d: float, integer: bool) -> float:
    D = logp.shape[0]
    log_miss_min = _log1mexp(np.minimum(log_pmin, 0.0))

    def log_upper(x: float) -> float:
        return special.logsumexp(_log1mexp(math.exp(x) * log_miss_min)) - math.log(d)

    def log_lower(x: float) -> float:
        return special.logsumexp(D * _log1mexp(math.exp(x) * log_miss_min)) - math.log(d)

    x_lo = _bracket_root(log_upper, -30.0, 1.0)
    x_hi = _bracket_root(log_lower, x_lo, x_lo + 1.0)
    S_hi = _log_presence(_log_miss_chunks(logp), np.array([math.exp(x_hi)]), logp.shape[1])[0]
    cols = np.flatnonzero(S_hi >= math.log(_PRUNE_EPS * d / logp.shape[1]))
    cached = list(_log_miss_chunks(logp, cols)) if D * len(cols) * 8 <= _CACHE_BYTES else None

    def log_exact(x: float) -> float:
        source = cached if cached is not None else _log_miss_chunks(logp, cols)
        return special.logsumexp(_log_presence(source, np.array([math.exp(x)]), len(cols))[0]) - math.log(d)

    n_real = math.exp(_bracket_root(log_exact, x_lo, x_hi + 1e-9))
    if not integer:
        return n_real
    return float(_smallest_integer(n_real, lambda n: log_exact(math.log(n)) >= 0.0))


def _bracket_root(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Root in x = log N of an increasing f: Brent on [lo, hi] after widening hi until f(hi) >= 0."""
    while f(hi) < 0.0:
        lo, hi = hi, hi + max(1.0, hi - lo)
        if hi > 700.0:
            raise NVError("no finite N reaches the target common-set size")
    if f(lo) >= 0.0:
        return lo
    return optimize.brentq(f, lo, hi, xtol=1e-13, rtol=1e-13)


def tflat_samples(logp: np.ndarray, d: float, delta: float = 0.05) -> tuple[int, int, float]:
    """Corollary 1 applied to measured distributions: (N, |V'|, t) minimising the bound over V'.

    Our choice (the paper does not say how V' is picked): V' = the k tokens with the largest floor
    min_q p_q^(i), t = the k-th largest floor, and k ranges over all sizes with m < k.
    """
    logp = _check_logp(logp)
    m = required_mean(d, delta)
    floors = np.sort(np.asarray(logp.min(axis=0), dtype=np.float64))[::-1]
    k = np.arange(1, len(floors) + 1)
    ok = (k > m) & np.isfinite(floors)
    if not np.any(ok):
        raise NVError(f"d={d} unreachable: fewer than {m:.1f} tokens are possible under every prompt")
    k, log_t = k[ok], floors[ok]
    D = logp.shape[0]
    bound = _log1mexp(np.log(m / k) / D) / _log1mexp(log_t)  # ln(1 - t) = log1mexp(log t)
    best = int(np.argmin(bound))
    t = math.exp(log_t[best])
    return corollary1_samples(d, D, int(k[best]), t, delta), int(k[best]), t


class EmpiricalN(NamedTuple):
    """Empirical 95% N of the pruned common set (§5.2): ``n95`` = mean + 1.645 sd of ``per_run``."""

    n95: float
    mean: float
    sd: float
    per_run: np.ndarray


def empirical_samples(
    logp: np.ndarray,
    d: int,
    grid: np.ndarray,
    runs: int = 40,
    seed: int = 0,
    prune: Callable[[sparse.csr_matrix], Any] | None = None,
) -> EmpiricalN:
    """Empirical 95% N of the greedy-pruned common set (§5.2, Fig. expected-N-vs-D; 40 runs in the paper).

    Each run draws nested multinomial samples per prompt (Generator seeded from ``seed``) at the
    increasing sample counts ``grid`` and returns the smallest grid N whose pruned common set has
    >= d columns (bisection over the grid, assuming the size grows with N). ``prune`` maps the
    D x |V| csr observation mask to an object with ``.rows`` and ``.cols``; default
    ``nv.phase1.prune.greedy_prune``. The summary is mean + 1.645 sd (ddof=1) over the runs.
    """
    logp = _check_logp(logp)
    grid = np.asarray(grid, dtype=np.int64)
    if grid.ndim != 1 or grid.size == 0 or grid[0] < 1 or np.any(np.diff(grid) <= 0):
        raise NVError("grid must be a non-empty strictly increasing array of positive sample counts")
    if runs < 2:
        raise NVError(f"need at least 2 runs for a standard deviation, got {runs}")
    if prune is None:
        from nv.phase1.prune import greedy_prune as prune
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(runs)]
    per_run = np.array([grid[_first_level(logp, d, grid, rng, prune)] for rng in rngs], dtype=np.float64)
    mean, sd = float(per_run.mean()), float(per_run.std(ddof=1))
    return EmpiricalN(mean + 1.645 * sd, mean, sd, per_run)


def empirical_around(
    logp: np.ndarray, d: int, n_expected: float, n_bound: float, grid_points: int, runs: int = 40, seed: int = 0
) -> tuple[EmpiricalN, float]:
    """``empirical_samples`` on a grid placed from the theory (Fig. expected-N-vs-D), and the grid's resolution.

    The grid is ``grid_points`` geometric levels on [n_expected / 5, 1.2 n_expected] plus a safety level at
    2 n_bound (Corollary 1's N): the pruned common set contains the strict one, so each run's N is at most the
    strict N (~ n_expected); the floor is lowered tenfold while some run already reaches d there. The
    resolution is the largest ratio between a run's level and the level below it (1 at the grid's floor).
    """
    lo = n_expected / 5
    while True:
        grid = np.unique(np.r_[np.geomspace(lo, 1.2 * n_expected, grid_points), 2 * n_bound].astype(np.int64))
        emp = empirical_samples(logp, d, grid, runs=runs, seed=seed)
        if emp.per_run.min() > grid[0] or grid[0] == 1:
            level = np.searchsorted(grid, emp.per_run)
            return emp, float(max(grid[k] / grid[k - 1] if k else 1.0 for k in level))
        lo = max(1.0, lo / 10)


def _first_seen(logp: np.ndarray, grid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Index of the first grid level at which each (prompt, token) is drawn (len(grid) if never)."""
    first = np.full(logp.shape, len(grid), dtype=np.min_scalar_type(len(grid)))
    step = max(1, _CHUNK_BYTES // (8 * logp.shape[1]))
    for r0 in range(0, logp.shape[0], step):
        p = np.exp(np.asarray(logp[r0 : r0 + step], dtype=np.float64))
        p /= p.sum(axis=1, keepdims=True)
        block = first[r0 : r0 + step]
        for level, n_new in enumerate(np.diff(grid, prepend=0)):
            block[(rng.multinomial(n_new, p) > 0) & (block > level)] = level
    return first


def _first_level(logp: np.ndarray, d: int, grid: np.ndarray, rng: np.random.Generator, prune: Callable) -> int:
    """Smallest grid level whose pruned common set has >= d tokens, by bisection."""
    first = _first_seen(logp, grid, rng)

    def big_enough(level: int) -> bool:
        return len(prune(sparse.csr_matrix(first <= level)).cols) >= d

    lo, hi = 0, len(grid) - 1
    if not big_enough(hi):
        raise NVError(f"pruned common set stays below d={d} at the largest grid N={grid[-1]}")
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if big_enough(mid) else (mid + 1, hi)
    return lo


def figure_tables(logp: np.ndarray, D_values: Iterable[int], d_values: Iterable[int], delta: float, grid_points: int,
                  runs: int, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Fig. expected-N-vs-D's data from the white-box log-probs ``logp`` (the first D prompts for each D): per (D, d),
    d on 12 geometric steps across ``d_values`` and those themselves, Theorem 1's expected N (``expected_samples``)
    and Corollary 1's bound (``tflat_samples``); at each d of ``d_values`` the empirical 95 % N over ``runs`` runs
    (``empirical_around``) and each run's N. Rows of the theory, of the empirical summary, of the runs."""
    d_values = list(d_values)
    d_theory = np.unique(np.r_[np.geomspace(min(d_values), max(d_values), 12).round(), d_values])
    theory, rows, per_run = [], [], []
    for D in sorted(D_values):
        lp = logp[:D]
        for d, n_exp in zip(d_theory, expected_samples(lp, d_theory)):
            n_bound, V_sub, t = tflat_samples(lp, d, delta)
            theory.append({"D": D, "d": int(d), "expected_N": n_exp, "bound_N": n_bound, "bound_V_sub": V_sub, "bound_t": t})
            if d in d_values:
                emp, step = empirical_around(lp, int(d), n_exp, n_bound, grid_points, runs, seed)
                rows.append({"D": D, "d": int(d), "n95": emp.n95, "mean": emp.mean, "sd": emp.sd, "runs": runs,
                             "grid_step": step, "expected_N": n_exp, "bound_N": n_bound})
                per_run += [{"D": D, "d": int(d), "run": r, "N": int(n)} for r, n in enumerate(emp.per_run)]
    return theory, rows, per_run
