"""Phase 2 evaluation (nv.phase2.evaluation: Eq. 10 path, P_hat of Eq. 3; nv.phase2.prefill, the attacker-side
P_hat; nv.phase2.calibration, the file the live attack reads, and nv.phase2.live.estimate, what it reports) and the
overall results (nv.overall), on timing records built from known truths.

Every record here is what ``nv.phase2.platforms.time_model`` writes (raw trials per length, summarized by the
real ``nv.phase2.protocol.summarize``), with latencies from Eq. 2 for a chosen beta, alpha, L, d (the prefill
term times the platform factor k on the second platform, Eq. 9), so the right answers are known in closed form.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from nv.errors import NVError
from nv.overall import combine, results_table, timed_tokens, timing_budgets, to_markdown, with_trials
from nv.phase2 import live, prefill
from nv.phase2.calibration import calibration, load_calibration
from nv.phase2.evaluation import evaluate, held_out, param_estimates
from nv.phase2.intervals import choose_rule, estimates, held_out_all
from nv.phase2.protocol import BASELINE, LengthTimings, summarize
from nv.validation import evaluate_timing

BETA, ALPHA, BASE = 2e-12, 0.01, 0.05  # s per unit L ell^2 d, s, the ell = 1 baseline latency (s)
TIMING = {"platforms": {"inprocess": {"r": 0.1, "trials": 4, "threads": 2, "references": "all"},
                        "llamacpp": {"r": 0.02, "trials": 4, "threads": 2, "references": "all"}},
          "warmups": 3, "trim": 0.0, "n_lengths": 10, "discard": 2, "kv_ratio": 0.25, "ffn_ratio": 3.5}
# SmolLM2-135M: d = 576, L = 30, 9 heads / 3 KV heads, d_ffn = 1536, tied embeddings, |V| = 49,152
SMOL = {"d": 576, "L": 30, "n_heads": 9, "n_kv_heads": 3, "d_ffn": 1536, "tied": True, "vocab_size": 49152, "P": 134_515_008}


def eq3_by_hand(d, L, V, kv, ffn, tied):
    """Eq. 3 written out from the paper: P = (1 or 2) V d + L (2 + 2 kv + 3 ffn) d^2 + (2L + 1) d."""
    return (1 if tied else 2) * V * d + L * (2 + 2 * kv + 3 * ffn) * d * d + (2 * L + 1) * d


def record(name, role, L, d, platform, k=1.0, d_used=None, trials=4, jitter=1e-4, facts=None, alpha=ALPHA, c=0.0):
    """A timing record with K trials per length: Eq. 9's latency k beta L ell^2 d + alpha (the platform factor k
    scales the prefill, not the fixed overhead) plus the baseline, each trial off by +- jitter seconds
    (alternating), so the means are exact and every sigma_T is the same (the fits' weights are equal). ``c``: the
    prefill curve's linear term, k c P_ne ell (nv.phase2.prefill), which Eq. 2 leaves out."""
    facts = facts or {"n_heads": d // 64, "n_kv_heads": max(1, d // 256), "d_ffn": 3 * d, "tied": False, "vocab_size": 49152}
    P = eq3_by_hand(d, L, facts["vocab_size"], facts["n_kv_heads"] / facts["n_heads"], facts["d_ffn"] / d, facts["tied"])
    P_ne = facts.get("P", P) - facts["vocab_size"] * d * (1 if facts["tied"] else 2) - d
    ell = np.round(np.linspace(0.5, 1.5, 10) * 5 * d).astype(int)
    sign = np.where(np.arange(trials) % 2, -1.0, 1.0)
    rows = [LengthTimings(BASELINE, [1] * trials, list(BASE + jitter * sign))]
    for e in ell:
        T = k * (BETA * L * e**2 * d + c * P_ne * e) + alpha
        rows.append(LengthTimings(int(e), [int(e)] * trials, list(T + BASE + jitter * sign)))
    stats = summarize(rows, 0.0)
    return {"model": name, "role": role, "platform": platform, "L": L, "d": d, "d_used": d_used or d, "P": facts.get("P", P),
            **{k_: facts[k_] for k_ in ("vocab_size", "n_heads", "n_kv_heads", "d_ffn", "tied")},
            "rows": [r.__dict__ for r in rows], "ell": stats["ell"].tolist(), "T": stats["T"].tolist(),
            "sigma": stats["sigma"].tolist(), "trials": trials, "tokens": int(stats["tokens"])}


FAMILY = [("r12", 12, 384), ("r24", 24, 384), ("r16", 16, 512), ("r32", 32, 512), ("r20", 20, 640)]


def records(k=3.0, d_used=576, target_L=30):
    out = {}
    for platform, factor in (("inprocess", 1.0), ("llamacpp", k)):
        recs = [record(n, "reference", L, d, platform, factor) for n, L, d in FAMILY]
        recs.append(record("smollm2", "target", target_L, 576, platform, factor, d_used=d_used, facts=SMOL))
        out[platform] = recs
    return out


# -- Eq. 10, Eq. 3 and the held-out evaluation --------------------------------------------------------


def test_eq10_and_basic_depth_are_exact_on_eq2_timings_on_both_platforms():
    """Noise-free Eq. 2 / Eq. 9 timings (prefill 3x slower on the second platform): leave-one-out recovers every
    model's depth exactly with both estimators, k = 3 exactly, and with the true ratios P_hat is the true P."""
    table = evaluate(records(k=3.0, d_used=576), TIMING)
    assert len(table) == 2 * (len(FAMILY) + 2)  # every model on both platforms, the target also with its true d
    for column in ("L_hat", "L_hat_eq10"):
        np.testing.assert_allclose(table[column], table.L_true, rtol=1e-4)
    np.testing.assert_allclose(table.k, np.where(table.platform == "inprocess", 1.0, 3.0), rtol=1e-6)
    np.testing.assert_allclose(table.beta, BETA, rtol=1e-6)
    np.testing.assert_allclose(table.alpha, ALPHA, rtol=1e-4)
    assert (table.note == "").all() and table.note_eq10.isna().all()
    assert set(table.calibration) == {"same platform", "inprocess -> llamacpp"}
    target = table[(table.role == "target") & (table.d_source == "d_hat")]
    np.testing.assert_allclose(target.P_hat_registry_raw, SMOL["P"], rtol=1e-4)  # true ratios and tying
    np.testing.assert_allclose(target.P_hat_registry_raw_eq10, SMOL["P"], rtol=1e-4)
    np.testing.assert_allclose(target.P_hat_paper_raw, 186_050_880, rtol=1e-4)  # 1/4, 3.5, untied: 38 % too many
    assert (target.L_hat_rounded == 30).all() and (target.L_err_rounded == 0).all()


def test_eq10_scales_as_one_over_d_hat_and_the_target_platform_factor_cancels():
    """With d_hat = 600 for a true d = 576, Eq. 10's gamma_g shrinks by 576/600: L_hat_eq10 = 30 * 576 / 600 = 28.8,
    the same on both platforms (k = 5 cancels), and P_hat follows Eq. 3 at (d_hat, L_hat)."""
    table = evaluate(records(k=5.0, d_used=600), TIMING).set_index(["platform", "role", "d_source"])
    for platform in ("inprocess", "llamacpp"):
        row = table.loc[(platform, "target", "d_hat")]
        assert row.L_hat_eq10 == pytest.approx(28.8, rel=1e-4) and row.L_hat == pytest.approx(28.8, rel=1e-4)
        assert row.P_hat_paper_raw_eq10 == pytest.approx(eq3_by_hand(600, row.L_hat_eq10, 49152, 0.25, 3.5, False), rel=1e-9)
        assert row.P_hat_registry_raw == pytest.approx(eq3_by_hand(600, row.L_hat, 49152, 1 / 3, 1536 / 576, True), rel=1e-9)
        assert table.loc[(platform, "target", "true d")].L_hat_eq10 == pytest.approx(30, rel=1e-4)


def test_a_reference_of_the_targets_shape_does_not_calibrate_it():
    """A reference of the target's d, L and P (the paper profile's SmolLM2-135M-Instruct beside the embedded
    SmolLM2) is the target's own timing under another name: left out of the target's calibration (a review), so a
    twin timed off the law (here 3x the fixed overhead) leaves the target's depth exact, as it leaves the other
    references' fits; the twin is itself held out like any reference."""
    recs = records()
    for platform, factor in (("inprocess", 1.0), ("llamacpp", 3.0)):
        recs[platform].insert(0, record("smollm2-twin", "reference", 30, 576, platform, factor, facts=SMOL, alpha=3 * ALPHA))
    table = evaluate(recs, TIMING)
    target = table[(table.role == "target") & (table.d_source == "d_hat")]
    np.testing.assert_allclose(target.L_hat, 30, rtol=1e-4)
    assert len(table[table.model == "smollm2-twin"]) == 2


def test_a_target_whose_latency_does_not_grow_gets_a_note_not_a_depth():
    recs = records()
    for platform in recs:  # the target's latency falls with ell (T - alpha = -prefill): no positive slope, no depth
        target = recs[platform][-1]
        target["T"] = [2 * ALPHA - t for t in target["T"]]
    table = evaluate(recs, TIMING)
    target = table[table.role == "target"]
    assert target.L_hat.isna().all() and target.L_hat_eq10.isna().all() and target.P_hat_paper_raw.isna().all()
    assert all(n.startswith("L_hat = -") and "do not grow with ell^2 d" in n for n in target.note)
    assert all(n.startswith("L_hat = -") and "do not grow with ell^2 d" in n for n in target.note_eq10)
    lone = held_out(recs["inprocess"][:2], recs["inprocess"][:2], recs["inprocess"][0], TIMING, "d_used")
    assert lone["note"] == "the fits need two reference models besides r12 on each platform" and "L_hat" not in lone


def test_param_estimates_smollm2():
    """Eq. 3 for SmolLM2-135M at its true d and L: with its true ratios and tied embeddings it is the model's real
    parameter count, 134,515,008; with the paper's defaults (1/4, 3.5, untied) 186,050,880."""
    out = param_estimates(SMOL, 576, 30.0, TIMING)
    assert out["P_hat_registry_raw"] == pytest.approx(134_515_008, abs=1) and out["P_err_registry_raw"] == pytest.approx(0, abs=1e-12)
    assert out["P_hat_paper_raw"] == pytest.approx(186_050_880, abs=1)
    assert out["P_err_paper_raw"] == pytest.approx((186_050_880 - 134_515_008) / 134_515_008)
    rounded = param_estimates(SMOL, 576, 29.6, TIMING, suffix="_x")
    assert set(rounded) == {f"P_{w}_{label}_{r}_x" for w in ("hat", "err") for label in ("paper", "registry")
                            for r in ("raw", "rounded")}
    assert rounded["P_hat_registry_rounded_x"] == out["P_hat_registry_raw"]  # round(29.6) = 30 layers
    assert rounded["P_hat_registry_raw_x"] == pytest.approx(134_515_008 - 0.4 * (2 + 2 / 3 + 8) * 576**2 - 0.8 * 576)


# -- the calibration file -------------------------------------------------------------------------


def test_calibration_is_the_reference_platform_fit_and_the_live_attack_reads_it(tmp_path):
    recs = records(k=3.0)
    cal = calibration(recs, TIMING)
    assert cal["platform"] == "inprocess"  # the first platform is the reference platform
    assert cal["beta"] == pytest.approx(BETA, rel=1e-6) and cal["alpha"] == pytest.approx(ALPHA, rel=1e-4)
    assert (cal["r"], cal["trials"]) == (0.1, 4)  # that platform's protocol, not llamacpp's
    assert {k: cal[k] for k in ("warmups", "trim", "n_lengths", "discard", "kv_ratio", "ffn_ratio")} == \
        {k: TIMING[k] for k in ("warmups", "trim", "n_lengths", "discard", "kv_ratio", "ffn_ratio")}
    # only references on the reference platform enter: the target and the other platform change nothing
    changed = records(k=7.0, target_L=90)
    assert calibration(changed, TIMING) == cal
    # gamma_ref (Eq. 6, L unknown): with every reference at depth 20 it is 20 beta exactly
    same_depth = {"inprocess": [record(n, "reference", 20, d, "inprocess") for n, _, d in FAMILY]}
    assert calibration(same_depth, TIMING)["gamma_ref"] == pytest.approx(20 * BETA, rel=1e-6)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal))
    assert load_calibration(path) == cal  # what `nv attack --timing-calibration` reads
    path.write_text(json.dumps({**cal, "beta": -1.0}))
    with pytest.raises(NVError, match="has beta = -1.0: its reference fit failed"):
        load_calibration(path)
    for key, value, rule in (("beta", "abc", "is not a finite number"), ("alpha", None, "is not a finite number"),
                             ("q_L_eq10", -0.1, "is not a number >= 0 or null"), ("score_basic", "0.1", "is not a number >= 0 or null"),
                             ("prefill", {"b": 1.0, "c": 0.0, "a": 0.0}, "is neither null nor finite b > 0, c > 0, a"),
                             ("prefill", [1, 2, 3], "is neither null nor finite b > 0, c > 0, a"),
                             ("prefill", {"b": -1.0, "c": 1.0, "a": 0.0}, "is neither null nor finite b > 0, c > 0, a"),
                             ("rule_order", ["basic"], "is not an order of ['basic', 'eq10']")):  # hand-edited: one line, no TypeError
        path.write_text(json.dumps({**cal, key: value}))
        with pytest.raises(NVError, match=re.escape(f"{key} = {value!r} {rule}: use outputs/timing_fit")):
            load_calibration(path)
    for damaged, reason in ((b"\xff\xfe not text", r"cannot read .*rerun `dvc repro timing_fit`"),
                            (b'{"beta": 1', r"is not valid JSON \(cut short or edited\?\): rerun `dvc repro timing_fit`")):
        path.write_bytes(damaged)  # one line, not a UnicodeDecodeError
        with pytest.raises(NVError, match=reason):
            load_calibration(path)
    with pytest.raises(NVError, match=r"missing .*nowhere\.json: rerun `dvc repro timing_fit`"):
        load_calibration(tmp_path / "nowhere.json")
    old = {k: v for k, v in cal.items() if k not in ("prefill", "q_L_basic")}  # one written before the intervals
    path.write_text(json.dumps(old))
    with pytest.raises(NVError, match=r"lacks \['prefill', 'q_L_basic'\].*rerun `dvc repro timing_fit`"):
        load_calibration(path)
    # the protocol's values by params.yaml's rules for them, before phase 1 pays: a wrong type, a value out of range,
    # more lengths discarded than the fit can spare (params.yaml's own check, with the same words)
    for key, value, rule in (("trials", 2.5, "must be int, got float 2.5"), ("r", True, "must be int or float, got bool True"),
                             ("warmups", 1, "must be >= 2"), ("trim", 0.5, r"must be in \[0, 0.5\)"),
                             ("discard", cal["n_lengths"] - 1, f"must be <= n_lengths - 2 = {cal['n_lengths'] - 2}")):
        path.write_text(json.dumps({**cal, key: value}))
        with pytest.raises(NVError, match=f"^{re.escape(f'timing calibration {path}: ')}'timing.{key}' {rule}.*use outputs/timing_fit"):
            load_calibration(path)


