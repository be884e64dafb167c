"""The exact multinomial sampler (both paths) against its law, on synthetic distributions."""

import numpy as np
import pytest
from scipy import stats

from nv.errors import NVError
from nv.oracle.multinomial import multinomial_counts


@pytest.mark.parametrize("n", [500, 50_000, 10**6])
def test_counts_sum_to_n_and_fit_the_law(n):
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(100, 1.0))
    counts = multinomial_counts(np.random.default_rng(11), n, p)
    assert counts.sum() == n and counts.dtype.kind == "i" and (counts >= 0).all()
    big = p * n >= 20
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big] * n, p[~big].sum() * n)
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_pooled_counts_over_repeats_have_multinomial_variance():
    """Poisson top-up must not inflate the variance: Var(X_i) = n p_i (1 - p_i)."""
    p = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(5)
    draws = np.array([multinomial_counts(rng, 20_000, p) for _ in range(2000)])
    var = draws.var(axis=0, ddof=1)
    expected = 20_000 * p * (1 - p)
    assert np.all(np.abs(var / expected - 1) < 0.15)
    assert np.all(draws.sum(axis=1) == 20_000)


def test_n_below_one_is_refused():
    with pytest.raises(NVError, match="N must be >= 1"):
        multinomial_counts(np.random.default_rng(0), 0, np.ones(3) / 3)
