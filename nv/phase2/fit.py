"""Phase 2 timing attack, fitting side (§4.2; App. B.3 with Fig. algo_timing; App. D): pure functions, no I/O.

Equation numbers in the order of nightvision.tex, with the LaTeX labels in brackets:
Eq. 2  [scaling_relation]    T_ij ~ beta L_i ell_j^2 d_i + alpha                        (§4.2)
Eq. 3  [total_param]         P = 2 V d + L (2 + 2 n_kv/n_heads + 3 d_ffn/d) d^2 + (2L + 1) d
Eq. 6  [reference_scaling]   T_rj ~ beta^ref L_r ell_j^2 d_r + alpha^ref ~ gamma^ref ell_j^2 d_r + zeta^ref
Eq. 7  [per_model_tgt]       T^tgt_ij ~ gamma^tgt ell_j^2 d_hat_i + zeta^tgt             (App. B.3.3)
Eq. 8  [transfer_factor]     k = gamma^tgt / gamma^ref
Eq. 9  [cross_platform]      T^tgt_ij ~ k beta^ref L_i ell_j^2 d_i + alpha^ref
Eq. 10 [L_inference_global]  L_hat_g = gamma^tgt_g / (k beta^ref)
Eq. 11 [crossover]           ell* = floor((d + d_kv + 1.5 d_ffn) r)                      (App. D)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nv.errors import NVError

DISCARD_POINTS = 12  # App. D: shortest sweep points dropped before fitting


def crossover_length(d: int, d_kv: float, d_ffn: float, r: float = 0.6) -> int:
    """Eq. 11 [crossover]: ell* = floor((d + d_kv + 1.5 d_ffn) r), the projection/attention crossover."""
    if min(d, d_kv, d_ffn) <= 0 or r <= 0:
        raise NVError(f"d, d_kv, d_ffn and r must be positive, got {d}, {d_kv}, {d_ffn}, {r}")
    return math.floor(round((d + d_kv + 1.5 * d_ffn) * r, 9))  # round: 90 * 0.7 is 62.999... in binary


def sweep_lengths(d: int, d_kv: float, d_ffn: float, p_max: int, r: float = 0.6, n: int = 24,
                  fit: int = 2) -> np.ndarray:
    """App. D sequence-length sweep: n uniform integer lengths on [0.5 ell*, min(3 ell*, ell_cap)],
    ell_cap = min(max(2 ell*, 4 d), p_max - 200), plus ell* itself when inside; sorted, unique; at least ``fit`` of
    them (the fit's: App. D's discarded shortest and two more), else an error before any of them is timed.

    d_kv = n_kv d / n_heads, d_ffn the FFN width, p_max the positional limit, r ~ 0.6.
    """
    if n < 2:
        raise NVError(f"need at least 2 sweep points, got n={n}")
    ell_star = crossover_length(d, d_kv, d_ffn, r)
    ell_cap = min(max(2 * ell_star, 4 * d), p_max - 200)
    lo, hi = math.ceil(0.5 * ell_star), math.floor(min(3 * ell_star, ell_cap))
    if hi <= lo:
        raise NVError(f"p_max={p_max} leaves no room for a sweep starting at 0.5 ell* = {lo}")
    ell = np.rint(np.linspace(lo, hi, n)).astype(np.int64)
    ell = np.unique(np.append(ell, ell_star) if lo <= ell_star <= hi else ell)
    if len(ell) < fit:  # a context just above 0.5 ell* squeezes the range: its rounded lengths coincide
        raise NVError(f"p_max={p_max} leaves {len(ell)} distinct sweep lengths in [{lo}, {hi}] around ell* = {ell_star} "
                      f"(d = {d}), fewer than the fit's {fit}")
    return ell


def trim_cut(trim: float, n: int) -> int:
    """Trials App. D's trimmed mean cuts at each end of n: floor(trim n) (rounded first: 0.35 x 180 is 62.999...)."""
    return math.floor(round(trim * n, 9))


