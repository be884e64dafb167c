"""The depth rule and the calibrated 90 % intervals of L_hat and P_hat (issue 13; not in the paper).

Two depth estimators, both the paper's (``nv.phase2.evaluation.held_out``): the basic estimator of §4.2 and
Eq. 10. The rule (``rule_order``, ``choose_rule``) takes the basic estimator, the one that fits fewer parameters of
the target (its intercept is the references'), unless Eq. 10 is the more accurate on significantly many of the
calibration's own reference models (a sign test, one vote a model), each held out on every platform it was timed
on (the validation; the live attack's calibration file, ``nv.phase2.calibration``, is the reference platform's
alone, so there it tests that platform's references, where its beta, alpha and half-widths come from); then the
first of the two that gives the target a depth: what the attacker can decide from the data it has. Pooling the
platforms lets a model's rows on both speak in its one vote (the default profile's llama.cpp platform times three
of the seven references). What separates the
estimators is structural (a borrowed against a free intercept), and in every run the README records before
2026-12-06 the in-process references' median error was the basic estimator's the lower (4-16 % against 17-41 %);
the medians alone (``rule_scores``, reported) tied in a fresh clone's run and chose Eq. 10 (``rule_order``). An
estimator "gives a depth" when its fit puts L_hat at least two standard errors above 0 (``significant``). P_ne_hat follows from each depth by the prefill curve (``nv.phase2.prefill``).

Intervals: each estimator's jackknife interval x exp(+-q), q the largest leave-one-out |log(x / truth)| of the n
references it gives a depth (``conformal``; nominal level n / (n + 1) for a target exchangeable with them that it
also gives one: the attacker sees whether it does). A target of another
family moves the two estimators apart, so the headline interval is the ``hull`` of both estimators' intervals, and
the rule's estimator's alone is kept beside it (``_rule``). ``estimates`` applies both to arrays of cases (the
validation) or to one target (the live attack); P spans the tied and untied totals, tying being invisible in time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from nv.errors import NVError
from nv.phase2 import prefill
from nv.phase2.evaluation import calibrates, held_out

ESTIMATORS = {"basic": "L_hat", "eq10": "L_hat_eq10"}
T_KEYS = {"basic": "t", "eq10": "t_eq10"}  # held_out's t-statistic of each estimator's fit
MIN_T = 2.0  # a depth fit under two of its standard errors above 0 is none (``significant``)
SIGN_TEST_ALPHA = 0.05  # Eq. 10 takes the basic estimator's place only on a significant sign test (``rule_order``)


def conformal(estimates: np.ndarray, truths: np.ndarray) -> float:
    """The largest leave-one-out |log(estimate / truth)| of the n calibration models the estimator gives a positive
    estimate: the half-width of a jackknife interval around the target's estimate from all n (conditioned on what the
    attacker sees of the target: its own fit succeeded). Its nominal level, n / (n + 1) (86-88 % for 6-7 models, the
    closest this family size comes to 90 %), is split conformal's, which holds here only as far as leaving one
    reference out barely moves the fit: the target is fitted on all n, its residuals on n - 1 (the guaranteed level of
    the jackknife+, which refits the target without each reference, is (n - 1) / (n + 1), 71-75 %); the validation
    measures the coverage itself. Infinite with fewer than 2 such models. Counting a
    model without a fit as an infinite residual instead made every interval of that estimator unbounded whenever one
    reference failed (the smallest, whose prefill times fall below the others' intercept alpha: README, "Validation
    across models")."""
    ok = np.isfinite(estimates) & (estimates > 0)
    return float(np.max(np.abs(np.log(estimates[ok] / truths[ok])))) if ok.sum() >= 2 else np.inf


def significant(L_hat: float, t: float) -> float:
    """L_hat where its fit puts it at least ``MIN_T`` standard errors above 0 (``t``: the basic estimator's
    ``depth_basic_t``, Eq. 10's gamma_g / se), else NaN: no depth, as for L_hat <= 0. A fit that cannot tell the
    depth from zero is a failed one; counted as an estimate it made the conformal half-width of its estimator, and
    the hull, span two orders of magnitude (in process ref-1024x16's Eq. 10 read 0.8 for 16 at t = 0.2, and
    ref-384x12's basic 0.1 for 12 at t = 0.1, where every other fit of either estimator had t >= 5: any threshold
    from 1 to 5 separates them alike; 2 is the conventional one)."""
    return L_hat if t >= MIN_T else np.nan


def hull(estimates: list, q: list) -> tuple[np.ndarray, np.ndarray]:
    """The smallest interval holding each estimator's conformal interval [x exp(-q_x), x exp(q_x)] (arrays over cases;
    an estimator without a positive estimate is left out; none: NaN; an infinite q_x: [0, inf])."""
    x = np.asarray(estimates, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    q = np.broadcast_to(q.reshape(q.shape + (1,) * (x.ndim - q.ndim)), x.shape)  # one q per estimator, or per case
    ok = np.isfinite(x) & (x > 0)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = np.where(ok, x * np.exp(-q), np.inf).min(axis=0)
        hi = np.where(ok, x * np.exp(q), -np.inf).max(axis=0)
    none = ~ok.any(axis=0)
    return np.where(none, np.nan, lo), np.where(none, np.nan, hi)


def held_out_all(recs: dict[str, list[dict]], g: dict, timing: dict) -> dict:
    """``held_out`` for record ``g`` on its platform, each estimator's L_hat kept where ``significant`` (a note
    where not), plus the attacker-side P_ne_hat of both, the prefill curve calibrated on the other references of
    g's platform."""
    reference = next(iter(recs))
    row = held_out(recs[reference], recs[g["platform"]], g, timing, "d_used") | {"P_ne_true": prefill.non_embedding_params(g)}
    for name, key in ESTIMATORS.items():
        L_hat = row.get(key, np.nan)
        row[key] = significant(L_hat, row.get(T_KEYS[name], np.nan))
        if np.isfinite(L_hat) and np.isnan(row[key]):
            row[f"note_t_{name}"] = f"{name}: L_hat = {L_hat:.3g} is under {MIN_T:g} standard errors above 0: no depth"
    refs = [r for r in recs[g["platform"]] if calibrates(r, g)]
    try:
        cal = prefill.calibrate(refs)
    except NVError as exc:  # no attacker-side P_ne_hat: reported, not fatal
        return row | {"note_prefill": str(exc)}
    notes = []
    for name, key in ESTIMATORS.items():
        L_hat = row.get(key, np.nan)
        if np.isfinite(L_hat) and L_hat > 0:
            row[f"P_ne_hat_{name}"] = P_ne = prefill.non_embedding_hat(cal, g["ell"], g["T"], g["sigma"], g["d_used"], L_hat)
            if not P_ne > 0:
                notes.append(f"no positive P_ne_hat at the {name} estimator's L_hat = {L_hat:.3g}")
    return row | ({"note_prefill": "; ".join(notes)} if notes else {})


def _columns(rows: list[dict], *names: str) -> list[np.ndarray]:
    """Columns of the references' ``held_out_all`` rows as float arrays (NaN where a row lacks the key)."""
    table = pd.DataFrame(rows)
    return [table.get(name, pd.Series(np.nan, index=table.index)).to_numpy(float) for name in names]


def rule_scores(rows: list[dict]) -> dict[str, float]:
    """From the references' ``held_out_all`` rows (each held out in turn: the attacker's error estimate), per
    estimator its median |L_hat / L - 1| over those it gives a depth (inf without any), reported beside the rule's
    choice (``rule_order``)."""
    scores = {}
    for name, key in ESTIMATORS.items():
        L_hat, L = _columns(rows, key, "L_true")
        err = np.abs(L_hat / L - 1)
        scores[name] = float(np.nanmedian(err)) if np.isfinite(err).any() else np.inf
    return scores


def half_widths(rows: list[dict]) -> dict[str, float]:
    """From the same rows, per estimator the conformal half-widths ``q_L_<name>``, ``q_P_<name>`` of L and P_ne."""
    q = {}
    for name, key in ESTIMATORS.items():
        L_hat, L, P_ne_hat, P_ne = _columns(rows, key, "L_true", f"P_ne_hat_{name}", "P_ne_true")
        q[f"q_L_{name}"], q[f"q_P_{name}"] = conformal(L_hat, L), conformal(P_ne_hat, P_ne)
    return q


def rule_order(rows: list[dict]) -> list[str]:
    """The rule's estimators in order of preference, from the references' ``held_out_all`` rows: the basic estimator
    first (§4.2; it fits the target's slope alone, its intercept borrowed), unless Eq. 10 (slope and intercept of the
    target) is the more accurate on significantly many reference models: a one-sided sign test at ``SIGN_TEST_ALPHA``
    over the models, each held-out row (a model on one platform) either estimator gives a depth won by the smaller
    |L_hat / L - 1| or by the one estimator with a depth, and a model timed on several platforms voting once, by its
    rows' wins minus losses (ties for neither). The medians of ``rule_scores`` decided until 2026-12-06; they tie
    within the noise of a few references (a fresh clone's run: 0.151 against 0.142 for Eq. 10, which then read both
    targets ~-46 %, the basic estimator -4.8 % and +10.3 %; Eq. 10 won 2 of its 7 models, one tied)."""
    basic, eq10, L = _columns(rows, ESTIMATORS["basic"], ESTIMATORS["eq10"], "L_true")
    with np.errstate(invalid="ignore"):
        e_basic, e_eq10 = (np.where(np.isfinite(x), np.abs(x / L - 1), np.inf) for x in (basic, eq10))
    votes: dict = {}
    for i, (row, b, e) in enumerate(zip(rows, e_basic, e_eq10)):
        if np.isfinite(b) or np.isfinite(e):
            key = row.get("model", i)
            votes[key] = votes.get(key, 0) + int(e < b) - int(e > b)
    wins, losses = sum(v > 0 for v in votes.values()), sum(v < 0 for v in votes.values())
    if wins + losses and stats.binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue < SIGN_TEST_ALPHA:
        return ["eq10", "basic"]
    return ["basic", "eq10"]


def choose_rule(order: list[str], row: dict) -> str:
    """The rule's estimator: the first of ``order`` (``rule_order``) that gives the target a depth (``row``: its
    ``L_hat``, ``L_hat_eq10``); the first when none does. An estimator whose fit on the target is not positive
    (noted) yields to the other, as an attacker would."""
    return next((name for name in order if row.get(ESTIMATORS[name], np.nan) > 0), order[0])


def estimates(L_hat: dict, P_ne_hat: dict, q: dict, rule, d_hat, V) -> dict[str, np.ndarray]:
    """The headline L_hat and P_hat (the rule's estimator's) with their 90 % intervals: ``L_lo``/``L_hi`` and
    ``P_lo``/``P_hi`` the hull of both estimators', ``..._rule`` the rule's alone. ``L_hat``, ``P_ne_hat``: per
    estimator name, arrays over cases (or scalars); ``q``: ``half_widths``'s output; ``rule``: the
    estimator name per case. P_hat is the midpoint of the tied and untied totals (``prefill.param_range``)."""
    rule = np.asarray(rule)

    def pick(values: dict) -> np.ndarray:
        return np.select([rule == name for name in ESTIMATORS], [np.asarray(values[name], np.float64) for name in ESTIMATORS], np.nan)

    q_L, q_P = ({name: q[f"q_{w}_{name}"] for name in ESTIMATORS} for w in ("L", "P"))
    L, P_ne, qL, qP = pick(L_hat), pick(P_ne_hat), pick(q_L), pick(q_P)
    out = {"L_hat": L, "L_lo_rule": L * np.exp(-qL), "L_hi_rule": L * np.exp(qL)}
    out["L_lo"], out["L_hi"] = hull([L_hat[name] for name in ESTIMATORS], list(q_L.values()))
    out["P_hat"] = prefill.param_range(P_ne, d_hat, V)[2]
    out["P_lo_rule"] = prefill.param_range(P_ne * np.exp(-qP), d_hat, V)[0]
    out["P_hi_rule"] = prefill.param_range(P_ne * np.exp(qP), d_hat, V)[1]
    P_ne_lo, P_ne_hi = hull([P_ne_hat[name] for name in ESTIMATORS], list(q_P.values()))
    out["P_lo"], out["P_hi"] = prefill.param_range(P_ne_lo, d_hat, V)[0], prefill.param_range(P_ne_hi, d_hat, V)[1]
    return out
