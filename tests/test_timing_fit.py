"""Phase 2 fitting (nv.phase2.fit) on synthetic Eq. 2 timings and the paper's App. D / Eq. 3 numbers."""

import numpy as np
import pytest
from scipy import optimize, stats

from nv.errors import NVError
from nv.params import check_timing_protocol
from nv.phase2.fit import (
    Timings,
    attention_regime,
    crossover_length,
    depth_basic,
    depth_basic_t,
    depths,
    fit_gamma,
    fit_scaling,
    infer_depth,
    platform_fits,
    prefill_times,
    relative_error,
    scaling_relation,
    sweep_lengths,
    t_statistic,
    trim_cut,
    total_params,
    trimmed_stats,
    weighted_line,
)
from nv.phase2.live import _sweep, timing_cost

BETA, ALPHA = 2.3e-15, 0.04  # seconds per unit of L ell^2 d, seconds
MODELS = [(16, 2048), (24, 3072), (28, 3584), (32, 4096), (40, 5120)]  # (L, d)


def _platform(models, scale, alpha, rng=None, rel_noise=0.0):
    """Flat timings of ``models`` on a platform whose beta is ``scale * BETA`` (Eq. 9 with k = scale)."""
    ell, L, d = [], [], []
    for L_i, d_i in models:
        lengths = attention_regime(*(3 * [sweep_lengths(d_i, 0.25 * d_i, 3.5 * d_i, 32768).astype(float)]))[0]
        ell.append(lengths)
        L.append(np.full(len(lengths), L_i))
        d.append(np.full(len(lengths), d_i))
    ell, L, d = map(np.concatenate, (ell, L, d))
    T = scaling_relation(scale * BETA, alpha, L, d, ell)
    # Noise proportional to the prefill term, so both platforms weight their points alike.
    sigma = np.maximum(rel_noise, 1e-6) * (T - alpha)
    if rng is not None:
        T = T + rng.normal(0.0, sigma)
    return Timings(ell, T, sigma, d, L)


def test_sweep_llama31_8b():
    # Llama-3.1-8B: d=4096, 32 q / 8 kv heads -> d_kv=1024, d_ffn=14336, p_max=131072.
    assert crossover_length(4096, 1024, 14336) == 15974  # floor((4096 + 1024 + 21504) * 0.6)
    ell = sweep_lengths(4096, 1024, 14336, 131072)
    # ell_cap = min(max(31948, 16384), 130872) = 31948; ell_hi = min(47922, 31948) = 31948.
    expected = np.unique(np.append(np.rint(np.linspace(7987, 31948, 24)), 15974)).astype(int)
    assert len(ell) == 25 and ell[0] == 7987 and ell[-1] == 31948 and 15974 in ell
    np.testing.assert_array_equal(ell, expected)
    # a target of unknown shape: d_hat with the default ratios n_kv/n_heads = 1/4, d_ffn/d = 3.5 (= 14336 here)
    np.testing.assert_array_equal(sweep_lengths(4096, 0.25 * 4096, 3.5 * 4096, 131072), ell)


def test_sweep_cap_and_errors():
    ell = sweep_lengths(4096, 1024, 14336, 20000)  # ell_cap = p_max - 200 = 19800
    assert ell[0] == 7987 and ell[-1] == 19800 and len(ell) == 25
    small = sweep_lengths(576, 192, 1536, 8192)  # SmolLM2-135M: ell* = 1843, ell_cap = max(3686, 2304)
    assert crossover_length(576, 192, 1536) == 1843 and small[0] == 922 and small[-1] == 3686
    with pytest.raises(NVError, match="p_max=4096 leaves no room for a sweep starting at 0.5 ell\\* = 7987"):
        sweep_lengths(4096, 1024, 14336, 4096)
    with pytest.raises(NVError, match="d, d_kv, d_ffn and r must be positive, got -1, 1024, 14336, 0.6"):
        crossover_length(-1, 1024, 14336)
    # a context just above 0.5 ell*: [7987, 7992] rounds 24 lengths to 6, fewer than App. D's fit (12 discarded + 2);
    # it was timed (703 paid requests at d_hat = 4096) and failed in the fit after
    assert len(sweep_lengths(4096, 1024, 14336, 8192, fit=6)) == 6
    with pytest.raises(NVError, match=r"p_max=8192 leaves 6 distinct sweep lengths in \[7987, 7992\] .* fewer than the fit's 14"):
        sweep_lengths(4096, 1024, 14336, 8192, fit=14)
    cal = {"r": 0.6, "trials": 100, "warmups": 3, "trim": 0.1, "n_lengths": 24, "discard": 12, "kv_ratio": 0.25,
           "ffn_ratio": 3.5}
    cost = timing_cost(cal, 4000, 8192)
    assert cost["requests"] == 3 + 100 * 25  # 24 lengths and the ell = 1 baseline
    # the budget keeps the last call's reservation beside the bill: twice the longest prompt, as HTTPOracle reserves a
    # prompt it has not seen (held to the bill alone, a cap of exactly the plan stopped phase 2 a few calls short)
    longest = int(_sweep(cal, 4000, 8192).max())
    assert cost["tokens_billed"] == 3 * longest + 100 * (int(_sweep(cal, 4000, 8192).sum()) + 1) + cost["requests"]
    assert cost["tokens_held"] == cost["tokens_billed"] + 2 * longest
    with pytest.raises(NVError, match=r"phase 2 cannot sweep d_hat = 4096 under --context-length 8192 \(.*give the"):
        timing_cost(cal, 4096, 8192)  # the plan's check (--timing-d-hat), before phase 1 is paid


