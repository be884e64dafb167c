import numpy as np
import pytest

from nv.errors import NVError
from nv.phase1.spectrum import estimate, gram_eigenvalues, paper, paper_from_eigenvalues, robust, snap


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


def test_snap():
    assert snap(576, 128) == 640 and snap(576, 64) == 576 and snap(575, 64) == 576
    assert snap(577, 64) == 640 and snap(7, 1) == 7
    with pytest.raises(NVError):
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
    with pytest.raises(NVError):
        estimate(Y, "elbow")
    with pytest.raises(NVError):
        robust(np.full((5, 5), np.nan))
    with pytest.raises(NVError):
        gram_eigenvalues(np.ones(5))