def trimmed_stats(trials: np.ndarray, trim: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """App. D timing protocol: trimmed mean over the last axis (``trim_cut`` trials cut at each end) and
    sigma_T = std(kept, ddof=1) / sqrt(N_kept)."""
    trials = np.sort(np.asarray(trials, dtype=np.float64), axis=-1)
    n = trials.shape[-1]
    cut = trim_cut(trim, n)
    if not 0.0 <= trim < 0.5 or n - 2 * cut < 2:
        raise NVError(f"trim={trim} on {n} trials leaves fewer than 2 kept trials")
    kept = trials[..., cut : n - cut]
    return kept.mean(axis=-1), kept.std(axis=-1, ddof=1) / math.sqrt(kept.shape[-1])


def prefill_times(trials: np.ndarray, baseline_trials: np.ndarray, trim: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """App. D: per-length trimmed mean latency minus the ell=1 baseline's trimmed mean, with sigma_T.

    ``trials`` is (lengths, trials); ``baseline_trials`` the ell=1 trials. sigma_T is that of each
    length alone, as the paper weights its regressions.
    """
    mean, sigma = trimmed_stats(trials, trim)
    base, _ = trimmed_stats(baseline_trials, trim)
    return mean - base, sigma


def attention_regime(
    ell: np.ndarray, T: np.ndarray, sigma: np.ndarray, n_discard: int = DISCARD_POINTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """App. D: drop one model's ``n_discard`` shortest lengths, keeping the attention-dominated points."""
    order = np.argsort(ell, kind="stable")
    if not 0 <= n_discard <= len(order) - 2:
        raise NVError(f"cannot discard {n_discard} of {len(order)} points and still fit a line")
    keep = order[n_discard:]
    return np.asarray(ell)[keep], np.asarray(T)[keep], np.asarray(sigma)[keep]


@dataclass(frozen=True)
class LineFit:
    """Weighted least-squares line y ~ slope x + intercept with standard errors."""

    slope: float
    intercept: float
    slope_se: float
    intercept_se: float


def weighted_line(x: np.ndarray, y: np.ndarray, sigma: np.ndarray) -> LineFit:
    """Weighted least squares of y on x with weights 1/sigma^2 (App. D weighting by sigma_T).

    Standard errors are scaled by the reduced chi^2 (as scipy's curve_fit with absolute_sigma=False),
    since sigma_T ignores model misfit; they are NaN with only two points.
    """
    x, y, sigma = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64).ravel() for a in (x, y, sigma)))
    if len(x) < 2 or np.any(sigma <= 0) or not np.all(np.isfinite(np.concatenate([x, y, sigma]))):
        raise NVError("a weighted line fit needs >= 2 finite points with positive sigma")
    w = sigma**-2
    x_bar, y_bar = np.average(x, weights=w), np.average(y, weights=w)
    sxx = np.sum(w * (x - x_bar) ** 2)
    if sxx <= 0:
        raise NVError("all fit abscissae are equal; vary the sequence length")
    slope = np.sum(w * (x - x_bar) * (y - y_bar)) / sxx
    intercept = y_bar - slope * x_bar
    dof = len(x) - 2
    s2 = np.sum(w * (y - slope * x - intercept) ** 2) / dof if dof else np.nan
    return LineFit(float(slope), float(intercept), float(np.sqrt(s2 / sxx)), float(np.sqrt(s2 * (1 / w.sum() + x_bar**2 / sxx))))


def _check_lengths(ell: np.ndarray) -> np.ndarray:
    ell = np.asarray(ell, dtype=np.float64)
    if np.any(ell <= 0):
        raise NVError("sequence lengths must be positive")
    return ell


def scaling_relation(beta: float, alpha: float, L: np.ndarray, d: np.ndarray, ell: np.ndarray) -> np.ndarray:
    """Eq. 2: T = beta L ell^2 d + alpha. With beta -> k beta^ref, alpha -> alpha^ref it is Eq. 9."""
    return beta * np.asarray(L) * _check_lengths(ell) ** 2 * np.asarray(d) + alpha


def fit_scaling(L: np.ndarray, d: np.ndarray, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray) -> LineFit:
    """Eq. 2 / Eq. 6 L-known fit over reference models: slope = beta, intercept = alpha.

    Flat arrays, one entry per (model, length) point; L and d broadcast against ell.
    """
    return weighted_line(np.asarray(L) * _check_lengths(ell) ** 2 * np.asarray(d), T, sigma)