def test_the_prefill_curve_recovers_the_non_embedding_parameters_without_the_ratios():
    """nv.phase2.prefill on timings T = b L d ell^2 + c P_ne ell + a (the references of FAMILY, whose MLPs are 3 d
    wide): the calibration is b, c, a; a target of another shape (SmolLM2: tied, d_ffn = 2.67 d, 9 / 3 heads) gets
    its own P_ne back from its timings at its true depth with no guess of its ratios. A depth off by dL moves it by
    exactly the attention term it subtracts, b d dL sum(ell^3) / (c sum(ell^2)) (equal weights here): one to one
    in relative terms where attention is as slow as the rest (here, with the crossover at the sweep's middle, a
    10 % deeper L_hat reads P_ne 11 % low); P_hat's range spans the tied and untied totals."""
    C = 1e-12  # s per non-embedding parameter per token: the target's crossover (attention = the rest) at ell ~ 2,900
    refs = [record(n, "reference", L, d, "inprocess", c=C) for n, L, d in FAMILY]
    fit = prefill.calibrate(refs)
    assert (fit.b, fit.c, fit.a) == pytest.approx((BETA, C, ALPHA), rel=1e-6)
    target = record("smollm2", "target", 30, 576, "inprocess", facts=SMOL, c=C)
    P_ne = prefill.non_embedding_params(target)
    assert P_ne == SMOL["P"] - 49152 * 576 - 576  # tied: one embedding, and the final norm
    ell, T, sigma = (np.array(target[k]) for k in ("ell", "T", "sigma"))
    assert prefill.non_embedding_hat(fit, ell, T, sigma, 576, 30) == pytest.approx(P_ne, rel=1e-6)
    shift = BETA * 576 * 3 * np.sum(ell.astype(float) ** 3) / np.sum(ell.astype(float) ** 2) / C
    deeper = prefill.non_embedding_hat(fit, ell, T, sigma, 576, 33)
    assert deeper == pytest.approx(P_ne - shift, rel=1e-6) and -0.13 < deeper / P_ne - 1 < -0.09
    tied, untied, mid = prefill.param_range(P_ne, 576, 49152)
    assert tied == SMOL["P"] and untied == SMOL["P"] + 49152 * 576 and mid == (tied + untied) / 2
    with pytest.raises(NVError, match="at least two reference models"):
        prefill.calibrate(refs[:1])
    # a per-token cost that falls with ell (concave T) fits a negative attention cost b: refused, where it was used,
    # and P_ne_hat grew with L_hat (more attention credited back)
    concave = [r | {"T": list(np.array(r["T"]) - 2 * BETA * r["L"] * r["d"] * np.array(r["ell"], float) ** 2)} for r in refs]
    with pytest.raises(NVError, match="b = -.* not both positive"):
        prefill.calibrate(concave)


