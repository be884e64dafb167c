"""The defences stage (issue 15; README: Defences): every knob of ``nv.oracle.defence`` swept over its
settings, the attack's outcome with and without its counter-measure, and the provider's price.

Each knob is applied post hoc to what the undefended run observed, where that is exact in distribution:

- log-prob rounding (``round_decimals``, ``round_format``) and ``min_logprob`` are deterministic in each call's
  value y, and every call of a token reports the same y: they act on Y_hat's entries directly.
- ``noise_sigma``: fresh N(0, sigma^2) per call, clipped at 0 (``nv.oracle.defence.report_calls``). Averaged over the
  c calls that drew a token (the counter-measure, what ``DefendedOracle`` serves) it is the mean of c clipped values
  (``clipped_noise_mean``; y + N(0, sigma^2 / c) where the clip binds on no call); without it the attacker keeps one
  call's value.
- Each knob is swept alone, and the emulation is exact for one knob at a time: together, ``DefendedOracle`` rounds
  each noisy call before the mean and thresholds the reported value, where this sweep rounds the mean and
  thresholds y.
- truncation (``top_k``, ``top_p``, ``min_p``): a draw outside the served set S_q is never made. Of N untruncated
  calls, those that fell in S_q are distributed as truncated calls: the attack pays for N calls and keeps the draws
  inside S_q, fewer than N truncated calls would give (``short_rows`` counts the prompts with fewer than N).
- timing knobs act on each trial of the target's App. D record (``defend_record``): delays and quantisation as
  ``DefendedOracle.time_request`` applies them; padding moves each trial along the target's own measured latency
  curve to the padded length (``_latency_curve``: interpolated, beyond the longest length a fitted quadratic's rise). The counter-measure against delays
  and padding keeps each length's fastest trials (``fastest``): a delay is never negative, so the fastest trials
  carry the least of it. Against a quantised clock it is physics: each trial's prompt is lengthened by a random
  0..u tokens, u the tokens one quantum of latency buys (``dither_tokens``), so a length's trials spread evenly over
  a quantum and their mean carries the quantisation only as a constant (the ell = 1 baseline is not dithered: an
  offset of at most q remains), and sigma_T is kept at least at the clock's own error (``_summarised``).
- "10x": ten times the phase-1 budget is emulated for noise only (sigma / sqrt(10): ten times the calls per observed
  token; the columns they would add are not); for timing, ten times the trials per length: every measured trial
  counted ten times with fresh defence draws (sigma_T scaled by 1/sqrt(10)). The other log-prob knobs are
  deterministic per value: the cell is left empty.

- tokens to exactness (``adaptive_phase1``): where the adaptive loop (``sampling.N: auto``) would stop behind each
  log-prob setting, replayed on the defended draws down from their N (``nv.phase1.exactness.adaptive_replays``).
  Both it and the sweep at N see the draws through ``defended_common``: only the common set's entries are defended,
  and the draws are not copied.

Outcomes: phase 1 as ``nv.phase1.exactness.outcome`` ("exact": d within the detector's interval around d_hat_raw,
"not saturated" with a lower bound at most d, "wrong" otherwise; the paper estimator's "no estimate"), marked "leaks
d" where the answer still gives d away (``leaks_d``); phase 2 "stopped" when |L_hat - L| / L exceeds
``L_tolerance``.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.optimize import lsq_linear
from scipy.stats import norm

from nv.oracle.defence import (TIMING_KNOBS, Defence, mean_added_latency_ms, quantise, report_calls,
                               sampling_price, served_log_probs)
from nv.oracle.simulator import log_softmax
from nv.params import check_knobs
from nv.phase1.adaptive import schedule
from nv.phase1.exactness import adaptive_replays, adaptive_stop, outcome
from nv.phase1.pipeline import common_set, estimate_both
from nv.phase1.prune import greedy_prune
from nv.phase1.sampling import SampledMatrix, sample_budget
from nv.phase1.spectrum import d_interval, snap
from nv.phase2.evaluation import held_out
from nv.phase2.protocol import BASELINE, LengthTimings, summarize

LOGPROB_KNOBS = ("round_decimals", "round_format", "noise_sigma", "min_logprob", "top_k", "top_p", "min_p")
_PRICE_KEY = 2**32 - 2  # the price's stream: a spawn key that neither the rows' default_rng([seed, i]) nor
                        # nv.oracle.defence's streams (led by 2**32 - 1) reach
TENFOLD = 10


def settings(sweep: dict) -> list[tuple[str, object]]:
    """(knob, value) of every swept setting, params order; ``("none", None)`` first (the undefended row)."""
    check_knobs(sweep)  # one schema: params.yaml's defence section checks every value
    return [("none", None)] + [(knob, v) for knob, values in sweep.items() for v in values]


def label(value) -> str:
    """A setting as the tables show it (the undefended row: empty)."""
    return "" if value is None else str(value)


# -- phase 1 -------------------------------------------------------------------------------------------

def served_sets(log_probs_T1: np.ndarray, temperature: float, defence: Defence) -> np.ndarray:
    """Per prompt (rows of T = 1 log-probs or logits), the tokens the provider can sample at ``temperature``."""
    return np.stack([np.isfinite(served_log_probs(y, temperature, defence)) for y in log_probs_T1])


def kept(S: SampledMatrix, served: np.ndarray | None, min_logprob: float | None) -> np.ndarray:
    """Per stored entry of S (CSR order): drawn inside its prompt's served set ``served`` (None: every token) and
    not withheld (its value >= ``min_logprob``; None: every value)."""
    counts = S.counts.tocsr()
    keep = np.ones(counts.nnz, dtype=bool)
    if served is not None:
        for q in range(S.D):  # per prompt: a (prompt, token) index array over every entry would cost 8 bytes each
            part = slice(counts.indptr[q], counts.indptr[q + 1])
            keep[part] = served[q, counts.indices[part]]
    if min_logprob is not None:
        keep &= S.logprobs.tocsr().data >= min_logprob
    return keep


def short_rows(S: SampledMatrix, served: np.ndarray) -> int:
    """Prompts of S with fewer than S.N of their draws inside their served set ``served``."""
    counts = S.counts.tocsr()
    inside = sp.csr_matrix((np.where(kept(S, served, None), counts.data, 0), counts.indices, counts.indptr),
                           shape=counts.shape)
    return int(np.count_nonzero(np.asarray(inside.sum(axis=1)).ravel() < S.N))


def clipped_noise_mean(y: np.ndarray, sigma: float, calls: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The mean of ``calls`` calls' values min(y + N(0, sigma^2), 0) (``report_calls``' noise, clipped at 0): one call
    drawn exactly; more by the normal limit of their mean, with the clipped normal's mean y Phi(a) - sigma phi(a) and
    variance (a = -y / sigma), which is y + N(0, sigma^2 / calls) where the clip binds on no call. (The limit is
    exact to a few 10^-3 nats where the clip binds, a token drawn in most calls: c >= 10^3 at every N the stage runs.)"""
    y, calls = np.asarray(y, dtype=np.float64), np.asarray(calls, dtype=np.float64)
    a = -y / sigma
    Phi, phi = norm.cdf(a), norm.pdf(a)
    mean = y * Phi - sigma * phi
    var = np.maximum(y * y * Phi - 2 * y * sigma * phi + sigma**2 * (Phi - a * phi) - mean**2, 0.0)
    z = rng.standard_normal(y.shape)
    return np.minimum(np.where(calls == 1, y + sigma * z, mean + np.sqrt(var / calls) * z), 0.0)  # a mean of values <= 0