def test_trimmed_stats_and_baseline():
    rng = np.random.default_rng(1)
    trials = rng.normal(1.0, 0.1, size=(3, 100))
    trials[:, :5] = 50.0  # outliers inside the 10% cut
    mean, sigma = trimmed_stats(trials)
    np.testing.assert_allclose(mean, stats.trim_mean(trials, 0.1, axis=1))
    kept = np.sort(trials, axis=1)[:, 10:90]
    np.testing.assert_allclose(sigma, kept.std(axis=1, ddof=1) / np.sqrt(80))
    T, sigma_T = prefill_times(trials, np.full(100, 0.25))
    np.testing.assert_allclose(T, mean - 0.25)
    np.testing.assert_allclose(sigma_T, sigma)
    with pytest.raises(NVError, match="trim=0.4 on 3 trials leaves fewer than 2 kept trials"):
        trimmed_stats(np.ones(3), trim=0.4)
    # ... found by a calibration's check before phase 1 pays, not by the fit after phase 2 has
    protocol = {"r": 0.6, "trials": 3, "warmups": 3, "trim": 0.4, "n_lengths": 24, "discard": 12, "kv_ratio": 0.25,
                "ffn_ratio": 3.5}
    with pytest.raises(NVError, match="cal.json: 'timing.trim' = 0.4 on trials = 3 keeps fewer than 2 trials"):
        check_timing_protocol(protocol, "cal.json")
    check_timing_protocol(protocol | {"trials": 4, "trim": 0.25}, "cal.json")  # cuts 1 of 4 at each end: 2 kept
    assert trim_cut(0.35, 180) == 63 and trim_cut(0.1, 100) == 10  # 0.35 x 180 is 62.999... in binary


def test_attention_regime_discards_shortest():
    ell = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    kept = attention_regime(ell, ell * 10, ell, n_discard=2)
    np.testing.assert_array_equal(kept[0], [3.0, 4.0, 5.0])
    np.testing.assert_array_equal(kept[1], [30.0, 40.0, 50.0])
    with pytest.raises(NVError, match="cannot discard 4 of 5 points and still fit a line"):
        attention_regime(ell, ell, ell, n_discard=4)


def test_weighted_line_matches_known_covariance():
    rng = np.random.default_rng(2)
    x = np.linspace(0, 10, 30)
    sigma = rng.uniform(0.5, 2.0, 30)
    y = 3.0 * x - 1.0 + rng.normal(0, sigma)
    fit = weighted_line(x, y, sigma)
    coef, cov = optimize.curve_fit(lambda x, a, b: a * x + b, x, y, sigma=sigma)
    np.testing.assert_allclose([fit.slope, fit.intercept], coef, rtol=1e-6)
    np.testing.assert_allclose([fit.slope_se, fit.intercept_se], np.sqrt(np.diag(cov)), rtol=1e-5)


def test_fit_scaling_exact_and_noisy():
    exact = _platform(MODELS, 1.0, ALPHA)
    fit = fit_scaling(exact.L, exact.d, exact.ell, exact.T, exact.sigma)
    assert fit.slope == pytest.approx(BETA, rel=1e-10) and fit.intercept == pytest.approx(ALPHA, rel=1e-8)
    noisy = _platform(MODELS, 1.0, ALPHA, np.random.default_rng(3), rel_noise=1e-3)
    fit = fit_scaling(noisy.L, noisy.d, noisy.ell, noisy.T, noisy.sigma)
    assert abs(fit.slope - BETA) < 4 * fit.slope_se and fit.slope == pytest.approx(BETA, rel=2e-3)
    assert abs(fit.intercept - ALPHA) < 4 * fit.intercept_se


def test_same_platform_depth():
    ref = _platform(MODELS, 1.0, ALPHA)
    target = _platform([(36, 4096)], 1.0, ALPHA)
    beta = fit_scaling(ref.L, ref.d, ref.ell, ref.T, ref.sigma).slope
    gamma_g = fit_gamma(target.d, target.ell, target.T, target.sigma).slope
    assert infer_depth(gamma_g, beta) == pytest.approx(36, rel=1e-9)
    assert depth_basic(beta, ALPHA, 4096, target.ell, target.T, target.sigma) == pytest.approx(36, rel=1e-9)


