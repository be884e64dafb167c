"""Validation across models (§5.1-5.3, App. E.2; Figs. err_d_L_N_plot, val_plot, L_param_err_budget): d_hat, L_hat, P_hat
of every real model of the run, with calibrated intervals and their coverage.

The real models are ``model.spec`` (the section stages) and every entry of ``validation.models`` (its own
stages). Phase 2 is evaluated in two setups: ``F``, the target against the random-weight reference family
only (as the section stages do), and ``all``, leave-one-out among every timed model (the references and the
other real models, with their true facts): the paper's setup. L_hat and P_hat, the rule choosing between
the paper's two depth estimators and the calibrated 90 % intervals are ``nv.phase2.intervals``'s (the live attack
uses the same functions, scored on its calibration's reference platform alone); d's interval is the detector's (``nv.phase1.spectrum.d_interval``). Beside the attacker-side P_hat:
Eq. 3 with the paper's default ratios and with the target's true ratios (an oracle, for comparison). Coverage of
the intervals is counted over every (model, budget).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from nv.errors import NVError
from nv.outputs import interval_text, json_value, read_json
from nv.overall import timed_tokens, with_trials
from nv.phase2.fit import total_params
from nv.phase2.intervals import ESTIMATORS, choose_rule, estimates, half_widths, held_out_all, rule_order, rule_scores


def _duration(notebook: Path) -> float:
    """Wall seconds of an executed stage notebook (papermill's record); NaN when absent."""
    if not notebook.is_file():
        return np.nan
    return float(json.loads(notebook.read_text())["metadata"].get("papermill", {}).get("duration") or np.nan)


def load_phase1(root: Path, main: str, items: list[str]) -> pd.DataFrame:
    """Every real model's budget sweep (every estimator) with its search cost and phase-1 wall time: the
    section stages' for ``main`` (model.spec), ``validation_phase1@ITEM``'s for each item."""
    out = root / "outputs"
    main_metrics = read_json(root / "metrics" / "hidden_dim.json", "spectrum")
    frames = []
    for item in [None, *items]:
        if item is None:
            name = main
            sweep = pd.read_csv(out / "budget_sweep" / "sweep.csv")
            sweep["search_tokens"], sweep["search_calls"] = main_metrics["search_tokens"], main_metrics["calls"] - main_metrics["N"] * main_metrics["D"]
            d_true = main_metrics["d_true"]
            wall = sum(_duration(out / s / f"{s}.ipynb") for s in ("prompt_search", "sampling", "pruning", "spectrum"))
        else:
            folder = out / "validation_phase1" / item
            if not (folder / "sweep.csv").is_file():
                raise NVError(f"missing {folder / 'sweep.csv'}: run 'dvc repro validation_phase1@{item}'")
            sweep = pd.read_csv(folder / "sweep.csv")
            record = read_json(folder / "report.json")
            name, d_true = record["model"], record["d_true"]
            if name in {f.model.iloc[0] for f in frames}:
                raise NVError(f"validation.models.{item} attacks {name}, which the run already validates: list each model once")
            wall = _duration(folder / "validation_phase1.ipynb")
        sweep.insert(0, "model", name)
        sweep["d_true"], sweep["phase1_wall_s"] = d_true, wall
        sweep["phase1_tokens"] = sweep.tokens + sweep.search_tokens
        sweep["phase1_calls"] = sweep.calls + sweep.search_calls
        sweep["saturated"] = sweep.d_hat_raw.notna()
        frames.append(sweep)
    return pd.concat(frames, ignore_index=True)


def load_timing(root: Path, items: list[str], family: dict, platforms: dict) -> dict[str, list[dict]]:
    """Per platform (reference platform first): the references of F timed there, then every real model timed
    there (``timing_target``, then ``validation_timing@ITEM`` for each item)."""
    out = root / "outputs"
    folders = [out / "timing_target"] + [out / "validation_timing" / item for item in items]
    records: dict[str, list[dict]] = {}
    for platform, cfg in platforms.items():
        refs = list(family) if cfg["references"] == "all" else cfg["references"]
        records[platform] = [read_json(out / "timing_reference" / r / f"{platform}.json") for r in refs]
        records[platform] += [read_json(f / f"{platform}.json") for f in folders if (f / f"{platform}.json").is_file()]
    return records


def _calls(record: dict, warmups: int) -> int:
    return sum(len(r["seconds"]) for r in record["rows"]) + warmups


def _setup(records: dict[str, list[dict]], g: dict, setup: str) -> dict[str, list[dict]]:
    """The records a held-out target is calibrated on: the references (``F``), or also every other real model
    as a reference of known facts (``all``); g itself stays the target."""
    def role(r: dict) -> str:
        if r["model"] == g["model"]:
            return "target"
        return "reference" if r["role"] == "reference" or setup == "all" else "excluded"

    return {p: [r | {"role": role(r)} for r in recs if role(r) != "excluded"] for p, recs in records.items()}


def evaluate_timing(records: dict[str, list[dict]], timing: dict, trial_counts: list[int]) -> pd.DataFrame:
    """Every real model x setup x platform x K' (the first K' trials per length): L_hat and P_ne_hat by both depth
    estimators, the rule's choice, and the same calibration's references' median errors (over every platform) and
    conformal half-widths (on the target's platform; ``nv.phase2.intervals.rule_scores``, ``half_widths``)."""
    rows = []
    targets = [r for recs in records.values() for r in recs if r["role"] == "target"]
    for g in targets:
        for setup in ("F", "all"):
            recs = _setup(records, g, setup)
            # the calibration's own references, each held out in turn on its platform: the attacker's error estimate;
            # the rule's scores pool every platform, the half-widths are g's platform's
            refs = {p: [held_out_all(recs, r, timing) for r in rs if r["role"] == "reference"] for p, rs in recs.items()}
            pooled = [row for held in refs.values() for row in held]
            scores, order = rule_scores(pooled), rule_order(pooled)
            q = half_widths(refs[g["platform"]])
            for K in trial_counts:
                if K > g["trials"]:
                    continue
                gk = with_trials(g, K, timing["trim"])
                row = held_out_all(recs, gk, timing)
                rule = choose_rule(order, row)
                rows.append({**{k: row.get(k, np.nan) for k in ("model", "platform", "calibration", "d_used", "d_true", "L_true", "P_true",
                                                                 "L_hat", "L_hat_eq10", "P_ne_true", "P_ne_hat_basic", "P_ne_hat_eq10",
                                                                 "note", "note_eq10", "note_t_basic", "note_t_eq10", "note_prefill")},
                             "setup": setup, "trials": K, "timing_tokens": timed_tokens(gk), "timing_calls": _calls(gk, timing["warmups"]),
                             "timing_wall_s": float(sum(sum(r["seconds"]) for r in gk["rows"])), "vocab_size": g["vocab_size"],
                             "kv_true": g["n_kv_heads"] / g["n_heads"], "ffn_true": g["d_ffn"] / g["d"], "tied_true": g["tied"],
                             "rule": rule, "median_ref_err_basic": scores["basic"], "median_ref_err_eq10": scores["eq10"], **q})
    table = pd.DataFrame(rows)
    reference = next(iter(records))
    table["calibration"] = np.where(table.platform == reference, "same platform", f"{reference} -> " + table.platform)
    return table


def combine(phase1: pd.DataFrame, timing: pd.DataFrame, estimator: str, price: float, kv_ratio: float, ffn_ratio: float) -> pd.DataFrame:
    """Every (model, phase-1 budget, setup, platform, K') case: d_hat, L_hat, P_hat with intervals, errors, cost.

    L_hat scales as 1/d_hat at fixed timings (both estimators fit L d_hat), so a case's L_hat is the timing
    row's L_hat(d_used) d_used / d_hat; P_ne_hat depends on L_hat d_hat only, so only the embedding moves with d_hat.
    Beside the attacker-side P_hat: Eq. 3 with the default ratios ``kv_ratio``, ``ffn_ratio`` (untied; the paper)
    and with the target's true ratios and tying (an oracle)."""
    p1 = phase1[phase1.method == estimator]
    cases = p1.merge(timing, on="model", suffixes=("", "_t"))
    d_hat = cases.d_hat.astype(float)
    scale = cases.d_used / d_hat
    out = cases[["model", "setup", "platform", "calibration", "N", "trials", "d_true", "L_true", "P_true", "saturated", "rule"]].copy()
    out["d_hat_raw"], out["d_hat"], out["d_lo"], out["d_hi"] = cases.d_hat_raw, d_hat, cases.d_lo, cases.d_hi
    out["lower_bound"] = cases.lower_bound
    L_hat = {"basic": cases.L_hat * scale, "eq10": cases.L_hat_eq10 * scale}
    P_ne_hat = {name: cases[f"P_ne_hat_{name}"] for name in ESTIMATORS}
    V = cases.vocab_size.astype(float)
    est = estimates(L_hat, P_ne_hat, cases, cases.rule, d_hat, V)  # cases carry the references' q_L_<name>, q_P_<name>
    out["L_hat"], out["L_hat_basic"], out["L_hat_eq10"] = est["L_hat"], L_hat["basic"], L_hat["eq10"]
    for key, value in est.items():
        out[key] = value
    eq3 = [(total_params(d, L, v, kv_ratio, ffn_ratio, False), total_params(d, L, v, kv, ffn, tie)) if d > 0 and L > 0 else (np.nan, np.nan)
           for d, L, v, kv, ffn, tie in zip(d_hat.fillna(0), out.L_hat.fillna(0), V, cases.kv_true, cases.ffn_true, cases.tied_true)]
    out["P_hat_paper"], out["P_hat_oracle"] = [e[0] for e in eq3], [e[1] for e in eq3]
    for what in ("d", "L", "P"):
        truth = out[f"{what}_true"].astype(float)
        out[f"{what}_err"] = (out[f"{what}_hat"] - truth) / truth
        out[f"{what}_covered"] = (out[f"{what}_lo"] <= truth) & (truth <= out[f"{what}_hi"])
        if what != "d":
            out[f"{what}_covered_rule"] = (out[f"{what}_lo_rule"] <= truth) & (truth <= out[f"{what}_hi_rule"])
    out.loc[~out.saturated, ["L_err", "P_err"]] = np.nan  # no d_hat: phase 2 has nothing to start from
    out["P_err_paper"] = (out.P_hat_paper - out.P_true) / out.P_true
    out["P_err_oracle"] = (out.P_hat_oracle - out.P_true) / out.P_true
    out["tokens"] = cases.phase1_tokens + cases.timing_tokens
    out["calls"] = cases.phase1_calls + cases.timing_calls
    out["usd"] = out.tokens / 1e6 * price
    out["wall_s"] = cases.phase1_wall_s + cases.timing_wall_s
    return out



def coverage(cases: pd.DataFrame, phase1: pd.DataFrame, estimator: str) -> dict:
    """Empirical coverage of the 90 % intervals: d over every (model, phase-1 budget) with a finite interval (a d_hat;
    a budget not saturated gives a lower bound, [bound, inf), which covers trivially); L and P over every (model,
    phase-1 budget, setup, platform, K') case with a d_hat and a finite interval (an infinite one, where fewer than two
    calibration models gave a fit, likewise, and a case with none, where no depth or P_ne_hat came out). Each of those
    is counted apart as uninformative (``d_bounds``: the lower bounds among them); pooled over all three. The headline
    intervals (the hull of both depth estimators') first, then the rule's estimator's alone (``rule``)."""
    rows = phase1[phase1.method == estimator]
    d = rows[np.isfinite(rows.d_hi.astype(float))].covered.astype(bool)
    bounds = len(rows) - len(d)
    with_d = cases[cases.saturated]

    def count(suffix: str) -> dict:
        finite = {w: with_d[np.isfinite(with_d[f"{w}_hi{suffix}"])] for w in ("L", "P")}
        L, P = (finite[w][f"{w}_covered{suffix}"].astype(bool) for w in ("L", "P"))
        width = {f"{w}_width": float(np.median(f[f"{w}_hi{suffix}"] / f[f"{w}_lo{suffix}"])) if len(f) else None
                 for w, f in finite.items()}  # the median hi / lo of the finite intervals: how informative they are
        pooled = pd.concat([d, L, P])
        return width | {"d": float(d.mean()) if len(d) else None, "d_cases": int(len(d)), "L": float(L.mean()) if len(L) else None, "L_cases": int(len(L)),
                "P": float(P.mean()) if len(P) else None, "P_cases": int(len(P)),
                "uninformative": bounds + 2 * len(with_d) - len(L) - len(P), "d_bounds": bounds,
                "all": float(pooled.mean()), "cases": int(len(pooled))}
    return count("") | {"rule": count("_rule")}


def headline(cases: pd.DataFrame) -> pd.DataFrame:
    """One row per model, setup and platform: the largest phase-1 budget and the most timing trials."""
    top = cases.sort_values(["N", "trials"]).groupby(["model", "setup", "platform"], sort=False).tail(1)
    return top.sort_values(["model", "setup", "platform"], key=lambda c: c.map({"F": 0, "all": 1}).fillna(c) if c.name == "setup" else c)


METRIC_KEYS = ["model", "d_true", "d_hat_raw", "d_hat", "d_lo", "d_hi", "saturated", "lower_bound", "tokens", "calls", "usd", "wall_s",
               "L_true", "L_hat", "L_lo", "L_hi", "L_lo_rule", "L_hi_rule", "L_err", "rule", "L_hat_basic", "L_hat_eq10", "P_true",
               "P_hat", "P_lo", "P_hi", "P_lo_rule", "P_hi_rule", "P_err", "P_hat_paper", "P_err_paper", "P_hat_oracle", "P_err_oracle"]


def metrics(cases: pd.DataFrame, cover: dict, reference_platform: str) -> dict:
    """``metrics/validation.json``: per model, the in-process (reference platform) estimates against the
    reference family F at the full budget; the cross-platform and leave-one-out-among-all L_hat, P_hat beside them."""
    top = headline(cases)
    models = []
    for name, rows in top.groupby("model", sort=False):
        main = rows[(rows.setup == "F") & (rows.platform == reference_platform)]
        if main.empty:
            continue
        entry = {k: json_value(main.iloc[0][k]) for k in METRIC_KEYS}
        for r in rows.itertuples():
            if (r.setup, r.platform) != ("F", reference_platform):
                entry[f"{r.setup}_{r.platform}"] = {k: json_value(getattr(r, k)) for k in ("L_hat", "L_err", "P_hat", "P_err")} | {"rule": r.rule}
        models.append(entry)
    return {"models": models, "coverage": cover}


TABLE = {"model": "model", "setup": "references", "calibration": "timing calibration", "d_true": "d", "d_hat_raw": "d_hat raw",
         "d_hat": "d_hat (g=64)", "d_interval": "d 90 %", "L_true": "L", "L_hat": "L_hat", "L_interval": "L 90 %",
         "L_interval_rule": "L 90 % (rule's estimator alone)",
         "rule": "L rule", "L_hat_basic": "L_hat basic", "L_hat_eq10": "L_hat Eq. 10", "P_true": "P (M)", "P_hat": "P_hat (M)",
         "P_interval": "P 90 % (M)", "P_interval_rule": "P 90 % (M, rule's estimator alone)", "P_hat_paper": "P_hat paper ratios (M)", "P_hat_oracle": "P_hat true ratios (M)",
         "tokens": "tokens", "calls": "calls", "usd": "USD", "wall_s": "wall (s)"}


def results_table(cases: pd.DataFrame) -> pd.DataFrame:
    """The validation results table: every model, setup and platform at its full budget, intervals as text."""
    top = headline(cases).copy()
    def span(lo, hi, scale=1.0, fmt="{:.0f}"):
        return [interval_text(a, b, scale, fmt) for a, b in zip(lo, hi)]
    top["d_interval"] = span(top.d_lo, top.d_hi)
    top["L_interval"] = span(top.L_lo, top.L_hi, fmt="{:.1f}")
    top["L_interval_rule"] = span(top.L_lo_rule, top.L_hi_rule, fmt="{:.1f}")
    top["P_interval"] = span(top.P_lo, top.P_hi, 1e6)
    top["P_interval_rule"] = span(top.P_lo_rule, top.P_hi_rule, 1e6)
    top["setup"] = top.setup.map({"F": "F (random weights)", "all": "all timed models"})
    for column in ("P_true", "P_hat", "P_hat_paper", "P_hat_oracle"):
        top[column] = top[column] / 1e6
    return top[list(TABLE)].rename(columns=TABLE)