def reported_values(y: np.ndarray, c: np.ndarray, defence: Defence, averaged: bool, rng: np.random.Generator,
                    calls_scale: float = 1.0) -> np.ndarray:
    """Observed values y of tokens drawn c times as the defended API reports them (float64): noise, then rounding.
    Noise: the mean of c calls_scale calls' clipped values (``clipped_noise_mean``) when ``averaged`` (the
    counter-measure: ``nv.oracle.defence.reported_logprobs`` in distribution), else one call's."""
    values = np.asarray(y, dtype=np.float64)
    if defence.noise_sigma:
        per = (c if averaged else np.ones_like(c)) * calls_scale
        values = clipped_noise_mean(values, defence.noise_sigma, per, rng)
    return quantise(values, defence)


def defended_common(defence: Defence, served: np.ndarray | None, seed: list[int], averaged: bool = True,
                    calls_scale: float = 1.0):
    """Draws S -> the common-set matrix Y the attacker estimates from through ``defence``: the pattern of S's draws
    inside the served sets ``served`` (None: every token; a truncated call is never made outside them) and not
    withheld (``min_logprob``), pruned (Alg. 1); noise and rounding (``reported_values``, ``averaged`` and
    ``calls_scale`` its counter-measure) on Y's entries only, seeded by (``seed``, S.N). Every other entry of Y_hat is
    never read, so S is not copied."""
    def common(S: SampledMatrix) -> np.ndarray:
        counts = S.counts.tocsr()
        observed = counts
        if served is not None or defence.min_logprob is not None:  # pruning drops the zeros
            observed = sp.csr_matrix((kept(S, served, defence.min_logprob), counts.indices, counts.indptr), shape=counts.shape)
        cs = common_set(S, greedy_prune(observed))
        block = counts[:, cs.pruned.cols][cs.pruned.rows].toarray()  # columns first, as common_set
        values = reported_values(cs.Y, block, defence, averaged, np.random.default_rng([*seed, S.N]), calls_scale)
        return values.astype(np.float32).astype(np.float64)  # stored as Y_hat stores them (float32)
    return common


