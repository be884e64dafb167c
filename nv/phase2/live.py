"""``nv attack --base-url ... --timing-calibration FILE``: phase 2 (§4.2) against a live endpoint.

The endpoint is timed with the App. D protocol of the calibration's reference platform (its r, K,
warm-ups, trim, sweep and discard settings), on the sweep that d_hat and the default ratios give;
L_hat from the basic estimator of §4.2 / Eq. 9 (the endpoint's timings solved for L in
T = k beta L ell^2 d_hat + alpha, beta and alpha from the calibration) and L_hat_eq10 = gamma_g / (k beta)
(Eq. 10), k being the platform transfer factor the user supplies (default 1: the endpoint is assumed to
run on the reference platform; a provider's k needs references timed on its hardware, App. B.3.3). P_hat from Eq. 3 with the default ratios when
the vocabulary size (or an upper bound) is given. Timed calls go through the oracle's journal, so an
interrupted run resumes without paying for them again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.oracle.base import Oracle
from nv.params import check_timing_protocol
from nv.phase2.protocol import collect_timings, summarize
from nv.phase2.fit import attention_regime, depth_basic, fit_gamma, infer_depth, sweep_lengths, total_params

CALIBRATION_KEYS = ("platform", "beta", "alpha", "r", "trials", "warmups", "trim", "n_lengths", "discard", "kv_ratio", "ffn_ratio")


def load_calibration(path: Path) -> dict:
    """A ``calibration.json`` written by the timing_fit stage; one-line errors for anything else."""
    try:
        cal = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise NVError(f"timing calibration not found: {path} (run `dvc repro timing_fit`)") from None
    except json.JSONDecodeError:
        raise NVError(f"timing calibration {path} is not JSON") from None
    missing = [k for k in CALIBRATION_KEYS if not isinstance(cal, dict) or k not in cal]
    if missing:
        raise NVError(f"timing calibration {path} lacks {missing}: use outputs/timing_fit/calibration.json")
    bad = [k for k in ("beta", "alpha") if isinstance(cal[k], bool) or not isinstance(cal[k], (int, float)) or not math.isfinite(cal[k])]
    if bad:
        raise NVError(f"timing calibration {path}: {bad[0]} = {cal[bad[0]]!r} is not a finite number: "
                      "use outputs/timing_fit/calibration.json")
    # the protocol as params.yaml's timing section allows it, checked before phase 1 pays for anything
    try:
        check_timing_protocol({k: cal[k] for k in CALIBRATION_KEYS[3:]}, f"timing calibration {path}")
    except NVError as exc:
        raise NVError(f"{exc}: use outputs/timing_fit/calibration.json") from None
    if not cal["beta"] > 0:
        raise NVError(f"timing calibration {path} has beta = {cal['beta']}: its reference fit failed")
    return cal


def _sweep(cal: dict, d_hat: int, p_max: int) -> np.ndarray:
    """App. D's lengths around the crossover of d_hat (Eq. 11), with the calibration's ratios, r and n_lengths."""
    return sweep_lengths(d_hat, cal["kv_ratio"] * d_hat, cal["ffn_ratio"] * d_hat, p_max, cal["r"], cal["n_lengths"])


def timing_cost(cal: dict, d_hat: int | None, p_max: int) -> dict:
    """Phase 2's requests and billed tokens on the endpoint: App. D's warm-ups (at the longest length), the ell = 1
    baseline and K trials at each length of the sweep of d_hat, one output token each. Without d_hat (phase 1 finds
    it) a bound: every length at the longest any sweep reaches, p_max - 200."""
    lengths = _sweep(cal, d_hat, p_max) if d_hat is not None else np.full(cal["n_lengths"] + 1, p_max - 200)
    requests = cal["warmups"] + cal["trials"] * (len(lengths) + 1)
    tokens = cal["warmups"] * int(lengths.max()) + cal["trials"] * (int(lengths.sum()) + 1) + requests
    return {"requests": requests, "tokens_billed": tokens, "bound": d_hat is None}


def timing_phase(oracle: Oracle, d_hat: int | None, cal: dict, k: float, p_max: int, vocab_size: int | None,
                 seed: int, checkpoint: Path, progress: bool = True) -> dict:
    """The report's phase-2 fields: L_hat (and P_hat) of the endpoint, or why there are none."""
    if d_hat is None:
        return {"timing": {"note": "no d_hat from phase 1 (spectrum not saturated): phase 2 needs one"}}
    lengths = _sweep(cal, d_hat, p_max)
    # resume through the journal, not the checkpoint: a rerun then asks every timed call again (replayed, unpaid),
    # so its §5 cost counts them as an uninterrupted run's does (a checkpoint would skip them uncounted)
    Path(checkpoint).unlink(missing_ok=True)
    rows = collect_timings(oracle, lengths, cal["trials"], cal["warmups"], seed, checkpoint,
                           {"calibration": cal["platform"], "d_hat": d_hat}, progress)
    stats = summarize(rows, cal["trim"])
    ell, T, sigma = attention_regime(stats["ell"], stats["T"], stats["sigma"], cal["discard"])
    gamma = fit_gamma(np.full(len(ell), float(d_hat)), ell, T, sigma)
    L_hat = depth_basic(k * cal["beta"], cal["alpha"], d_hat, ell, T, sigma)
    out = {"calibration_platform": cal["platform"], "beta": cal["beta"], "alpha": cal["alpha"], "k": k, "gamma_g": gamma.slope,
           "d_hat": d_hat, "lengths": stats["ell"].tolist(), "T": stats["T"].tolist(), "sigma": stats["sigma"].tolist(),
           "trials": cal["trials"], "L_hat": L_hat, "L_hat_rounded": max(1, round(L_hat)),
           "L_hat_eq10": infer_depth(gamma.slope, cal["beta"], k)}
    if L_hat > 0 and vocab_size:
        out["P_hat"] = total_params(d_hat, L_hat, vocab_size, cal["kv_ratio"], cal["ffn_ratio"])
        out["vocab_size"] = vocab_size
    elif L_hat <= 0:
        out["note"] = "L_hat <= 0: the endpoint's latency does not grow with ell^2 d_hat (noise or a prefix cache)"
    else:
        out["note"] = "no --vocab-size given: P_hat needs |V| or an upper bound (Eq. 3)"
    return {"timing": out}