def test_basic_depth_t_statistic_is_curve_fits_with_the_residual_scaled_error():
    """depth_basic_t = L_hat / se with se as scipy's curve_fit gives it for the one-parameter model
    T - alpha = L (beta ell^2 d_hat), weights 1/sigma^2, absolute_sigma=False; timings with no depth in them (the
    intercept alone, plus noise) give |t| well under 2."""
    rng = np.random.default_rng(5)
    target = _platform([(36, 4096)], 1.0, ALPHA, rng, rel_noise=0.05)
    x = BETA * target.ell**2 * 4096
    (L,), cov = optimize.curve_fit(lambda x, L: L * x, x, target.T - ALPHA, sigma=target.sigma, absolute_sigma=False)
    t = depth_basic_t(BETA, ALPHA, 4096, target.ell, target.T, target.sigma)
    assert L == pytest.approx(depth_basic(BETA, ALPHA, 4096, target.ell, target.T, target.sigma), rel=1e-9)
    assert t == pytest.approx(L / np.sqrt(cov[0, 0]), rel=1e-6) and t > 20
    flat = ALPHA + rng.normal(0.0, 1e-3, len(target.ell))
    assert abs(depth_basic_t(BETA, ALPHA, 4096, target.ell, flat, np.full(len(flat), 1e-3))) < 2
    # an exact fit (noise-free or quantised timings: se = 0) is infinitely significant, not a ZeroDivisionError
    exact = _platform([(36, 4096)], 1.0, ALPHA)
    assert depth_basic_t(BETA, ALPHA, 4096, exact.ell, exact.T, exact.sigma) > 1e6
    assert t_statistic(3.0, 0.0) == np.inf and np.isnan(t_statistic(0.0, 0.0))


@pytest.mark.parametrize("noise", [0.0, 1e-3])
def test_cross_platform_transfer_recovers_depth(noise):
    rng = np.random.default_rng(4)
    scale = 2.7  # target platform 2.7x slower, with its own offset
    ref = _platform(MODELS, 1.0, ALPHA, rng if noise else None, noise)
    tgt = _platform(MODELS, scale, 0.11, rng if noise else None, noise)
    target = _platform([(36, 4096)], scale, 0.11, rng if noise else None, noise)
    est = platform_fits(ref, tgt, Timings(target.ell, target.T, target.sigma, target.d))
    assert est.k == pytest.approx(scale, rel=10 * noise + 1e-9)
    assert est.reference.slope == pytest.approx(BETA, rel=10 * noise + 1e-9)
    both = depths(est.reference.slope, est.reference.intercept, est.k, 4096, target.ell, target.T, target.sigma,
                  est.gamma_g)
    assert both["eq10"][0] == pytest.approx(36, rel=10 * noise + 1e-9)
    # Eq. 10's two forms agree: gamma_g / (k beta) = gamma_g gamma_ref / (gamma_tgt beta).
    alt = est.gamma_g.slope * est.gamma_ref.slope / (est.gamma_tgt.slope * est.reference.slope)
    assert both["eq10"][0] == pytest.approx(alt, rel=1e-12)
    # Eq. 9 (the basic estimator across platforms) borrows alpha^ref: off by the platforms' offsets, not by k
    expected = 36 + (0.11 - ALPHA) * np.sum(target.sigma**-2 * target.ell**2) / (
        scale * BETA * 4096 * np.sum(target.sigma**-2 * target.ell**4))
    assert both["basic"][0] == pytest.approx(expected, rel=10 * noise + 1e-9)


def test_cross_platform_needs_reference_depths():
    ref = _platform(MODELS, 1.0, ALPHA)
    with pytest.raises(NVError, match="reference timings need the known layer counts L"):
        platform_fits(Timings(ref.ell, ref.T, ref.sigma, ref.d), ref, ref)


def test_total_params_smollm2_135m():
    # SmolLM2-135M: d=576, L=30, V=49152, 9 q / 3 kv heads, d_ffn=1536, tied embeddings.
    kw = dict(kv_ratio=3 / 9, ffn_ratio=1536 / 576)
    assert round(total_params(576, 30, 49152, tied=True, **kw)) == 134_515_008
    assert round(total_params(576, 30, 49152, **kw)) == 134_515_008 + 49152 * 576  # paper default: untied
    # Footnote to Eq. 3: d=4096, L=32 -> norms ~0.3M of ~8B.
    assert total_params(4096, 32, 128256) == pytest.approx(8.03e9, rel=1e-2)
    with pytest.raises(NVError, match="d, L, V and the ratios must be positive, got d=0, L=30, V=49152"):
        total_params(0, 30, 49152)


def test_relative_error():
    assert relative_error(30, 32) == pytest.approx(2 / 32)
    np.testing.assert_allclose(relative_error([36, 28], [32, 32]), [0.125, 0.125])
    with pytest.raises(NVError, match="relative error needs a positive true value theta"):
        relative_error(1.0, 0.0)