def sweep_phase1(S: SampledMatrix, knobs: list[tuple[str, object]], spectrum: dict, d_true: int, seed: int,
                 log_probs_T1: np.ndarray | None) -> pd.DataFrame:
    """Every log-prob knob setting on the undefended draws S at their N (``defended_common``), with and without its
    counter-measure where it has one, and at 10x the budget where emulable; both estimators on each. ``log_probs_T1``:
    the prompts' T = 1 log-probs (truncation sets)."""
    rows = []
    for knob, value in knobs:
        if knob not in LOGPROB_KNOBS and knob != "none":
            continue
        defence = Defence(**({knob: value} if knob != "none" else {}))
        served = served_sets(log_probs_T1, S.temperature, defence) if defence.truncates else None
        short = short_rows(S, served) if served is not None else 0
        variants = {"attack": (True, 1.0)}
        if knob == "noise_sigma":
            variants = {"no_counter": (False, 1.0), "attack": (True, 1.0), "attack_10x": (True, float(TENFOLD))}
        for variant, (averaged, scale) in variants.items():
            Y = defended_common(defence, served, [seed, len(rows)], averaged, scale)(S)
            row = {"knob": knob, "setting": label(value), "variant": variant, "short_rows": short, "D_prime": Y.shape[0],
                   "C": Y.shape[1], "tokens": S.tokens(), "calls": S.calls()}
            for method, e in estimate_both(Y, spectrum).items():
                row |= {f"{method}_outcome": outcome(e, d_true), f"{method}_d_hat_raw": e.d_hat_raw,
                        f"{method}_lower_bound": e.lower_bound}
            rows.append(row)
    return pd.DataFrame(rows)


