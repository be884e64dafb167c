"""Phase 1 end to end (§4.1, Alg. 1-2): common-set matrix, both spectral estimators, report.

The stages (notebooks) and ``nv attack`` compose these functions; nothing here talks to a
model except through the oracle passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nv.prune import Pruned, greedy_prune
from nv.sampling import SampledMatrix
from nv.spectrum import SpectrumEstimate, estimate, snap


@dataclass
class CommonSet:
    """The pruned common-set log-prob matrix Y (D' x |C|) and which prompts/tokens survived."""

    Y: np.ndarray
    pruned: Pruned


def common_set(sampled: SampledMatrix) -> CommonSet:
    """Alg. 1 lines 5-7: greedy NaN pruning of Y_hat, then the dense submatrix Y (float64)."""
    pruned = greedy_prune(sampled.counts)
    Y = sampled.logprobs[pruned.rows][:, pruned.cols].toarray().astype(np.float64)
    return CommonSet(Y, pruned)


def estimate_both(Y: np.ndarray, spectrum: dict) -> dict[str, SpectrumEstimate]:
    """Both estimators on the same matrix, hyperparameters from params.yaml's ``spectrum``."""
    return {m: estimate(Y, m, **spectrum[m]) for m in ("robust", "paper")}


def _int(v) -> int | None:
    return None if v is None else int(v)


def report(
    model: str,
    d_true: int | None,
    budget: dict,
    common_shape: tuple[int, int],
    estimates: dict[str, SpectrumEstimate],
    method: str,
    search_cost: dict | None = None,
) -> dict:
    """The metrics record (metrics/hidden_dim.json, report.json): d_hat, errors, cost, landmarks.

    ``budget`` is ``SampledMatrix.budget()``; ``common_shape`` is (D', |C|)."""
    chosen, paper = estimates[method], estimates["paper"]
    search_cost = search_cost or {"calls": 0, "tokens": 0}
    rel = None if chosen.d_hat_raw is None or not d_true else abs(chosen.d_hat_raw - d_true) / d_true
    return {
        "model": model,
        "estimator": method,
        "d_true": d_true,
        "saturated": chosen.saturated,
        "reason": chosen.reason,
        "d_hat_raw": chosen.d_hat_raw,
        "d_hat": chosen.d_hat,
        "g": chosen.g,
        "d_hat_g64": None if chosen.d_hat_raw is None else snap(chosen.d_hat_raw, 64),
        "d_hat_g128": None if chosen.d_hat_raw is None else snap(chosen.d_hat_raw, 128),
        "lower_bound": chosen.lower_bound,
        "rel_error": rel,
        "d_hat_paper": paper.d_hat,
        "d_hat_paper_raw": paper.d_hat_raw,
        "paper_reason": paper.reason,
        "i_sad": _int(paper.diagnostics.get("i_sad")),
        "i_peak": _int(paper.diagnostics.get("i_peak")),
        "D": budget["D"],
        "D_prime": int(common_shape[0]),
        "common_set_size": int(common_shape[1]),
        "N": budget["N"],
        "temperature": budget["temperature"],
        "tokens": budget["tokens"] + int(search_cost["tokens"]),
        "calls": budget["calls"] + int(search_cost["calls"]),
        "sampling_tokens": budget["tokens"],
        "search_tokens": int(search_cost["tokens"]),
    }
