"""Sample complexity (nv.theory.sample_complexity) against Monte-Carlo simulation of random subsets, and stability at scale."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from nv.errors import NVError
from nv.theory.sample_complexity import (
    corollary1_samples,
    empirical_around,
    empirical_samples,
    expected_common_size,
    expected_samples,
    log_expected_common_size,
    mu_uniform,
    required_mean,
    tflat_samples,
    theorem1_samples,
)


def _common_sizes(rng, p, N, trials):
    """Strict common-set sizes of ``trials`` simulations: N multinomial draws per prompt (rows of p)."""
    present = np.ones((trials, p.shape[1]), dtype=bool)
    for p_q in p:
        present &= rng.multinomial(N, p_q, size=trials) > 0
    return present.sum(axis=1)


def _dirichlet(rng, D, V, conc=1.0):
    return rng.dirichlet(np.full(V, conc), size=D)


def _strict(mask):
    """Strict intersection as a stand-in for greedy pruning: all rows, the fully observed columns."""
    return SimpleNamespace(rows=np.arange(mask.shape[0]), cols=np.flatnonzero(mask.sum(axis=0).A1 == mask.shape[0]))


def _drop_one(mask):
    """A crude pruning: keep the columns observed in all but at most one prompt."""
    return SimpleNamespace(rows=np.arange(mask.shape[0]), cols=np.flatnonzero(mask.sum(axis=0).A1 >= mask.shape[0] - 1))


@pytest.mark.parametrize("V,D,d", [(200, 5, 20), (100, 20, 10), (500, 3, 100)])
def test_theorem1_holds_in_95_percent(V, D, d):
    N = theorem1_samples(d, D, V, delta=0.05)
    m = required_mean(d, 0.05)
    assert mu_uniform(N, D, V) >= m > mu_uniform(N - 1, D, V)  # smallest integer satisfying Step 4
    sizes = _common_sizes(np.random.default_rng(V + D), np.full((D, V), 1 / V), N, 2000)
    assert np.mean(sizes >= d) >= 0.95


def test_corollary1_holds_for_t_flat_dirichlet():
    rng = np.random.default_rng(5)
    V, V_sub, D, d, t = 200, 60, 6, 15, 0.01
    p = (1 - V_sub * t) * _dirichlet(rng, D, V, 0.5)
    p[:, :V_sub] += t  # t-flat over V' = the first 60 tokens
    N = corollary1_samples(d, D, V_sub, t)
    assert np.mean(_common_sizes(rng, p, N, 2000) >= d) >= 0.95
    # The best (V', t) over the measured floors is at least as good, and still a valid guarantee.
    n_best, k, t_best = tflat_samples(np.log(p).astype(np.float32), d)
    assert n_best <= N and k * t_best <= 1 + 1e-6
    assert np.mean(_common_sizes(rng, p, n_best, 2000) >= d) >= 0.95


@pytest.mark.parametrize("kind", ["uniform", "dirichlet"])
def test_mu_matches_simulation(kind):
    rng = np.random.default_rng(6)
    V, D, trials = 120, 4, 4000
    p = np.full((D, V), 1 / V) if kind == "uniform" else _dirichlet(rng, D, V, 2.0)
    logp = np.log(p).astype(np.float32)
    for N in (60, 150, 400):
        sizes = _common_sizes(rng, p, N, trials)
        mu = expected_common_size(logp, N)
        assert abs(sizes.mean() - mu) <= 4 * sizes.std(ddof=1) / math.sqrt(trials) + 1e-9
    np.testing.assert_allclose(expected_common_size(logp, [60, 150]), [expected_common_size(logp, 60), expected_common_size(logp, 150)])
    if kind == "uniform":
        np.testing.assert_allclose(expected_common_size(logp, 150), mu_uniform(150, D, V), rtol=1e-5)


def test_expected_samples_inverts_mu():
    rng = np.random.default_rng(7)
    V, D = 300, 8
    uniform = np.full((D, V), -math.log(V), dtype=np.float32)
    closed = [math.log(1 - (d / V) ** (1 / D)) / math.log1p(-1 / V) for d in (10, 100)]
    np.testing.assert_allclose(expected_samples(uniform, np.array([10, 100])), closed, rtol=1e-5)
    logp = np.log(_dirichlet(rng, D, V, 3.0)).astype(np.float32)
    targets = np.array([5.0, 50.0, 200.0])
    n_real = expected_samples(logp, targets)
    np.testing.assert_allclose(expected_common_size(logp, n_real), targets, rtol=1e-8)
    assert np.all(np.diff(n_real) > 0)
    for d, n in zip(targets, expected_samples(logp, targets, integer=True)):
        assert expected_common_size(logp, n) >= d > expected_common_size(logp, n - 1)
    # Corollary 1's guarantee needs mu(N) >= m > d, so its N is never below the expected N.
    assert tflat_samples(logp, 50.0)[0] >= n_real[1]
    with pytest.raises(NVError, match=r"targets d must lie in \(0, 300\)"):
        expected_samples(logp, V)


def test_theorem1_stable_at_scale():
    V, D = 262_144, 20_000
    by_d = [theorem1_samples(d, D, V) for d in (128, 1024, 4096, 16384, 65536)]
    by_D = [theorem1_samples(4096, D_, V) for D_ in (10, 1000, 5000, 20_000)]
    assert all(np.isfinite(by_d)) and np.all(np.diff(by_d) > 0) and np.all(np.diff(by_D) > 0)
    assert theorem1_samples(4096, D, V, delta=1e-6) > by_d[2]
    assert by_d[2] <= V * math.log1p(D)  # App. F: N* <= |V| ln(1 + D) when m <= |V|/e
    assert mu_uniform(by_d[2], D, V) >= required_mean(4096, 0.05)
    mu = mu_uniform(np.array([1.0, 1e5, 1e7]), D, V)
    assert np.all(np.isfinite(mu)) and mu[2] == pytest.approx(V) and np.all(np.diff(mu) >= 0)


def test_mu_stable_at_scale():
    rng = np.random.default_rng(8)
    V, D = 262_144, 20  # two row chunks of 16 prompts
    logp = np.log(_dirichlet(rng, D, V, 50.0)).astype(np.float32)
    log_mu = log_expected_common_size(logp, np.array([1.0, 1e4, 1e6, 1e7]))
    assert np.all(np.isfinite(log_mu)) and np.all(np.diff(log_mu) > 0)
    assert np.exp(log_mu[-1]) == pytest.approx(V, rel=1e-3)
    n = expected_samples(logp, np.array([1024.0, 4096.0]))
    assert np.all(np.isfinite(n)) and n[0] < n[1]
    np.testing.assert_allclose(expected_common_size(logp, n), [1024, 4096], rtol=1e-8)


def test_empirical_samples_with_injected_pruning():
    rng = np.random.default_rng(9)
    V, D, d = 80, 4, 12
    logp = np.log(_dirichlet(rng, D, V, 5.0)).astype(np.float32)
    grid = np.unique(np.round(np.geomspace(1, 3000, 150))).astype(int)
    strict = empirical_samples(logp, d, grid, runs=40, seed=1, prune=_strict)
    assert strict.n95 == pytest.approx(strict.mean + 1.645 * strict.sd) and len(strict.per_run) == 40
    assert strict.mean == pytest.approx(expected_samples(logp, d), rel=0.15)
    assert strict.n95 <= tflat_samples(logp, d)[0]
    assert empirical_samples(logp, d, grid, runs=40, seed=1, prune=_strict).per_run.tolist() == strict.per_run.tolist()
    assert empirical_samples(logp, d, grid, runs=40, seed=1, prune=_drop_one).n95 < strict.n95
    with pytest.raises(NVError, match="pruned common set stays below d=12 at the largest grid N=3"):
        empirical_samples(logp, d, grid[:3], runs=5, prune=_strict)


def test_empirical_around_places_its_grid_from_the_theory():
    rng = np.random.default_rng(9)
    d = 12
    logp = np.log(_dirichlet(rng, 4, 80, 5.0)).astype(np.float32)
    n_exp, n_bound = float(expected_samples(logp, d)), tflat_samples(logp, d)[0]
    emp, step = empirical_around(logp, d, n_exp, n_bound, grid_points=10, runs=10, seed=1)
    assert n_exp / 5 < emp.per_run.min() and emp.per_run.max() <= max(1.2 * n_exp, 2 * n_bound)
    assert 1 < step < 1.5  # ten levels over a 6x range: ~1.22 apart, coarser where N is small and rounded
    # a theory 50x too high: every run reaches d at the first floor (10 n_exp), so the floor comes down tenfold
    # until no run does, and the runs land where they did on the right grid (within its resolution)
    high, _ = empirical_around(logp, d, 50 * n_exp, n_bound, grid_points=10, runs=10, seed=1)
    assert high.per_run.min() < 10 * n_exp and abs(np.log(high.mean / emp.mean)) < np.log(3)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: theorem1_samples(10, 5, 100, delta=1.0), r"delta must be in \(0, 1\), got 1.0"),
        (lambda: theorem1_samples(10, 5, 100, delta=0.0), r"delta must be in \(0, 1\), got 0.0"),
        (lambda: theorem1_samples(200, 5, 100), r"d=200 unreachable: .* >= \|V'\| = 100"),
        (lambda: theorem1_samples(-1, 5, 100), "target common-set size d must be positive, got -1"),
        (lambda: corollary1_samples(10, 5, 50, t=0.05), r"flatness t must be in \(0, 1\) with t \|V'\| <= 1, got t=0.05"),
        (lambda: expected_common_size(np.zeros(3), 10), r"non-empty D x \|V\| matrix, got shape \(3,\)"),
    ],
)
def test_bad_input_raises(call, message):
    with pytest.raises(NVError, match=message):
        call()