def fit_gamma(d: np.ndarray, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray) -> LineFit:
    """L-unknown fit T ~ gamma ell^2 d + zeta: slope = gamma, intercept = zeta.

    Over a model set with true d it is Eq. 6's gamma^ref; Eq. 7's gamma^tgt (the paper: with the target platform's
    spectral d_hat) is fitted here with the references' true d (``evaluation.held_out``); on the target's own
    points alone it is the held-out gamma^tgt_g of Eq. 10.
    """
    return weighted_line(_check_lengths(ell) ** 2 * np.asarray(d), T, sigma)


def transfer_factor(gamma_tgt: float, gamma_ref: float) -> float:
    """Eq. 8: platform transfer factor k = gamma^tgt / gamma^ref."""
    if gamma_ref <= 0 or gamma_tgt <= 0:
        raise NVError(f"gamma fits must be positive, got gamma_tgt={gamma_tgt}, gamma_ref={gamma_ref}")
    return gamma_tgt / gamma_ref


def infer_depth(gamma_g: float, beta_ref: float, k: float = 1.0) -> float:
    """Eq. 10: L_hat_g = gamma^tgt_g / (k beta^ref), gamma^tgt_g from the target's own free-intercept fit."""
    if beta_ref <= 0 or k <= 0:
        raise NVError(f"beta_ref and k must be positive, got beta_ref={beta_ref}, k={k}")
    return gamma_g / (k * beta_ref)


def depth_basic(beta: float, alpha: float, d_hat: float, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray) -> float:
    """§4.2 basic estimator: plug beta, alpha, d_hat into Eq. 2 and solve for L by weighted least squares,
    L_hat = sum w x (T - alpha) / sum w x^2 with x = beta ell^2 d_hat, w = 1/sigma^2."""
    x = beta * _check_lengths(ell) ** 2 * d_hat
    w = np.asarray(sigma, dtype=np.float64) ** -2
    return float(np.sum(w * x * (np.asarray(T) - alpha)) / np.sum(w * x * x))


def depth_basic_t(beta: float, alpha: float, d_hat: float, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray) -> float:
    """The basic estimate's t-statistic L_hat / se(L_hat), se scaled by the reduced chi^2 of its one-parameter fit as
    ``weighted_line``'s are (sigma_T ignores misfit); NaN with one point. Eq. 10's is ``t_statistic`` of gamma_g's
    slope and slope_se."""
    L_hat = depth_basic(beta, alpha, d_hat, ell, T, sigma)
    x = beta * _check_lengths(ell) ** 2 * d_hat
    w = np.asarray(sigma, dtype=np.float64) ** -2
    dof = len(x) - 1
    if not dof:
        return np.nan
    s2 = np.sum(w * (np.asarray(T) - alpha - L_hat * x) ** 2) / dof
    return t_statistic(L_hat, float(np.sqrt(s2 / np.sum(w * x * x))))


def depths(beta: float, alpha: float, k: float, d_hat: float, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray,
           gamma_g: LineFit) -> dict[str, tuple[float, float]]:
    """One model's depth by both of the paper's estimators, each with its t-statistic: ``basic`` (§4.2; Eq. 9 across
    platforms), its attention-regime timings solved for L in T = k beta L ell^2 d_hat + alpha, and ``eq10``,
    gamma_g / (k beta) (Eq. 10) from its own free-intercept fit ``gamma_g``."""
    fit = (k * beta, alpha, d_hat, ell, T, sigma)
    return {"basic": (depth_basic(*fit), depth_basic_t(*fit)),
            "eq10": (infer_depth(gamma_g.slope, beta, k), t_statistic(gamma_g.slope, gamma_g.slope_se))}


