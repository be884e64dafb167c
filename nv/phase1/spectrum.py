"""Spectral estimators of the hidden dimension d from the pruned matrix Y (Alg. 2, App. B.1.3).

Index convention: every index in a `SpectrumEstimate` is 1-based as in the paper, so
lambda_1 >= lambda_2 >= ... and d_hat counts the signal eigenvalues (the last signal one is
lambda_{d_hat}); diagnostics arrays are 0-based numpy arrays whose entry i-1 belongs to index i.
"""

from dataclasses import dataclass, field

import numpy as np
from scipy.signal import find_peaks

from nv.errors import NVError


@dataclass(frozen=True)
class SpectrumEstimate:
    """Outcome of one estimator; `reason` is "ok", "not saturated", "no saddle" or "no peak"."""

    method: str
    saturated: bool
    d_hat_raw: int | None
    d_hat: int | None
    g: int
    lower_bound: int | None
    reason: str
    diagnostics: dict = field(default_factory=dict, repr=False)


def snap(d: int, g: int) -> int:
    """Ceiling-snap to the grid: d_hat_rnd = g * ceil(d_hat / g) (Alg. 2 line 8)."""
    if g < 1:
        raise NVError(f"grid spacing g must be >= 1, got {g}")
    return g * -(-int(d) // g)


def _check(Y) -> np.ndarray:
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim != 2 or min(Y.shape) < 2:
        raise NVError(f"Y must be a 2-D matrix with at least 2 rows and columns, got shape {Y.shape}")
    if not np.isfinite(Y).all():
        raise NVError("Y has NaN or infinite entries; prune it first")
    return Y


def gram_eigenvalues(Y) -> np.ndarray:
    """lambda_1 >= ... >= lambda_n >= 0 of the smaller-side Gram matrix G (Alg. 2 lines 1-2).

    G = Y Y^T if D' <= |C| else Y^T Y, always formed in float64: with the per-row offset
    near -10 the top eigenvalue is ~1e10 and float32 would drown the tail in rounding error.
    """
    Y = _check(Y)
    G = Y @ Y.T if Y.shape[0] <= Y.shape[1] else Y.T @ Y
    return np.clip(np.linalg.eigvalsh(G)[::-1], 0.0, None)


def _window_sums(n: int, w: int):
    """``sums(v)``: the sums of v over the windows [i-w, i+w] truncated at both ends, and their sizes."""
    i = np.arange(n)
    lo, hi = np.maximum(i - w, 0), np.minimum(i + w, n - 1) + 1

    def sums(v):
        c = np.concatenate(([0.0], np.cumsum(v)))
        return c[hi] - c[lo]

    return sums, hi - lo


def _window_slope(a: np.ndarray, w: int) -> np.ndarray:
    """Least-squares slope of a over [i-w, i+w], the window truncated at both ends."""
    n = a.size
    window_sum, m = _window_sums(n, w)
    i = np.arange(n)
    x = i - i.mean()  # centred abscissa keeps the sums well conditioned
    sx, sxx = window_sum(x), window_sum(x * x)
    sa, sxa = window_sum(a), window_sum(x * a)
    den = m * sxx - sx * sx
    return np.divide(m * sxa - sx * sa, den, out=np.zeros(n), where=den > 0)


def _moving_average(v: np.ndarray, w_s: int) -> np.ndarray:
    """Centred moving average of half-window w_s, truncated at both ends."""
    window_sum, m = _window_sums(v.size, w_s)
    return window_sum(v) / m


def paper_from_eigenvalues(
    lam, *, w=None, w_s=None, p=0.54, g=128, lam_sad=np.pi, lam_peak=np.pi / 2
) -> SpectrumEstimate:
    """Saddle-then-peak inflection detector of Alg. 2 (lines 3-8) on eigenvalues lambda_i.

    a_i = arctan(lambda_i) (Eq. 4); slope = least-squares slope of a over [i-w, i+w] with
    w = max(20, floor(n/50)) when None; s_tilde = centred moving average of the slope, half-window
    w_s = max(20, floor(n/100)) when None. i_sad = first local minimum of s_tilde with
    prominence >= p (max s_tilde - min s_tilde) among indices with a_i <= arctan(lam_sad)
    (prominence measured on the whole s_tilde); i_peak = first i > i_sad with
    s_tilde_{i+1} <= s_tilde_i and a_i <= arctan(lam_peak); d_hat = argmax over k in
    [i_sad, i_peak] of -Delta^2 a_k = -(a_{k+1} - 2 a_k + a_{k-1}) (Eq. 5), snapped to g * ceil(d_hat/g).
    A missing saddle or peak is reported as reason "no saddle" / "no peak", not raised.
    """
    lam = np.sort(np.asarray(lam, dtype=np.float64))[::-1]
    if lam.ndim != 1 or not np.isfinite(lam).all():
        raise NVError("eigenvalues must be a finite 1-D array")
    n = lam.size
    w = max(20, n // 50) if w is None else int(w)
    w_s = max(20, n // 100) if w_s is None else int(w_s)
    a = np.arctan(lam)
    slope = _window_slope(a, w)
    s_tilde = _moving_average(slope, w_s)
    diag = {"lambda": lam, "a": a, "slope": slope, "s_tilde": s_tilde, "i_sad": None, "i_peak": None,
            "lam_sad": lam_sad, "lam_peak": lam_peak}

    def fail(reason):
        return SpectrumEstimate("paper", False, None, None, g, None, reason, diag)

    minima, _ = find_peaks(-s_tilde, prominence=p * (s_tilde.max() - s_tilde.min()))
    minima = minima[a[minima] <= np.arctan(lam_sad)]
    if minima.size == 0:
        return fail("no saddle")
    j_sad = int(minima[0])
    diag["i_sad"] = j_sad + 1
    j = np.arange(j_sad + 1, n - 1)
    after = j[(s_tilde[j + 1] <= s_tilde[j]) & (a[j] <= np.arctan(lam_peak))]
    if after.size == 0:
        return fail("no peak")
    j_peak = int(after[0])
    diag["i_peak"] = j_peak + 1
    k = np.arange(max(j_sad, 1), j_peak + 1)  # j_peak <= n - 2, so a_{k+1} exists
    neg_d2 = -(a[k + 1] - 2 * a[k] + a[k - 1])
    d_raw = int(k[np.argmax(neg_d2)]) + 1
    return SpectrumEstimate("paper", True, d_raw, snap(d_raw, g), g, None, "ok", diag)


def paper(Y, **hyper) -> SpectrumEstimate:
    """Alg. 2 as published: Gram eigenvalues of Y (not centred), then `paper_from_eigenvalues`."""
    return paper_from_eigenvalues(gram_eigenvalues(Y), **hyper)


def _gavish_donoho_count(sigma: np.ndarray, beta: float) -> int:
    """Number of sigma_i above the Gavish-Donoho hard threshold omega(beta) * median(sigma)."""
    omega = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
    return int(np.count_nonzero(sigma > omega * np.median(sigma)))


def centred_singular_values(Y) -> tuple[np.ndarray, float]:
    """sigma_1 >= ... >= sigma_n of the row-centred Y and beta, its aspect ratio.

    Row-centring Y removes the per-row log-partition offset and leaves a signal of rank <= d;
    the centred matrix has rank <= n := min(D', |C| - 1); its float64 Gram matrix gives the sigma_i.
    """
    Y = _check(Y)
    Yc = Y - Y.mean(axis=1, keepdims=True)
    n = min(Yc.shape[0], Yc.shape[1] - 1)
    return np.sqrt(gram_eigenvalues(Yc)[:n]), min(Yc.shape) / max(Yc.shape)


def robust(Y, *, g=64, z_min=8.0, min_ratio=1.05, min_side=5, w_min=10, w_frac=0.05) -> SpectrumEstimate:
    """Scale-free drop detector on the row-centred spectrum (the project default): the
    `centred_singular_values` of Y scored by `robust_from_singular_values`."""
    sigma, beta = centred_singular_values(Y)
    return robust_from_singular_values(sigma, beta, g=g, z_min=z_min, min_ratio=min_ratio, min_side=min_side,
                                       w_min=w_min, w_frac=w_frac)


def robust_from_singular_values(
    sigma, beta: float, *, g=64, z_min=8.0, min_ratio=1.05, min_side=5, w_min=10, w_frac=0.05
) -> SpectrumEstimate:
    """The robust detector on the row-centred singular values sigma_i (descending).

    With l_i = log sigma_i and the log-gaps gap_k = l_k - l_{k+1}, a drop after index k scores
    z_k = gap_k / max(median of the W gaps left of k, median of the W gaps right of k),
    W = max(w_min, floor(w_frac * n)). Only k with >= min_side gaps on each side are
    eligible, so the steep ends of a noise spectrum (runs of large gaps) never look isolated.
    The best k is accepted as d_hat_raw if z_k >= z_min and sigma_k / sigma_{k+1} >= min_ratio,
    and d_hat = g * ceil(k / g) (g = 64: a raw 575 or 576 both give 576).
    Otherwise the result is "not saturated" with lower_bound = the number of sigma_i above the
    Gavish-Donoho threshold omega(beta) * median(sigma), beta = aspect ratio of the matrix;
    signal in the median only raises that threshold, so the bound stays conservative (<= n) under a floor of one
    variance; one whose variance differs by column (bf16 logits straddling binades) can lift noise over it (README:
    phase 1, the robust estimator's bound).
    Only ratios of sigma_i enter, so the result is invariant to rescaling Y.
    Diagnostics: sigma, log_sigma, gaps (entry k-1 is gap_k), z (NaN where ineligible),
    window W, k_best.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.ndim != 1 or sigma.size == 0 or not np.isfinite(sigma).all():
        raise NVError("singular values must be a finite, non-empty 1-D array")
    n = sigma.size
    diag = {"sigma": sigma}

    def not_saturated():
        lb = _gavish_donoho_count(sigma, beta) if sigma[0] > 0 else 0
        return SpectrumEstimate("robust", False, None, None, g, lb, "not saturated", diag)

    if sigma[0] == 0 or n < 2 * min_side + 2:
        return not_saturated()
    log_sigma = np.log(np.maximum(sigma, sigma[0] * np.sqrt(np.finfo(float).eps)))
    gaps = log_sigma[:-1] - log_sigma[1:]  # gaps[k-1] = l_k - l_{k+1}
    W = max(w_min, int(w_frac * n))
    padded = np.concatenate((np.full(W, np.nan), gaps, np.full(W, np.nan)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, W)
    j = np.arange(min_side, gaps.size - min_side)  # 0-based gap index, k = j + 1
    left = np.nanmedian(windows[j], axis=1)
    right = np.nanmedian(windows[j + W + 1], axis=1)
    scale = np.maximum(np.maximum(left, right), np.finfo(float).tiny)
    z = np.full(gaps.size, np.nan)
    z[j] = gaps[j] / scale
    diag.update(log_sigma=log_sigma, gaps=gaps, z=z, window=W)
    best = int(j[np.argmax(z[j])])
    diag["k_best"] = best + 1
    if z[best] < z_min or gaps[best] < np.log(min_ratio):
        return not_saturated()
    return SpectrumEstimate("robust", True, best + 1, snap(best + 1, g), g, None, "ok", diag)


def d_interval(raw: int | None, lower_bound: int | None) -> tuple[float, float]:
    """The detector's interval for d: [d_hat_raw - tol, d_hat_raw + tol] with tol = max(3, 0.5 % of d_hat_raw) (the
    resolution the robust estimator is held to) around a saturated d_hat_raw, [lower bound, inf) otherwise."""
    if raw is None:
        return float(lower_bound or 0), np.inf
    tol = max(3.0, 0.005 * raw)
    return raw - tol, raw + tol


METHODS = {"robust": robust, "paper": paper}


def estimate(Y, method: str = "robust", **hyper) -> SpectrumEstimate:
    """Run one estimator on the pruned matrix Y; hyperparameters go to that method."""
    if method not in METHODS:
        raise NVError(f"unknown spectrum method {method!r}; choose from {', '.join(METHODS)}")
    return METHODS[method](Y, **hyper)
