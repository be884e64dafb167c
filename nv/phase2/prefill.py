"""Attacker-side parameter count from the prefill curve: P_hat with no guess of d_ffn/d or n_kv/n_heads.

Eq. 3 needs the target's ratios n_kv/n_heads and d_ffn/d, which the attacker does not know (the paper
assumes LLaMA-3-8B's). The prefill curve carries them: a dense decoder's prefill time is

    T(ell) ~ b L d ell^2 + c P_ne ell + a,

attention growing with ell^2 d per layer while the projections and the MLP cost 2 FLOPs per non-embedding
parameter per token (P_ne = L (2 d^2 + 2 d d_kv + 3 d d_ffn) + norms and biases). The references of F,
timed on the same platform with known L, d and P_ne, calibrate b, c, a; a target's P_ne then follows from its
own sweep given d_hat and L_hat (a one-parameter fit: the quadratic term is subtracted, not fitted, so an error
in L_hat moves P_ne by the attention term's share of the sweep's time against the rest, one to one in relative
terms where the two are equal; App. D places the sweep around that crossover). The embedding adds V d_hat once
(tied) or twice (untied); tying is not visible in prefill time, so P_hat is the midpoint of the tied and untied
totals and the range covers both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nv.errors import NVError


def non_embedding_params(record: dict) -> float:
    """A timed model's P_ne from its true facts: P minus the embedding(s) and the final norm."""
    return float(record["P"] - record["vocab_size"] * record["d"] * (1 if record["tied"] else 2) - record["d"])


@dataclass(frozen=True)
class PrefillCalibration:
    """T ~ b L d ell^2 + c P_ne ell + a on one platform (seconds; ell in tokens)."""

    b: float
    c: float
    a: float


def calibrate(records: list[dict]) -> PrefillCalibration:
    """Weighted least squares (weights 1/sigma_T^2, App. D) of every sweep point of the reference ``records``."""
    if len(records) < 2:
        raise NVError("the prefill calibration needs at least two reference models on the platform")
    X, y, w = [], [], []
    for r in records:
        ell, T, sigma = (np.asarray(r[k], dtype=np.float64) for k in ("ell", "T", "sigma"))
        X.append(np.stack([r["L"] * r["d"] * ell**2, non_embedding_params(r) * ell, np.ones_like(ell)], axis=1))
        y.append(T)
        w.append(1.0 / np.maximum(sigma, 1e-12))
    X, y, w = np.concatenate(X), np.concatenate(y), np.concatenate(w)
    b, c, a = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
    if not (b > 0 and c > 0):  # the law's attention and per-parameter costs: a time, neither a credit
        raise NVError(f"prefill calibration: attention cost b = {b:.3g} s and per-parameter cost c = {c:.3g} s are not "
                      "both positive (timings too noisy)")
    return PrefillCalibration(float(b), float(c), float(a))


def non_embedding_hat(cal: PrefillCalibration, ell: np.ndarray, T: np.ndarray, sigma: np.ndarray, d_hat: float,
                      L_hat: float) -> float:
    """P_ne_hat: slope through the origin of (T - a - b L_hat d_hat ell^2) on ell, divided by c; NaN when it is not
    positive (the attention term of an L_hat too deep, or noise, leaves no time for the parameters)."""
    ell, T, sigma = (np.asarray(v, dtype=np.float64) for v in (ell, T, sigma))
    w = 1.0 / np.maximum(sigma, 1e-12) ** 2
    rest = T - cal.a - cal.b * L_hat * d_hat * ell**2
    P_ne = float(np.sum(w * rest * ell) / np.sum(w * ell * ell) / cal.c)
    return P_ne if P_ne > 0 else np.nan


def param_range(P_ne: float, d_hat: float, V: int) -> tuple[float, float, float]:
    """(tied, untied, midpoint) totals: P_ne + V d_hat (tied) or + 2 V d_hat (untied), plus the final norm d_hat."""
    tied = P_ne + V * d_hat + d_hat
    untied = tied + V * d_hat
    return tied, untied, 0.5 * (tied + untied)