def t_statistic(value: float, se: float) -> float:
    """value / se; +-inf for an exact fit (se = 0: quantised or noise-free timings), NaN for 0 / 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(value) / se)


@dataclass(frozen=True)
class Timings:
    """Prefill timings on one platform, flat over (model, length) points; d and L broadcast against ell.

    d is the true hidden size (reference models) or the spectral estimate d_hat (target platform);
    L is needed only for reference models.
    """

    ell: np.ndarray
    T: np.ndarray
    sigma: np.ndarray
    d: np.ndarray
    L: np.ndarray | None = None


@dataclass(frozen=True)
class PlatformFits:
    """Stage 2 of Fig. algo_timing: the fits and the transfer factor that ``depths`` turns into L_hat (Eqs. 9, 10)."""

    k: float
    reference: LineFit  # Eq. 6 L-known: beta^ref, alpha^ref
    gamma_ref: LineFit  # Eq. 6 L-unknown: gamma^ref, zeta^ref
    gamma_tgt: LineFit  # Eq. 7: gamma^tgt, zeta^tgt
    gamma_g: LineFit  # Eq. 7 on the target alone: gamma^tgt_g, zeta^tgt_g


def platform_fits(ref: Timings, tgt: Timings, target: Timings, tgt_on_ref: Timings | None = None) -> PlatformFits:
    """Fig. algo_timing Stage 2 (App. B.3.3, Eqs. 6-8) for any pair of platforms; ``depths`` gives L_hat from them.

    ``ref``: reference models F^ref with known d, L on the reference platform (beta^ref, alpha^ref);
    ``tgt``: models F^tgt timed on the target's platform with spectral d_hat; ``target``: the held-out
    model g with d_hat_g. ``tgt_on_ref``: the models of F^tgt timed on the reference platform, for
    gamma^ref (default: ``ref``). The pooled L-unknown slope gamma grows with the mean depth of the
    models it pools, so k = gamma^tgt / gamma^ref is a pure platform ratio only when both gammas pool
    the same models: pass ``tgt_on_ref`` whenever F^tgt is not F^ref (our choice; the paper's sets
    coincide). For leave-one-out evaluation the caller excludes g from every set. On one platform,
    passing the same models as ``ref`` and ``tgt`` makes k absorb the d_hat vs d mismatch.
    """
    if ref.L is None:
        raise NVError("reference timings need the known layer counts L")
    reference = fit_scaling(ref.L, ref.d, ref.ell, ref.T, ref.sigma)
    same = tgt_on_ref or ref
    gamma_ref = fit_gamma(same.d, same.ell, same.T, same.sigma)
    gamma_tgt = fit_gamma(tgt.d, tgt.ell, tgt.T, tgt.sigma)
    gamma_g = fit_gamma(target.d, target.ell, target.T, target.sigma)
    return PlatformFits(transfer_factor(gamma_tgt.slope, gamma_ref.slope), reference, gamma_ref, gamma_tgt, gamma_g)


def total_params(d: float, L: float, V: float, kv_ratio: float = 0.25, ffn_ratio: float = 3.5, tied: bool = False) -> float:
    """Eq. 3: P = 2 V d + L (2 + 2 kv_ratio + 3 ffn_ratio) d^2 + (2L + 1) d.

    kv_ratio = n_kv/n_heads, ffn_ratio = d_ffn/d (defaults: LLaMA-3-8B, as the paper assumes).
    ``tied=True`` counts one V d embedding shared with the output head: our extension, not in the paper.
    Fig. algo_timing (line 16) leaves out the (2L + 1) d norm term; we keep it, as Eq. 3 does.
    """
    if min(d, L, V) <= 0 or kv_ratio <= 0 or ffn_ratio <= 0:
        raise NVError(f"d, L, V and the ratios must be positive, got d={d}, L={L}, V={V}")
    embed = (1 if tied else 2) * V * d
    return embed + L * (2 + 2 * kv_ratio + 3 * ffn_ratio) * d * d + (2 * L + 1) * d


def relative_error(theta_hat: float | np.ndarray, theta: float | np.ndarray) -> np.ndarray:
    """R(theta_hat; theta) = |theta - theta_hat| / theta."""
    theta = np.asarray(theta, dtype=np.float64)
    if np.any(theta <= 0):
        raise NVError("relative error needs a positive true value theta")
    return np.abs(theta - np.asarray(theta_hat)) / theta
