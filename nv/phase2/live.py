"""``nv attack --base-url ... --timing-calibration FILE``: phase 2 (§4.2) against a live endpoint, from the
calibration file of ``nv.phase2.calibration``.

The endpoint is timed with the App. D protocol of the calibration's reference platform (its r, K,
warm-ups, trim, sweep and discard settings), on the sweep that d_hat and the default ratios give.
Depth by both of the paper's estimators: the basic estimator of §4.2 / Eq. 9 (the endpoint's timings solved
for L in T = k beta L ell^2 d_hat + alpha, beta and alpha from the calibration) and Eq. 10,
gamma_g / (k beta), k being the platform transfer factor the user supplies (default 1: the endpoint is assumed
to run on the reference platform; a provider's k needs references timed on its hardware, App. B.3.3). The
headline L_hat, the attacker-side P_hat (from the prefill curve, no guess of the ratios) and their 90 %
intervals are ``nv.phase2.intervals``'s, as in the validation, from the references' leave-one-out errors the
calibration carries; P_hat by Eq. 3 with the default ratios (the paper's) beside it. Both need the
vocabulary size (or an upper bound). Timed calls go through the oracle's journal, so an interrupted run
resumes without paying for them again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.oracle.base import Oracle
from nv.phase2 import prefill
from nv.phase2.calibration import ERROR_KEYS
from nv.phase2.fit import attention_regime, depths, fit_gamma, sweep_lengths, total_params
from nv.phase2.intervals import ESTIMATORS, MIN_T, choose_rule, estimates, significant
from nv.phase2.protocol import collect_timings, summarize


def _sweep(cal: dict, d_hat: int, p_max: int) -> np.ndarray:
    """App. D's lengths around the crossover of d_hat (Eq. 11), with the calibration's ratios, r and n_lengths, and
    enough of them for its fit (discard + 2): else a one-line error naming --context-length, before any is timed."""
    try:
        return sweep_lengths(d_hat, cal["kv_ratio"] * d_hat, cal["ffn_ratio"] * d_hat, p_max, cal["r"], cal["n_lengths"],
                             cal["discard"] + 2)
    except NVError as exc:
        raise NVError(f"phase 2 cannot sweep d_hat = {d_hat} under --context-length {p_max} ({exc}): give the "
                      "endpoint's own context length, if longer (default 8192)") from None


def timing_cost(cal: dict, d_hat: int | None, p_max: int) -> dict:
    """Phase 2's requests and billed tokens on the endpoint: App. D's warm-ups (at the longest length), the ell = 1
    baseline and K trials at each length of the sweep of d_hat, one output token each. Without d_hat (phase 1 finds
    it) a bound: every length at the longest any sweep reaches, p_max - 200. ``tokens_held``: what the budget keeps
    for it, its billed tokens and the reservation of its last call beyond them (a timed prompt is new to the client,
    which reserves twice the longest prompt seen for it: ``HTTPOracle._call``)."""
    if p_max <= 200:
        raise NVError(f"--context-length {p_max} leaves no room for App. D's sweep, which stops 200 tokens short of the "
                      "context: give the endpoint's own context length (default 8192)")
    lengths = _sweep(cal, d_hat, p_max) if d_hat is not None else np.full(cal["n_lengths"] + 1, p_max - 200)
    requests = cal["warmups"] + cal["trials"] * (len(lengths) + 1)
    tokens = cal["warmups"] * int(lengths.max()) + cal["trials"] * (int(lengths.sum()) + 1) + requests
    return {"requests": requests, "tokens_billed": tokens, "tokens_held": tokens + 2 * int(lengths.max()), "bound": d_hat is None}


def timing_phase(oracle: Oracle, d_hat: int | None, cal: dict, k: float, p_max: int, vocab_size: int | None,
                 seed: int, checkpoint: Path, progress: bool = True) -> dict:
    """The report's phase-2 fields: the endpoint timed on the sweep of d_hat, and ``estimate``'s L_hat and P_hat,
    or why there are none."""
    if d_hat is None:
        return {"timing": {"note": "no d_hat from phase 1 (spectrum not saturated): phase 2 needs one"}}
    lengths = _sweep(cal, d_hat, p_max)
    # resume through the journal, not the checkpoint: a rerun then asks every timed call again (replayed, unpaid),
    # so its §5 cost counts them as an uninterrupted run's does (a checkpoint would skip them uncounted)
    Path(checkpoint).unlink(missing_ok=True)
    rows = collect_timings(oracle, lengths, cal["trials"], cal["warmups"], seed, checkpoint,
                           {"calibration": cal["platform"], "d_hat": d_hat}, progress)
    stats = summarize(rows, cal["trim"])
    timed = {"lengths": stats["ell"].tolist(), "T": stats["T"].tolist(), "sigma": stats["sigma"].tolist(), "trials": cal["trials"]}
    return {"timing": timed | estimate(stats["ell"], stats["T"], stats["sigma"], d_hat, cal, k, vocab_size)}


def estimate(ell: np.ndarray, T: np.ndarray, sigma: np.ndarray, d_hat: int, cal: dict, k: float, vocab_size: int | None) -> dict:
    """L_hat (the rule's) with both estimators beside it (raw, with their fits' t-statistics; one under ``MIN_T``
    gives no depth: ``nv.phase2.intervals.significant``), P_hat (attacker-side, and Eq. 3 with the default ratios as
    ``P_hat_paper``) and their 90 % intervals ([lo, hi], null for unbounded: ``_interval`` the hull of both
    estimators', ``_interval_rule`` the rule's alone), from the endpoint's App. D summary (``ell``, ``T``,
    ``sigma``); a ``note`` where an estimate is missing. The intervals hold on the calibration's platform; with
    k != 1 they assume k exact. The prefill curve moves with the platform as the attention term does: b and c
    scale by k, the fixed overhead a does not."""
    ell_a, T_a, sigma_a = attention_regime(ell, T, sigma, cal["discard"])
    gamma = fit_gamma(np.full(len(ell_a), float(d_hat)), ell_a, T_a, sigma_a)
    both = depths(cal["beta"], cal["alpha"], k, d_hat, ell_a, T_a, sigma_a, gamma)
    raw, t = ({name: pair[i] for name, pair in both.items()} for i in (0, 1))
    L_hat = {name: significant(raw[name], t[name]) for name in ESTIMATORS}
    rule = choose_rule(cal["rule_order"], {ESTIMATORS[n]: v for n, v in L_hat.items()})
    fit = cal["prefill"]
    curve = None if fit is None else prefill.PrefillCalibration(k * fit["b"], k * fit["c"], fit["a"])
    P_ne_hat = {name: prefill.non_embedding_hat(curve, ell, T, sigma, d_hat, L) if curve is not None and L > 0 else np.nan
                for name, L in L_hat.items()}
    q = {key: _inf(cal[key]) for key in ERROR_KEYS if not key.startswith("score")}
    est = {key: float(v) for key, v in estimates(L_hat, P_ne_hat, q, rule, d_hat, vocab_size or np.nan).items()}
    out = {"calibration_platform": cal["platform"], "beta": cal["beta"], "alpha": cal["alpha"], "k": k, "gamma_g": gamma.slope,
           "d_hat": d_hat, "rule": rule, "L_hat": est["L_hat"], "L_hat_basic": raw["basic"], "L_hat_eq10": raw["eq10"],
           **{f"t_{name}": value if np.isfinite(value) else None for name, value in t.items()}}  # null: an exact fit (or 0/0)
    if not est["L_hat"] > 0:
        return out | {"note": f"no depth from either estimator (L_hat <= 0 or under {MIN_T:g} standard errors above 0): "
                              "the endpoint's latency does not grow with ell^2 d_hat (noise or a prefix cache)"}
    out |= {"L_hat_rounded": max(1, round(est["L_hat"])), "L_interval": _interval(est, "L"),
            "L_interval_rule": _interval(est, "L", "_rule")}
    if not vocab_size:
        return out | {"note": "no --vocab-size given: P_hat needs |V| or an upper bound (Eq. 3)"}
    out |= {"vocab_size": vocab_size, "P_hat_paper": total_params(d_hat, est["L_hat"], vocab_size, cal["kv_ratio"], cal["ffn_ratio"])}
    if curve is None or not np.isfinite(est["P_hat"]):
        why = ("the calibration's prefill fit failed" if curve is None else
               f"the prefill curve leaves no positive P_ne at L_hat = {est['L_hat']:.3g} (too deep for the sweep's time, or noise)")
        return out | {"note": f"no attacker-side P_hat: {why} (P_hat_paper: Eq. 3 with the default ratios, only)"}
    tied, untied, _ = prefill.param_range(P_ne_hat[rule], d_hat, vocab_size)
    return out | {"P_hat": est["P_hat"], "P_tied_untied": [tied, untied], "P_interval": _interval(est, "P"),
                  "P_interval_rule": _interval(est, "P", "_rule")}


def _inf(value: float | None) -> float:
    """A calibration's null (an infinite half-width or score) as inf."""
    return np.inf if value is None else float(value)


def _interval(est: dict, what: str, suffix: str = "") -> list:
    """[lo, hi] of ``estimates``' output for the report (an estimate that has one); an unbounded end (inf) as null."""
    return [v if np.isfinite(v) else None for v in (est[f"{what}_lo{suffix}"], est[f"{what}_hi{suffix}"])]
