"""Summaries of next-token distributions (App. B.1.1, temperature/entropy figure)."""

from __future__ import annotations

import numpy as np


def entropy_nats(logp: np.ndarray) -> np.ndarray:
    """Shannon entropy -sum_i p_i log p_i of each row of log-probabilities."""
    logp = np.asarray(logp, dtype=np.float64)
    return -(np.exp(logp) * np.where(np.isneginf(logp), 0.0, logp)).sum(axis=-1)  # 0 log 0 = 0: a masked token adds nothing


def top_k_mass(logp: np.ndarray, k: int) -> np.ndarray:
    """Probability mass held by the k >= 1 most likely tokens of each row."""
    if k < 1:
        raise ValueError(f"top_k_mass needs k >= 1, got {k}")
    p = np.exp(np.asarray(logp, dtype=np.float64))
    k = min(k, p.shape[-1])
    return np.sort(np.partition(p, -k, axis=-1)[..., -k:], axis=-1).sum(axis=-1)