def test_the_live_attack_reads_a_target_as_the_validation_does():
    """Timings with the prefill curve's linear term (a per-parameter cost, nv.phase2.prefill), which Eq. 2 leaves
    out: the calibration file carries the curve's b, c, a and, from its references each held out in turn, the
    rule's scores and conformal half-widths that the validation computes for a target on the reference platform;
    ``nv.phase2.live.estimate`` on the target's timings then gives the validation's rule, L_hat, P_hat and
    intervals. A platform k times slower reads the same depth and size with the transfer factor k."""
    C = 1e-13  # s per non-embedding parameter per token: ~10 % of the prefill at these lengths
    recs = {"inprocess": [record(n, "reference", L, d, "inprocess", c=C) for n, L, d in FAMILY]
            + [record("smollm2", "target", 30, 576, "inprocess", facts=SMOL, c=C)]}
    timing = {**TIMING, "platforms": {"inprocess": TIMING["platforms"]["inprocess"]}}
    cal = calibration(recs, timing)
    assert [cal["prefill"][k] for k in "bca"] == pytest.approx([BETA, C, ALPHA], rel=1e-6)
    row = evaluate_timing(recs, timing, [4]).iloc[0]  # setup F, same platform, every trial
    for key in ("q_L_basic", "q_L_eq10", "q_P_basic", "q_P_eq10"):
        assert cal[key] == pytest.approx(row[key], rel=1e-12) and 0 < cal[key] < 1, key
    assert (cal["score_basic"], cal["score_eq10"]) == pytest.approx((row.median_ref_err_basic, row.median_ref_err_eq10), rel=1e-12)
    target = recs["inprocess"][-1]
    ell, T, sigma = (np.array(target[k]) for k in ("ell", "T", "sigma"))
    out = live.estimate(ell, T, sigma, 576, cal, 1.0, 49152)
    L_hat = {"basic": row.L_hat, "eq10": row.L_hat_eq10}
    P_ne_hat = {"basic": row.P_ne_hat_basic, "eq10": row.P_ne_hat_eq10}
    want = {k: float(v) for k, v in estimates(L_hat, P_ne_hat, row, row.rule, 576.0, 49152.0).items()}
    assert out["rule"] == row.rule and (out["L_hat_basic"], out["L_hat_eq10"]) == pytest.approx((row.L_hat, row.L_hat_eq10), rel=1e-9)
    assert out["L_hat"] == pytest.approx(want["L_hat"], rel=1e-9) and out["P_hat"] == pytest.approx(want["P_hat"], rel=1e-9)
    for what in ("L", "P"):
        assert out[f"{what}_interval"] == pytest.approx([want[f"{what}_lo"], want[f"{what}_hi"]], rel=1e-9)
        assert out[f"{what}_interval_rule"] == pytest.approx([want[f"{what}_lo_rule"], want[f"{what}_hi_rule"]], rel=1e-9)
        lo, hi = out[f"{what}_interval"]
        assert lo <= out[f"{what}_hat"] <= hi and lo <= target[what] <= hi, (what, lo, hi)  # here, the truth too
    print(f"target L 30, P 134.5 M: L_hat {out['L_hat']:.2f} ({out['rule']}) {np.round(out['L_interval'], 2)}, "
          f"P_hat {out['P_hat'] / 1e6:.1f} M {np.round(np.array(out['P_interval']) / 1e6, 1)}")
    tied, untied = out["P_tied_untied"]
    assert tied < out["P_hat"] < untied and untied - tied == pytest.approx(49152 * 576)
    assert out["P_hat_paper"] == pytest.approx(eq3_by_hand(576, out["L_hat"], 49152, 0.25, 3.5, False), rel=1e-12)
    # a platform 2x slower in prefill, not in its fixed overhead, read with k = 2: the same depth (Eqs. 9-10 divide
    # by k beta; the overhead as Eq. 2's fit puts it), and P_ne as the calibration's platform reads it at that depth
    # (the prefill curve's b and c scale by k; its overhead a, 0.010 s here, is its own fit's, not Eq. 2's 0.013 s)
    slow = live.estimate(ell, 2 * (T - cal["alpha"]) + cal["alpha"], sigma, 576, cal, 2.0, 49152)
    for key in ("L_hat", "L_hat_basic", "L_hat_eq10"):
        assert slow[key] == pytest.approx(out[key], rel=1e-9), key
    a = cal["prefill"]["a"]
    slow = live.estimate(ell, 2 * (T - a) + a, sigma, 576, cal, 2.0, 49152)
    P_ne = prefill.non_embedding_hat(prefill.PrefillCalibration(**cal["prefill"]), ell, T, sigma, 576, slow["L_hat"])
    assert slow["P_hat"] == pytest.approx(prefill.param_range(P_ne, 576, 49152)[2], rel=1e-9)
    # without the prefill curve (its fit failed) or the vocabulary: L_hat, and a note for what is missing
    no_curve = live.estimate(ell, T, sigma, 576, {**cal, "prefill": None}, 1.0, 49152)
    assert "P_hat" not in no_curve and no_curve["note"].startswith("no attacker-side P_hat") and no_curve["L_hat"] == out["L_hat"]
    no_vocab = live.estimate(ell, T, sigma, 576, cal, 1.0, None)
    assert "P_hat_paper" not in no_vocab and no_vocab["note"].startswith("no --vocab-size")
    # no reference with a fit: unbounded intervals, as null in the report
    blind = live.estimate(ell, T, sigma, 576, {**cal, **{k: None for k in ("q_L_basic", "q_L_eq10", "q_P_basic", "q_P_eq10")}}, 1.0, 49152)
    assert blind["L_interval"] == [0.0, None] and blind["L_hat"] == out["L_hat"]
    json.dumps(blind, allow_nan=False)  # the report is strict JSON
    # a prefill curve that leaves no positive P_ne (timings 50x faster than the calibration's platform, read with
    # k = 1: the attention term of L_hat takes all the time), or a latency that falls with ell (T - alpha = -prefill):
    # a note, not a number
    fast = live.estimate(ell, 0.02 * T, sigma, 576, cal, 1.0, 49152)
    assert "P_hat" not in fast and "P_interval" not in fast and "no positive P_ne" in fast["note"], fast
    # quantised latencies (a provider's timing defence): every T the same, Eq. 10's slope 0 / 0: no depth from it,
    # its t-statistic null, the report still strict JSON
    flat = live.estimate(ell, np.full(len(T), 0.5), sigma, 576, cal, 1.0, 49152)
    assert flat["rule"] == "basic" and flat["t_eq10"] is None and flat["L_hat_eq10"] == 0.0
    json.dumps(flat, allow_nan=False)
    falling = live.estimate(ell, 2 * cal["alpha"] - T, sigma, 576, cal, 1.0, 49152)
    assert falling["note"].startswith("no depth from either estimator") and "L_interval" not in falling
    assert "P_hat_paper" not in falling