def adaptive_phase1(folder, p1: pd.DataFrame, knobs: list[tuple[str, object]], sampling: dict, robust: dict,
                    d_true: int, seed: int, log_probs_T1: np.ndarray | None) -> pd.DataFrame:
    """Tokens to exactness under adaptive sampling (``sampling.N: auto``), per log-prob setting with the attack's
    counter-measure, on the draws stored in ``folder`` (N calls a prompt; never held beside a round: each round
    thinned from disk, one at the stored N the stored sample itself): the round the loop stops at, its cost and estimate, or
    the last round's lower bound. Undefended: the loop's own stop (``exactness.adaptive_stop``: its record, else its
    replay). A setting whose cell at N in the sweep ``p1`` (``sweep_phase1``, with the counter-measure) is not
    saturated cannot stop within the draws (the replay's premise: fewer calls do not saturate what more did not) where
    N is one of the loop's rounds (a stored N off its grid is no round: such a setting is replayed too); the
    others are replayed on their defended draws (``exactness.adaptive_replays``, down from N). A truncated round keeps
    its N_r calls' draws inside the served sets (N_r times the served mass, as ``sweep_phase1`` at N): the attack
    pays for N_r calls and keeps fewer."""
    budget = sample_budget(folder)
    plan = schedule(sampling["N0"], sampling["N_max"], sampling["growth"])
    on_grid = budget["N"] in plan  # the sweep's cell at N is then the loop's top round within the draws
    at_top = p1[p1.variant == "attack"].set_index(["knob", "setting"])
    views, rows = {}, {}
    for i, (knob, value) in enumerate(knobs):
        key = (knob, label(value))
        if knob == "none":
            rounds, why = adaptive_stop(folder, sampling, robust, seed)
            rows[key] = (rounds, why)
        elif knob in LOGPROB_KNOBS and on_grid and pd.isna(at_top.loc[key, "robust_d_hat_raw"]):
            rows[key] = ([{"N": budget["N"], "tokens": budget["tokens"], "calls": budget["calls"],
                           "lower_bound": at_top.loc[key, "robust_lower_bound"]}],
                         "N_max" if budget["N"] == plan[-1] else "stored draws")
        elif knob in LOGPROB_KNOBS:
            defence = Defence(**{knob: value})
            served = served_sets(log_probs_T1, budget["temperature"], defence) if defence.truncates else None
            views[key], rows[key] = defended_common(defence, served, [seed, i]), None  # rows keep the params order
    for key, (rounds, why) in adaptive_replays(folder, sampling, robust, seed, views).items():
        rows[key] = ([asdict(r) for r in rounds], why)
    out = []
    for (knob, setting), (rounds, why) in rows.items():
        row = {"knob": knob, "setting": setting, "stop": why, "N": None, "tokens": None, "calls": None,
               "d_hat_raw": None, "lower_bound": None, "outcome": f"no stop by N = {budget['N']:,}"}
        if rounds:  # the loop's last round (its next is past the draws where it did not stop)
            last = rounds[-1]
            row |= {"N": last["N"], "tokens": last["tokens"], "calls": last["calls"], "lower_bound": last["lower_bound"],
                    "outcome": f"no stop by N = {last['N']:,}"}
        if why == "stable":
            lo, hi = d_interval(last["d_hat_raw"], None)
            row |= {"d_hat_raw": last["d_hat_raw"], "lower_bound": None,
                    "outcome": "exact" if lo <= d_true <= hi else "wrong"}
        out.append(row)
    return pd.DataFrame(out)


# -- phase 2 -------------------------------------------------------------------------------------------

def _latency_curve(record: dict):
    """The target's undefended latency as a function of prompt tokens, one model for the defended trials and the
    price: its mean measured latencies (App. D's sweep) joined piecewise linearly, beyond the longest the rise of
    a + b ell + c ell^2 (b, c >= 0) fitted to them: Eq. 2's attention term in ell^2 beside the projections' and MLP's
    linear one (Eq. 11's crossover), unweighted as the means are (a last segment's own slope, noisy and possibly
    negative, would make a padded prompt faster); with the slope of a line through them (the attacker's
    ``dither_tokens``)."""
    ell = np.array([np.mean(r["ell"]) for r in record["rows"]])
    t = np.array([np.mean(r["seconds"]) for r in record["rows"]])
    order = np.argsort(ell)
    ell, t = ell[order], t[order]
    u = ell / ell[-1]  # the law in units of the longest length, for a well-conditioned fit
    _, b, c = lsq_linear(np.stack([np.ones_like(u), u, u**2], axis=1), t, bounds=([-np.inf, 0, 0], np.inf)).x

    def curve(x):
        x = np.asarray(x, dtype=np.float64)
        v = x / ell[-1]
        return np.where(x > ell[-1], t[-1] + b * (v - 1) + c * (v**2 - 1), np.interp(x, ell, t))
    return curve, float(np.polyfit(ell, t, 1)[0])


