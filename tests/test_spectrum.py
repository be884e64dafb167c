import numpy as np
import pytest

from nv.errors import NVError
from nv.phase1.spectrum import (
    estimate,
    gram_eigenvalues,
    paper,
    paper_from_eigenvalues,
    robust,
    robust_from_singular_values,
    snap,
)


def to_bf16(x):
    """Round to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def logprob_like(rows, cols, r, seed=0, decay=30.0):
    """Row offset ~ -10 +- 1, plus rank r with singular values decaying `decay`-fold, in bf16."""
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.normal(size=(max(rows, r), r)))[0][:rows]
    v = np.linalg.qr(rng.normal(size=(max(cols, r), r)))[0][:cols]
    s = decay ** -(np.arange(r) / (r - 1))
    s *= np.sqrt(rows * cols * 4.0 / np.sum(s**2))  # entries of the low-rank part have std ~2
    return to_bf16((u * s) @ v.T + (-10.0 + rng.normal(size=(rows, 1))))


def with_spectrum(lam, cols, seed=0):
    """A len(lam) x cols matrix whose Gram eigenvalues are exactly lam."""
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.normal(size=(lam.size, lam.size)))[0]
    v = np.linalg.qr(rng.normal(size=(cols, lam.size)))[0]
    return (u * np.sqrt(lam)) @ v.T


SHAPES = {
    "2r+50 x 3r": lambda r: (2 * r + 50, 3 * r),
    "4r x 6r": lambda r: (4 * r, 6 * r),
    "wide": lambda r: (3 * r // 2 + 30, 8 * r),
    "tall": lambda r: (8 * r, 3 * r // 2 + 30),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [20, 64, 150, 300])
def test_robust_recovers_rank_exactly(r, shape):
    Y = logprob_like(*SHAPES[shape](r), r, seed=r)
    est = robust(Y)
    assert (est.method, est.saturated, est.reason) == ("robust", True, "ok")
    assert est.d_hat_raw == r
    assert est.d_hat == snap(r, 64) and est.lower_bound is None


def test_robust_is_scale_and_offset_invariant():
    Y = logprob_like(300, 450, 100, seed=1)
    ref = robust(Y)
    offsets = np.random.default_rng(2).normal(0, 5, size=(Y.shape[0], 1))
    for variant in (0.1 * Y, 100.0 * Y, Y + offsets):
        est = robust(variant)
        assert (est.saturated, est.d_hat_raw, est.d_hat) == (True, ref.d_hat_raw, ref.d_hat) == (True, 100, 128)


@pytest.mark.parametrize("shape", [(40, 60), (120, 80), (300, 300), (400, 1000), (1000, 400)])
def test_robust_pure_noise_is_not_saturated(shape):
    rng = np.random.default_rng(sum(shape))
    for Y in (rng.normal(size=shape), to_bf16(-10 + rng.normal(size=(shape[0], 1)) + 0.3 * rng.normal(size=shape))):
        est = robust(Y)
        assert (est.saturated, est.reason, est.d_hat) == (False, "not saturated", None)
        assert 0 <= est.lower_bound <= 5


@pytest.mark.parametrize("rows", [60, 100, 149])
def test_robust_fewer_rows_than_rank_is_a_lower_bound(rows):
    r = 150
    est = robust(logprob_like(rows, 400, r, seed=rows))
    assert (est.saturated, est.reason, est.d_hat_raw) == (False, "not saturated", None)
    assert 0 < est.lower_bound <= min(rows, r)


def test_robust_blurred_drop_is_a_lower_bound():
    rng = np.random.default_rng(5)
    Y = logprob_like(600, 900, 150, seed=5, decay=100.0) + 0.5 * rng.normal(size=(600, 900))
    est = robust(Y)
    assert not est.saturated and 0 < est.lower_bound <= 150


def test_paper_detector_on_designed_spectrum():
    n, d = 200, 100
    i = np.arange(n)
    lam = np.where(i < d, 10 ** (2 - 2.5 * i / d), 10 ** (-2 - 3 * ((i - d) / (n - d)) ** 3))
    est = paper(with_spectrum(lam, 260))
    assert (est.method, est.saturated, est.reason) == ("paper", True, "ok")
    assert (est.d_hat_raw, est.d_hat, est.g) == (d, 128, 128)
    diag = est.diagnostics
    assert diag["i_sad"] <= d <= diag["i_peak"]
    assert np.all(diag["a"] <= np.pi / 2) and diag["s_tilde"].shape == (n,)
    assert paper_from_eigenvalues(lam, g=1).d_hat == d


def test_paper_reports_missing_landmarks():
    big = paper(100.0 * np.random.default_rng(0).normal(size=(60, 80)))  # every lambda_i > pi
    assert (big.saturated, big.reason, big.d_hat) == (False, "no saddle", None)
    flat = paper_from_eigenvalues(np.full(50, 0.5))
    assert flat.reason == "no saddle"
    i = np.arange(600)
    lam = np.where(i < 300, 10 ** (3 - 3.5 * i / 300), 10 ** (-1.5 - 1.5 * (i - 300) / 300))
    no_peak = paper_from_eigenvalues(lam)  # tail without the final drop-off: s_tilde keeps rising
    assert (no_peak.reason, no_peak.diagnostics["i_peak"]) == ("no peak", None)
    assert no_peak.diagnostics["i_sad"] is not None


def test_the_spectrum_figure_draws_the_detectors_own_thresholds():
    """Panel (c) draws arctan(lam_sad) and arctan(lam_peak) as the detector used them (it drew arctan(pi) and
    arctan(pi/2) whatever they were, also under the inspector's sliders; a review)."""
    from nv.phase1.spectrum import robust
    from nv.plots.phase1 import spectrum_panels

    Y = logprob_like(80, 60, 10)
    fig = spectrum_panels(None, paper(Y, lam_sad=10.0, lam_peak=5.0), robust(Y), None)
    lines = [ln.get_ydata()[0] for ln in fig.axes[2].get_lines() if ln.get_linestyle() in ("--", ":")
             and ln.get_label().startswith("arctan")]
    assert lines == pytest.approx([np.arctan(10.0), np.arctan(5.0)])
    assert [t.get_text() for t in fig.axes[2].get_legend().get_texts()][:2] == [
        "arctan(10): the saddle is sought below it", "arctan(5): the peak is sought below it"]
    default = spectrum_panels(None, paper(Y), robust(Y), None)  # the paper's pi and pi/2 by name
    assert default.axes[2].get_legend().get_texts()[0].get_text() == "arctan(pi): the saddle is sought below it"
    # panel (d) shades the indices whose a_i is above arctan(lam_sad), where Alg. 2 takes no minimum as the saddle
    a = paper(Y).diagnostics["a"]
    for lam_sad, figure in ((np.pi, default), (10.0, fig)):
        (shade,) = [c for c in figure.axes[3].collections if c.get_label().endswith("no saddle sought")]
        x = shade.get_paths()[0].vertices[:, 0]
        assert x.min() == 1 and x.max() == pytest.approx(np.flatnonzero(a > np.arctan(lam_sad)).max() + 1)
    # a common set below 2 x 2 has no spectrum, and its figure still draws (a live run's KeyError after every request
    # was paid; a review of this change)
    from nv.phase1.pipeline import estimate_both

    hyper = {"paper": {"p": 0.54, "g": 128, "w": None, "w_s": None, "lam_sad": 10.0, "lam_peak": 5.0},
             "robust": {"g": 64, "z_min": 8.0, "min_ratio": 1.05}}
    tiny = estimate_both(Y[:1], hyper)
    lines = [ln.get_ydata()[0] for ln in spectrum_panels(None, tiny["paper"], tiny["robust"], None).axes[2].get_lines()
             if ln.get_label().startswith("arctan")]
    assert lines == pytest.approx([np.arctan(10.0), np.arctan(5.0)])


def test_snap():
    assert snap(576, 128) == 640 and snap(576, 64) == 576 and snap(575, 64) == 576
    assert snap(577, 64) == 640 and snap(7, 1) == 7
    with pytest.raises(NVError, match="grid spacing g must be >= 1, got 0"):
        snap(5, 0)


def test_gram_eigenvalues_are_float64():
    rng = np.random.default_rng(0)
    low_rank = rng.normal(size=(300, 10)) @ rng.normal(size=(10, 1000))
    Y = (low_rank - 10.0 + rng.normal(size=(300, 1))).astype(np.float32)
    lam32 = np.linalg.eigvalsh(Y @ Y.T)  # float32 Gram: the ~3e7 top eigenvalue swamps the tail
    assert lam32.min() < -0.1
    lam = gram_eigenvalues(Y)
    assert lam.shape == (300,) and np.all(np.diff(lam) <= 0) and lam.min() >= 0
    assert lam[11:].max() < 1e-6 < 1e3 < lam[10]  # rank 11 (10 + row offset); tail = float32 input rounding


def test_gram_eigenvalues_use_the_smaller_side():
    Y = np.random.default_rng(1).normal(size=(40, 15))
    sv = np.linalg.svd(Y, compute_uv=False)
    np.testing.assert_allclose(gram_eigenvalues(Y), sv**2, rtol=1e-10)
    np.testing.assert_allclose(gram_eigenvalues(Y.T), sv**2, rtol=1e-10)


def test_estimate_dispatch_and_bad_input():
    Y = logprob_like(200, 300, 64)
    assert estimate(Y).method == "robust" and estimate(Y).d_hat_raw == 64
    assert estimate(Y, "paper", p=0.5, g=64).g == 64
    assert estimate(Y, "robust", g=1).d_hat == 64
    with pytest.raises(NVError, match="unknown spectrum method 'elbow'; choose from robust, paper"):
        estimate(Y, "elbow")
    with pytest.raises(NVError, match="NaN or infinite entries; prune it first"):
        robust(np.full((5, 5), np.nan))
    with pytest.raises(NVError, match=r"2-D matrix with at least 2 rows and columns, got shape \(5,\)"):
        gram_eigenvalues(np.ones(5))


def _marchenko_pastur_omega(beta):
    """Gavish-Donoho omega(beta) = lambda*(beta) / sqrt(mu_beta) from its definition: lambda* of their Eq. (11)
    and mu_beta the median of the Marchenko-Pastur law of aspect ratio beta (numerical integration)."""
    from scipy import integrate, optimize

    lo, hi = (1 - np.sqrt(beta)) ** 2, (1 + np.sqrt(beta)) ** 2
    density = lambda x: np.sqrt((hi - x) * (x - lo)) / (2 * np.pi * beta * x)  # noqa: E731
    median = optimize.brentq(lambda m: integrate.quad(density, lo, m)[0] - 0.5, lo, hi)
    lam_star = np.sqrt(2 * (beta + 1) + 8 * beta / (beta + 1 + np.sqrt(beta**2 + 14 * beta + 1)))
    return lam_star / np.sqrt(median)


@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0])
def test_gavish_donoho_lower_bound_uses_omega_of_beta(beta):
    """The not-saturated lower bound counts sigma_i > omega(beta) median(sigma): two values placed 0.01 above
    and below the exact omega(beta) (omega(1) = 2.858) are split by it, so the threshold is pinned to +-0.01."""
    omega = _marchenko_pastur_omega(beta)
    if beta == 1.0:
        assert omega == pytest.approx(2.858, abs=5e-4)
    bulk = np.geomspace(1.5, 0.6, 301)  # smooth: no eligible gap scores anywhere near z_min
    med = np.median(np.concatenate([[9.0, 9.0, 9.0, 9.0, 9.0], bulk]))
    top = np.array([3.6, omega + 0.01, omega - 0.01, 1.7, 1.6]) * med  # indices 1-5: ineligible for a drop
    sigma = np.concatenate([top, bulk])
    assert np.median(sigma) == med
    est = robust_from_singular_values(sigma, beta)
    assert (est.saturated, est.reason) == (False, "not saturated")
    assert est.lower_bound == 2  # 3.6 and omega + 0.01; not omega - 0.01