# -- nv.overall --------------------------------------------------------------------------------------


def test_with_trials_keeps_the_first_K_trials_and_resummarizes():
    rec = record("smollm2", "target", 30, 576, "inprocess", trials=6, jitter=0.003)
    rec["rows"][3]["seconds"][5] = 99.0  # a late outlier: outside the first 4 trials
    cut = with_trials(rec, 4, trim=0.0)
    assert cut["trials"] == 4 and all(len(r["seconds"]) == len(r["ell"]) == 4 for r in cut["rows"])
    base = np.mean(rec["rows"][0]["seconds"][:4])
    expected = [np.mean(r["seconds"][:4]) - base for r in rec["rows"][1:]]
    np.testing.assert_allclose(cut["T"], expected, rtol=1e-12)
    assert cut["tokens"] == sum(sum(r["ell"][:4]) for r in rec["rows"])  # the prompts'; §5's adds 1 a call:
    assert timed_tokens(cut) == cut["tokens"] + 4 * len(rec["rows"])
    assert with_trials(rec, 6, trim=0.0)["T"][2] > 99 / 6  # the outlier is in the full record
    assert (cut["model"], cut["L"], cut["d_used"]) == ("smollm2", 30, 576)


def test_timing_budgets_refit_the_target_at_each_trial_count():
    recs = records(k=3.0, d_used=576)
    table = timing_budgets(recs, TIMING, [2, 4, 8])  # 8 > the 4 trials recorded: skipped
    assert list(zip(table.platform, table.trials)) == [("inprocess", 2), ("inprocess", 4), ("llamacpp", 2), ("llamacpp", 4)]
    np.testing.assert_allclose(table.L_hat_at_d_used, 30, rtol=1e-3)
    assert (table.note == "").all() and (table.L_true == 30).all() and (table.d_used == 576).all()
    # §5's tokens of one trial per length, prompt + 1 each: 10 lengths and the ell = 1 baseline (the prompts alone before
    # 2026-12-06 evening)
    per_trial = sum(np.round(np.linspace(0.5, 1.5, 10) * 5 * 576).astype(int) + 1) + 2
    assert table.timing_tokens.tolist() == [2 * per_trial, 4 * per_trial] * 2