def dither_tokens(quantum_ms: float, s_per_token: float) -> int:
    """u: the prompt tokens whose prefill spans one quantum of latency (the attacker reads q off the reported values
    and the slope off a first sweep)."""
    return max(1, math.ceil(quantum_ms / 1000.0 / s_per_token))


def defend_record(record: dict, defence: Defence, rng: np.random.Generator, repeat: int = 1,
                  dither: int = 0) -> list[LengthTimings]:
    """The target's App. D trials as the defended API reports them; ``repeat`` > 1 counts every measured trial that
    many times, each copy with fresh defence draws (the defence's randomness at ``repeat`` x the trials; the natural
    jitter is not re-measured). ``dither`` > 0: the attacker lengthens each trial's prompt (the ell = 1 baseline's
    aside) by a uniform 0..dither tokens, the trial moved along the measured latency curve."""
    curve, _ = _latency_curve(record)
    rows = []
    for r in record["rows"]:
        ell = np.tile(np.asarray(r["ell"], dtype=np.float64), repeat)
        seconds = np.tile(np.asarray(r["seconds"], dtype=np.float64), repeat)
        if dither and r["target"] != BASELINE:
            longer = ell + rng.integers(0, dither + 1, ell.size)
            seconds, ell = seconds + curve(longer) - curve(ell), longer
        if defence.pad_to_tokens is not None:
            padded = np.ceil(ell / defence.pad_to_tokens) * defence.pad_to_tokens
            seconds = seconds + curve(padded) - curve(ell)
        if defence.delay_uniform_ms is not None:
            seconds = seconds + rng.uniform(0.0, defence.delay_uniform_ms, seconds.size) / 1000.0
        if defence.delay_exp_ms is not None:
            seconds = seconds + rng.exponential(defence.delay_exp_ms, seconds.size) / 1000.0
        if defence.latency_quantum_ms is not None:
            q = defence.latency_quantum_ms
            seconds = np.ceil(np.round(seconds * 1000.0 / q, 9)) * q / 1000.0
        rows.append(LengthTimings(r["target"], ell.tolist(), seconds.tolist()))
    return rows


def fastest(rows: list[LengthTimings], fraction: float) -> list[LengthTimings]:
    """The counter-measure against one-sided delays: per length, only the fastest ceil(fraction K) trials (>= 3)."""
    out = []
    for r in rows:
        order = np.argsort(r.seconds, kind="stable")[: max(3, math.ceil(fraction * len(r.seconds)))]
        out.append(LengthTimings(r.target, [r.ell[i] for i in order], [r.seconds[i] for i in order]))
    return out


def _summarised(record: dict, rows: list[LengthTimings], trim: float, fraction: float | None, repeat: int,
                resolution_s: float = 0.0) -> dict:
    """The record re-summarised (App. D) from defended trials, with the plain trimmed mean or, with ``fraction``, the
    mean of the fastest trials. At ``repeat`` x the trials, sigma_T is that of the first copy over sqrt(repeat): the
    copies share their natural jitter, so their own spread would overstate the precision. ``resolution_s``: a clock
    step q the attacker has seen; sigma_T is kept at least q / sqrt(12 K), a quantised clock's own error, where K
    trials that fell in one step would claim zero (and weigh infinitely in the fits)."""
    def stats(rs):
        return summarize(fastest(rs, fraction), 0.0) if fraction else summarize(rs, trim)

    full = stats(rows)
    K = len(rows[0].seconds) // repeat
    sigma = np.maximum(stats([LengthTimings(r.target, r.ell[:K], r.seconds[:K]) for r in rows])["sigma"],
                       resolution_s / math.sqrt(12 * K)) / math.sqrt(repeat)
    return record | {"rows": [r.__dict__ for r in rows], "ell": full["ell"].tolist(), "T": full["T"].tolist(),
                     "sigma": sigma.tolist(), "trials": len(rows[0].seconds), "tokens": int(full["tokens"])}