def test_paper_detector_default_windows_scale_with_n():
    """At n = 2,900 (the real common set's size) the defaults are w = floor(n/50) = 58 and w_s = floor(n/100) = 29,
    not the floor of 20: the slope is the least-squares slope over [i - 58, i + 58] and s_tilde its centred mean over
    [i - 29, i + 29], checked against np.polyfit; a saturated designed spectrum is found at its d."""
    n, d = 2900, 1000
    i = np.arange(n)
    lam = np.where(i < d, 10 ** (2 - 2.5 * i / d), 10 ** (-2 - 3 * ((i - d) / (n - d)) ** 3))
    est = paper_from_eigenvalues(lam, g=1)
    diag = est.diagnostics
    for k in (300, 1000, 2000):
        expected = np.polyfit(np.arange(k - 58, k + 59), diag["a"][k - 58 : k + 59], 1)[0]
        assert diag["slope"][k] == pytest.approx(expected, rel=1e-9, abs=1e-15)
        assert diag["s_tilde"][k] == pytest.approx(diag["slope"][k - 29 : k + 30].mean(), rel=1e-9, abs=1e-15)
    explicit = paper_from_eigenvalues(lam, g=1, w=58, w_s=29).diagnostics
    np.testing.assert_array_equal(diag["s_tilde"], explicit["s_tilde"])
    assert not np.allclose(diag["s_tilde"], paper_from_eigenvalues(lam, g=1, w=20, w_s=20).diagnostics["s_tilde"])
    assert (est.reason, est.saturated) == ("ok", True)
    assert diag["i_sad"] <= d <= diag["i_peak"] and est.d_hat_raw == d