def test_the_rule_takes_the_estimator_the_references_favour_unless_it_gives_the_target_no_depth():
    """Ten references whose fixed overheads differ (alpha 0.005 or 0.03 s): Eq. 10, with each model's own intercept,
    is the closer on every one of them, the basic estimator (one borrowed intercept) far off, so the rule prefers
    Eq. 10 (a sign test of 10 of 10). A target with a large overhead and a latency that falls with ell (a negative
    prefill slope) gives Eq. 10 no depth but the basic estimator a positive one: the rule then takes the basic
    estimator, with its own interval, not a NaN."""
    shapes = FAMILY + [("r18", 18, 448), ("r28", 28, 576), ("r14", 14, 768), ("r22", 22, 448), ("r26", 26, 640)]
    family = [(n, L, d, (0.005, 0.03)[i % 2]) for i, (n, L, d) in enumerate(shapes)]
    def build(timed_L, target_alpha):  # a target of true depth 30 whose timings follow Eq. 2 at depth timed_L
        recs = [record(n, "reference", L, d, "inprocess", alpha=a) for n, L, d, a in family]
        target = record("smollm2", "target", timed_L, 576, "inprocess", facts=SMOL, alpha=target_alpha) | {"L": 30}
        return {"inprocess": recs + [target]}
    timing = {**TIMING, "platforms": {"inprocess": TIMING["platforms"]["inprocess"]}}
    normal = evaluate_timing(build(30, ALPHA), timing, [4]).iloc[0]
    assert normal.median_ref_err_eq10 < 0.015 < 0.04 < normal.median_ref_err_basic
    assert normal.rule == "eq10"
    falling = evaluate_timing(build(-5, 0.2), timing, [4]).iloc[0]
    assert (falling.median_ref_err_eq10, falling.median_ref_err_basic) == (normal.median_ref_err_eq10, normal.median_ref_err_basic)
    assert np.isnan(falling.L_hat_eq10) and "do not grow with ell^2 d" in falling.note_eq10 and falling.L_hat > 0
    assert falling.rule == "basic"
    # the rule's estimator with its own interval, not a NaN
    est = estimates({"basic": falling.L_hat, "eq10": falling.L_hat_eq10}, {"basic": np.nan, "eq10": np.nan}, falling, falling.rule, 576, 49152)
    assert est["L_hat"] == falling.L_hat and est["L_lo_rule"] == pytest.approx(falling.L_hat * np.exp(-falling.q_L_basic))
    assert choose_rule(["eq10", "basic"], {}) == "eq10"  # no depth from either: the references' choice