def sweep_phase2(records: dict[str, list[dict]], knobs: list[tuple[str, object]], timing: dict, fraction: float,
                 L_tolerance: float, seed: int, price_tokens: list[int]) -> pd.DataFrame:
    """Every timing knob setting on the target's reference-platform record: L_hat (the basic estimator, §4.2) and
    P_hat with the plain statistic (``no_counter``: App. D's trimmed mean), with the counter-measure (``attack``: the
    fastest trials, or the length dither against ``latency_quantum_ms``) and with it at 10x the trials
    (``attack_10x``); the provider's mean added latency on honest calls of ``price_tokens`` prompt tokens, their
    latencies read off the target's measured curve."""
    platform = next(iter(records))
    recs = records[platform]
    target = next(r for r in recs if r["role"] == "target")
    curve, s_per_token = _latency_curve(target)
    rows = []
    for knob, value in knobs:
        if knob not in TIMING_KNOBS and knob != "none":
            continue
        defence = Defence(**({knob: value} if knob != "none" else {}))
        # the counter-measure: the fastest trials, or against a quantised clock a length dither with the plain statistic
        # and sigma_T kept at the clock's own error
        quantum = value if knob == "latency_quantum_ms" else None
        counter = (None, dither_tokens(quantum, s_per_token), quantum / 1000.0) if quantum else (fraction, 0, 0.0)
        variants = {"no_counter": (1, None, 0, 0.0), "attack": (1, *counter), "attack_10x": (TENFOLD, *counter)}
        for variant, (repeat, frac, u, resolution) in variants.items():
            rng = np.random.default_rng([seed, len(rows)])
            g = _summarised(target, defend_record(target, defence, rng, repeat, u), timing["trim"], frac, repeat, resolution)
            est = held_out(recs, [*[r for r in recs if r is not target], g], g, timing, "d_used")
            L_err = est.get("L_err", np.nan)
            rows.append({"knob": knob, "setting": label(value), "variant": variant, "trials": g["trials"], "L_true": g["L"],
                         "P_true": g["P"],
                         "L_hat": est.get("L_hat", np.nan), "L_err": L_err, "P_hat": est.get("P_hat_registry_raw", np.nan),
                         "P_err": est.get("P_err_registry_raw", np.nan), "note": est.get("note", ""),
                         "outcome": "works" if abs(L_err) <= L_tolerance else "stopped",
                         "added_ms": mean_added_latency_ms(defence, price_tokens, curve, seed)})
    return pd.DataFrame(rows)


# -- the provider's side and the tables ------------------------------------------------------------------

