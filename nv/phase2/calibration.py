"""The calibration file (``outputs/timing_fit/calibration.json``): what phase 2 on a new target needs from the
reference family, written by the timing_fit stage (``calibration``) and read by ``nv attack --timing-calibration``
(``load_calibration``, one-line errors for anything else)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.outputs import read_json
from nv.params import check_timing_protocol
from nv.phase2 import prefill
from nv.phase2.evaluation import timings
from nv.phase2.fit import fit_gamma, fit_scaling
from nv.phase2.intervals import ESTIMATORS, half_widths, held_out_all, rule_order, rule_scores

PROTOCOL_KEYS = ("r", "trials", "warmups", "trim", "n_lengths", "discard", "kv_ratio", "ffn_ratio")
ERROR_KEYS = tuple(f"{w}_{name}" for w in ("score", "q_L", "q_P") for name in ESTIMATORS)
CALIBRATION_KEYS = ("platform", "beta", "alpha", *PROTOCOL_KEYS, "prefill", *ERROR_KEYS, "rule_order")


def calibration(records: dict[str, list[dict]], timing: dict) -> dict:
    """What a new target needs from phase 2's references (``outputs/timing_fit/calibration.json``), all from the
    references on the reference platform (the first): beta, alpha of Eq. 2 and gamma^ref of Eq. 6; the protocol
    (that platform's r and K, the sweep and fit settings) to time the target the same way; the prefill curve's
    b, c, a (``nv.phase2.prefill``; null when its fit fails); and, each reference held out in turn, the rule's order
    of the estimators, their median errors and the conformal half-widths of ``nv.phase2.intervals``
    (``rule_order``, ``score_<estimator>``, ``q_L_<estimator>``, ``q_P_<estimator>``; null where infinite: fewer
    than two references with a fit), on that platform alone (the validation pools every platform's references for
    the rule: it evaluates targets on each, a live attack on one)."""
    platform = next(iter(records))
    references = [r for r in records[platform] if r["role"] == "reference"]
    refs = timings(references, timing["discard"], "d")
    beta, gamma = fit_scaling(refs.L, refs.d, refs.ell, refs.T, refs.sigma), fit_gamma(refs.d, refs.ell, refs.T, refs.sigma)
    held = [held_out_all({platform: references}, r, timing) for r in references]
    scores, order, q = rule_scores(held), rule_order(held), half_widths(held)
    try:
        fit = prefill.calibrate(references)
        curve = {"b": fit.b, "c": fit.c, "a": fit.a}
    except NVError:
        curve = None
    errors = {f"score_{name}": value for name, value in scores.items()} | q
    return {"platform": platform, "beta": beta.slope, "alpha": beta.intercept, "gamma_ref": gamma.slope,
            **{k: timing["platforms"][platform][k] for k in ("r", "trials")},
            **{k: timing[k] for k in PROTOCOL_KEYS[2:]}, "prefill": curve,
            **{k: float(v) if np.isfinite(v) else None for k, v in errors.items()}, "rule_order": order}


def load_calibration(path: Path) -> dict:
    """A ``calibration.json`` written by the timing_fit stage; one-line errors for anything else."""
    cal = read_json(Path(path), "timing_fit")
    missing = [k for k in CALIBRATION_KEYS if not isinstance(cal, dict) or k not in cal]
    if missing:
        raise NVError(f"timing calibration {path} lacks {missing}: use outputs/timing_fit/calibration.json "
                      "(one written by an older version: rerun `dvc repro timing_fit`)")
    problems = [f"{k} = {cal[k]!r} is not a finite number" for k in ("beta", "alpha") if not _number(cal[k])]
    problems += [f"{k} = {cal[k]!r} is not a number >= 0 or null" for k in ERROR_KEYS
                 if cal[k] is not None and not (_number(cal[k]) and cal[k] >= 0)]
    if not (isinstance(cal["rule_order"], list) and sorted(map(str, cal["rule_order"])) == sorted(ESTIMATORS)):
        problems.append(f"rule_order = {cal['rule_order']!r} is not an order of {sorted(ESTIMATORS)}")
    curve = cal["prefill"]
    if curve is not None and not (isinstance(curve, dict) and all(_number(curve.get(k)) for k in "bca")
                                  and curve["b"] > 0 and curve["c"] > 0):
        problems.append(f"prefill = {curve!r} is neither null nor finite b > 0, c > 0, a")
    if problems:
        raise NVError(f"timing calibration {path}: {problems[0]}: use outputs/timing_fit/calibration.json")
    # the protocol as params.yaml's timing section allows it, checked before phase 1 pays for anything
    try:
        check_timing_protocol({k: cal[k] for k in PROTOCOL_KEYS}, f"timing calibration {path}")
    except NVError as exc:
        raise NVError(f"{exc}: use outputs/timing_fit/calibration.json") from None
    if not cal["beta"] > 0:
        raise NVError(f"timing calibration {path} has beta = {cal['beta']}: its reference fit failed")
    return cal


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