def test_the_rule_keeps_the_basic_estimator_unless_eq10_wins_a_sign_test():
    """The held-out references of a fresh clone's run (2026-12-06, both platforms pooled, L_hat / L_hat_eq10 for
    each true depth; NaN: no depth): the median errors favoured Eq. 10 by 0.151 to 0.142, and the old rule took it,
    which read both real targets ~-46 % where the basic estimator read -4.8 % and +10.3 %. Per model (three of the
    seven timed on both platforms, one vote each) Eq. 10 wins 2, loses 4, ties 1: no evidence, so the basic estimator
    stays; winning every model (p = 2^-7) moves it first. A model's rows on two platforms are one vote: four models,
    seven rows, all won, are 4 of 4 (p = 1/16), too few to tell."""
    from nv.phase2.intervals import rule_order, rule_scores

    run = [("384x12", 12, np.nan, 10.946), ("384x24", 24, 22.091, 19.244), ("512x16", 16, 15.348, 11.231),
           ("512x32", 32, 39.014, 24.238), ("640x20", 20, 23.145, 21.145), ("768x28", 28, 30.772, 22.903),
           ("1024x16", 16, 12.351, np.nan), ("384x12", 12, np.nan, 10.301), ("512x16", 16, 13.678, 14.300),
           ("640x20", 20, 23.574, 17.624)]  # in process, then the llama.cpp platform's three
    rows = [{"model": m, "L_true": L, "L_hat": basic, "L_hat_eq10": eq10} for m, L, basic, eq10 in run]
    scores = rule_scores(rows)
    assert scores["eq10"] < scores["basic"] and (round(scores["basic"], 3), round(scores["eq10"], 3)) == (0.151, 0.142)
    assert rule_order(rows) == ["basic", "eq10"]
    better = [r | {"L_hat": r["L_true"] * 1.3, "L_hat_eq10": r["L_true"] * 0.95} for r in rows]
    assert rule_order(better) == ["eq10", "basic"]
    four = [r for r in better if r["model"] in ("384x12", "512x16", "640x20", "384x24")]
    assert len(four) == 7 and rule_order(four) == ["basic", "eq10"]  # counted by rows, 7 of 7 (p = 1/128) flipped it