def logprob_price(log_probs_T1: np.ndarray, temperature: float, defence: Defence, seed: int,
                  calls: int = 4096) -> dict[str, float]:
    """The price of the log-prob knobs to users who read log-probs: over ``calls`` seeded calls per ordinary prompt at
    the users' ``temperature``, the mean |reported - true| log-prob of the sampled token (``report_calls``: noise
    clipped at 0, rounding) and the share of calls whose log-prob is withheld (``min_logprob``)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_PRICE_KEY,)))
    errors, withheld = [], []
    for y in log_probs_T1:
        log_p = log_softmax(np.asarray(y, dtype=np.float64) / temperature)
        drawn = log_p[rng.choice(log_p.size, calls, p=np.exp(log_p))]
        noise = defence.noise_sigma * rng.standard_normal(calls) if defence.noise_sigma else None
        v = report_calls(drawn, defence, noise)
        errors.append(np.abs(v - drawn)[~np.isnan(v)].mean() if (~np.isnan(v)).any() else np.nan)
        withheld.append(np.isnan(v).mean())
    return {"logprob_error": float(np.nanmean(errors)), "withheld": float(np.mean(withheld))}


def sampling_prices(log_probs_T1: np.ndarray, temperature: float, knobs: list[tuple[str, object]], seed: int) -> pd.DataFrame:
    """Per log-prob-side knob setting, its price on ordinary prompts at the users' ``temperature``: KL(q || p) and
    TV(q, p) of the served distribution (truncation; 0 for the knobs that change only what is reported) and what
    reaches users who read log-probs (``logprob_price``; 0 for truncation, whose reported values are untruncated)."""
    rows = []
    for knob, value in knobs:
        if knob not in LOGPROB_KNOBS:
            continue
        defence = Defence(**{knob: value})
        prices = [sampling_price(y, temperature, defence) for y in log_probs_T1] if defence.truncates else [{"kl": 0.0, "tv": 0.0}]
        reported = ({"logprob_error": 0.0, "withheld": 0.0} if defence.truncates
                    else logprob_price(log_probs_T1, temperature, defence, seed))
        rows.append({"knob": knob, "setting": label(value), "kl": float(np.mean([p["kl"] for p in prices])),
                     "tv": float(np.mean([p["tv"] for p in prices]))} | reported)
    return pd.DataFrame(rows)


def price_text(price: pd.Series) -> str:
    """A log-prob-side setting's price as the tables show it (``sampling_prices``' row)."""
    if price.kl > 0:
        return (f"KL {price.kl:.3g} nats, TV {price.tv:.3g}; requests with a logit bias, penalties, JSON mode or tools "
                "refused")
    parts = [f"log-probs off by {price.logprob_error:.2g} nats on average"] if price.logprob_error > 0 else []
    parts += [f"{100 * price.withheld:.2g} % of log-probs withheld"] if price.withheld > 0 else []
    return "; ".join(parts) or "none measured"


def leaks_d(lower_bound: int, d_true: int, g: int) -> bool:
    """Whether an answer below d still gives d away: hidden sizes are multiples of g, and Alg. 2 snaps up to the next
    one (``snap``), which is d for a lower bound, or a wrong estimate, within g below it."""
    return lower_bound <= d_true and snap(int(lower_bound), g) == d_true


def estimate_cell(outcome: str, raw, lower_bound, d_true: int, g: int) -> str:
    """A phase-1 outcome with its raw estimate or lower bound, marked "leaks d" where the answer, snapped up to g
    (``leaks_d``), is d: a lower bound within g below it, or a "wrong" estimate there."""
    if pd.notna(raw):
        leak = "leaks d: " if outcome == "wrong" and leaks_d(raw, d_true, g) else ""
        return f"{leak}{outcome} ({int(raw)})"
    if pd.isna(lower_bound):
        return outcome
    lb = int(lower_bound)
    if outcome == "not saturated" and leaks_d(lb, d_true, g):
        return f"leaks d: not saturated (d >= {lb}; the next multiple of {g} is d)"
    return f"{outcome} (d >= {lb})"


def adaptive_cell(row, d_true: int, g: int) -> str:
    """An ``adaptive_phase1`` row as the results table shows it."""
    if row.stop == "stable":
        return f"{row.outcome} ({int(row.d_hat_raw)}) at N = {int(row.N):,}, {row.tokens:.2g} tokens"
    past = "; its next round is past the stored draws" if row.stop == "stored draws" else ""
    if pd.isna(row.lower_bound):
        return f"{row.outcome}{past}"
    lb = int(row.lower_bound)
    return ("leaks d: " if leaks_d(lb, d_true, g) else "") + f"{row.outcome} (d >= {lb}{past})"


def results(p1: pd.DataFrame, p2: pd.DataFrame, prices: pd.DataFrame, adaptive: pd.DataFrame, estimator: str,
            d_true: int, g: int) -> pd.DataFrame:
    """``outputs/defences/results.csv``: one row per (knob, setting): the phase it targets, the attack's outcome
    without and with its counter-measure (and at 10x), where the adaptive attack stops (phase 1: tokens to
    exactness, ``adaptive_phase1``), and the provider's cost. A phase-1 answer that snaps up to d counts as a leak
    (``estimate_cell``); phase 2 gives L_hat and the P_hat of Eq. 3 that follows from it (the target's own ratios)."""
    stops_at = {(r.knob, r.setting): adaptive_cell(r, d_true, g) for r in adaptive.itertuples()}
    rows = []
    for (knob, setting), g1 in p1.groupby(["knob", "setting"], sort=False, dropna=False):
        v = g1.set_index("variant")
        def cell(variant):
            if variant not in v.index:
                return ""
            r = v.loc[variant]
            o = r[f"{estimator}_outcome"]
            raw = r[f"{estimator}_d_hat_raw"]
            return estimate_cell(o, raw, r[f"{estimator}_lower_bound"], d_true, g)
        price = prices[(prices.knob == knob) & (prices.setting == setting)]
        rows.append({"knob": knob, "setting": setting, "phase": 1, "without_counter": cell("no_counter") or cell("attack"),
                     "with_counter": cell("attack") if "no_counter" in v.index else "", "at_10x": cell("attack_10x"),
                     "adaptive": stops_at.get((knob, setting), ""), "paper_estimator": v.loc["attack", "paper_outcome"],
                     "cost": price_text(price.iloc[0]) if len(price) else "none"})
    for (knob, setting), g2 in p2.groupby(["knob", "setting"], sort=False, dropna=False):
        v = g2.set_index("variant")
        def cell(variant):
            r = v.loc[variant]
            # L_err is |L_hat - L| / L; the cell shows the signed errors
            return (f"{r.outcome} (L_hat {r.L_hat:.1f}, {100 * (r.L_hat / r.L_true - 1):+.0f} %; P_hat {r.P_hat:.3g}, "
                    f"{100 * (r.P_hat / r.P_true - 1):+.0f} %)") if np.isfinite(r.L_hat) else f"stopped (no fit: {r.note})"
        rows.append({"knob": knob, "setting": setting, "phase": 2, "without_counter": cell("no_counter"),
                     "with_counter": cell("attack"), "at_10x": cell("attack_10x"), "adaptive": "", "paper_estimator": "",
                     "cost": f"{v.loc['no_counter', 'added_ms']:,.0f} ms per request"})
    return pd.DataFrame(rows)


def stops(row: pd.Series, column: str) -> bool | None:
    text = row[column]
    if not text:
        return None
    return not text.startswith(("exact", "works", "leaks"))


def weakest(table: pd.DataFrame) -> pd.DataFrame:
    """Per knob, the weakest setting (first in params order) that stops its phase at the default budget and at 10x the
    budget, with its cost. A setting stops the attack only where every statistic the attacker holds misses: at the
    default budget the plain one and the counter-measure (the attacker does not know which to trust, so a defence one
    of them beats has leaked); at 10x those and the counter-measure on ten times the calls. A phase the undefended
    attack already fails has nothing to stop."""
    budgets = {"default budget": ["without_counter", "with_counter"],
               "10x budget": ["without_counter", "with_counter", "at_10x"]}
    rows = []
    for knob, g in table[table.knob != "none"].groupby("knob", sort=False):
        phase = int(g.phase.iloc[0])
        undefended = table[(table.knob == "none") & (table.phase == phase)].iloc[0]
        out = {"knob": knob, "phase": phase}
        for label, columns in budgets.items():
            def verdict(r):
                return all(stops(r, c) for c in columns if r[c])
            stopping = [r for _, r in g.iterrows() if verdict(r)]
            if label == "10x budget" and not g["at_10x"].astype(bool).any():
                out[label] = "not emulable (deterministic per value)"
            elif verdict(undefended):
                out[label] = "nothing to stop: the undefended attack fails here"
            else:
                out[label] = f"{stopping[0].setting} ({stopping[0].cost})" if stopping else "none of the swept settings"
        rows.append(out)
    return pd.DataFrame(rows)