def test_the_rule_pools_the_references_of_every_platform_and_the_half_widths_are_the_targets_platforms():
    """In process the references' overheads differ (the basic estimator's borrowed intercept is off), on the second
    platform they are alike: the rule's scores are the medians over both platforms' references, each held out on its
    own platform; the half-widths q are those of the target's platform alone."""
    alphas = (0.005, 0.03, 0.01, 0.02, 0.015)
    recs = {"inprocess": [record(n, "reference", L, d, "inprocess", alpha=a) for (n, L, d), a in zip(FAMILY, alphas)],
            "llamacpp": [record(n, "reference", L, d, "llamacpp", 3.0) for n, L, d in FAMILY]}
    for platform, k in (("inprocess", 1.0), ("llamacpp", 3.0)):
        recs[platform].append(record("smollm2", "target", 30, 576, platform, k, facts=SMOL))
    table = evaluate_timing(recs, TIMING, [4]).query("setup == 'F'").set_index("platform")
    rows = {p: [held_out_all(recs, r, TIMING) for r in rs if r["role"] == "reference"] for p, rs in recs.items()}
    for name, key in (("basic", "L_hat"), ("eq10", "L_hat_eq10")):
        err = [abs(r[key] / r["L_true"] - 1) for p in rows for r in rows[p]]
        assert table[f"median_ref_err_{name}"].tolist() == pytest.approx([np.median(err)] * 2, rel=1e-12)
        for p in rows:
            want = np.max([abs(np.log(r[key] / r["L_true"])) for r in rows[p]])
            assert table.loc[p, f"q_L_{name}"] == pytest.approx(want, rel=1e-12)
    assert table.loc["inprocess", "q_L_basic"] > 2 * table.loc["llamacpp", "q_L_basic"]  # the platforms differ


def test_a_reference_fit_that_cannot_tell_its_depth_from_zero_does_not_widen_the_intervals():
    """A reference whose timings are its overhead plus noise (no ell^2 growth: the README's ref-384x12, below the
    others' intercept) gets a small positive basic L_hat under two standard errors above 0: no depth, with a note,
    so the conformal half-width is that of the references with a fit, not |log(L_hat / 12)| > 2.5."""
    timing = {**TIMING, "platforms": {"inprocess": TIMING["platforms"]["inprocess"]}}
    flat = record("r-flat", "reference", 12, 384, "inprocess")
    flat["T"] = (ALPHA + 1e-3 * np.random.default_rng(1).standard_normal(len(flat["T"]))).tolist()
    recs = [record(n, "reference", L, d, "inprocess") for n, L, d in FAMILY[1:]] + [flat]
    target = record("smollm2", "target", 30, 576, "inprocess", facts=SMOL)
    raw = held_out(recs, recs, flat, timing, "d_used")
    assert 0 < raw["L_hat"] < 1 and raw["t"] < 2  # the premise: a positive depth the fit cannot tell from zero
    gated = held_out_all({"inprocess": recs}, flat, timing)
    assert np.isnan(gated["L_hat"]) and "standard errors above 0" in gated["note_t_basic"]
    others = [held_out_all({"inprocess": recs}, r, timing)["L_hat"] for r in recs[:-1]]
    q = np.max(np.abs(np.log(np.array(others) / [L for _, L, _ in FAMILY[1:]])))
    row = evaluate_timing({"inprocess": recs + [target]}, timing, [4]).iloc[0]
    assert row.q_L_basic == pytest.approx(q, rel=1e-9) and q < 0.2


def test_each_estimator_without_a_positive_P_ne_hat_is_named_in_the_note():
    """A target whose prefill grows slower than its attention alone (a negative linear term: no time left for the
    parameters at either estimator's depth) gets no P_ne_hat from either, and the note names both (it used to keep the
    last one only, so a rule that picked the other estimator read as unexplained)."""
    timing = {**TIMING, "platforms": {"inprocess": TIMING["platforms"]["inprocess"]}}
    recs = [record(n, "reference", L, d, "inprocess", c=1e-13) for n, L, d in FAMILY]
    target = record("smollm2", "target", 30, 576, "inprocess", facts=SMOL, c=-1e-12)
    row = held_out_all({"inprocess": recs + [target]}, target, timing)
    assert row["L_hat"] > 0 and row["L_hat_eq10"] > 0 and np.isnan(row["P_ne_hat_basic"]) and np.isnan(row["P_ne_hat_eq10"])
    assert row["note_prefill"] == (f"no positive P_ne_hat at the basic estimator's L_hat = {row['L_hat']:.3g}; "
                                   f"no positive P_ne_hat at the eq10 estimator's L_hat = {row['L_hat_eq10']:.3g}")
    fine = held_out_all({"inprocess": recs + [target]}, recs[2], timing)  # a reference of the family: both positive
    assert fine["P_ne_hat_basic"] > 0 and fine["P_ne_hat_eq10"] > 0 and "note_prefill" not in fine


def test_combine_propagates_d_hat_into_L_hat_and_P_hat_as_rerunning_the_fit_would():
    """overall.combine rescales L_hat(d_used) by d_used / d_hat instead of refitting; the refit with that d_hat
    (held_out on a record whose d_used is d_hat) must give the same L_hat."""
    recs = records(k=3.0, d_used=600)
    timing = timing_budgets(recs, TIMING, [4])
    phase1 = pd.DataFrame({"N": [10_000, 300_000], "tokens": [10**9, 4 * 10**10], "d_hat": [np.nan, 576.0]})
    facts = {k: SMOL[k] for k in ("d", "L", "P", "vocab_size", "tied")}
    table = combine(phase1, timing, facts, kv_ratio=0.25, ffn_ratio=3.5)
    assert len(table) == 2 * 2
    unsaturated, saturated = table[table.N == 10_000], table[table.N == 300_000]
    assert unsaturated[["d_hat", "L_hat", "P_hat", "d_err", "L_err", "P_err"]].isna().all().all()
    for row in saturated.itertuples():
        target = next(r for r in recs[row.platform] if r["role"] == "target")
        refit = held_out(recs["inprocess"], recs[row.platform], {**target, "d_used": 576}, TIMING, "d_used")
        assert row.L_hat == pytest.approx(refit["L_hat"], rel=1e-9) and row.L_hat == pytest.approx(30, rel=1e-3)
        assert row.P_hat == pytest.approx(eq3_by_hand(576, row.L_hat, 49152, 0.25, 3.5, True), rel=1e-12)
        assert row.d_err == 0 and row.L_err == pytest.approx(abs(row.L_hat - 30) / 30)
        assert row.P_err == pytest.approx(abs(row.P_hat - SMOL["P"]) / SMOL["P"])
        assert row.tokens == 4 * 10**10 + row.timing_tokens


def test_results_table_and_markdown():
    estimates = evaluate(records(k=3.0, d_used=600), TIMING)
    table = results_table(estimates)
    assert len(table) == 2 * (len(FAMILY) + 1)  # the target's "true d" rows are not results
    assert list(table.columns[:5]) == ["model", "role", "timing calibration", "d", "d_hat"]
    target = table[table.model == "smollm2"]
    assert (target.d_hat == 600).all() and (target.d == 576).all()
    md = to_markdown(pd.DataFrame({"model": ["a", "b"], "L_hat": [np.pi, np.nan], "L error": [0.125, 0.5]}))
    assert md.splitlines() == ["| model | L_hat | L error |", "| --- | --- | --- |", "| a | 3.142 | 12.5 % |",
                               "| b |  | 50.0 % |"]
