"""Phase 2 Stages 2-3 over collected timings: L_hat and P_hat per model, leave-one-out (App. B.3).

Each model g (every reference model in turn, and the target) is held out: the references other
than g give beta^ref, alpha^ref (Eq. 2/6, L known) on the reference platform, and those of them
also timed on g's platform give gamma^tgt there (Eq. 7) and gamma^ref on the reference platform
(Eq. 6), so k (Eq. 8) compares the same models; g's own gamma^tgt_g gives
L_hat_g = gamma^tgt_g / (k beta^ref) (Eq. 10), with k = 1 on the reference platform itself. P_hat follows from Eq. 3 with the default ratios
(n_kv/n_heads = 1/4, d_ffn/d = 3.5, untied: the paper) and with the model's true ratios and tying
(the registry case); the vocabulary is known, as the paper assumes.

Records are the per-platform JSON files ``nv.phase2.platforms.time_model`` writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from nv.errors import NVError
from nv.outputs import json_value, read_json
from nv.phase2.fit import (
    Timings,
    attention_regime,
    depths,
    platform_fits,
    relative_error,
    total_params,
)


def load_records(root: Path, family: dict, platforms: dict) -> dict[str, list[dict]]:
    """Per platform (reference platform first): its reference records in params order, then the target's."""
    records: dict[str, list[dict]] = {}
    for platform, cfg in platforms.items():
        names = list(family) if cfg["references"] == "all" else cfg["references"]
        unknown = sorted(set(names) - set(family))
        if unknown:
            raise NVError(f"params: timing.platforms.{platform}.references names {unknown}, not in timing_family")
        folders = [root / "outputs" / "timing_reference" / name for name in names] + [root / "outputs" / "timing_target"]
        records[platform] = []
        for folder in folders:
            records[platform].append(read_json(folder / f"{platform}.json"))
    return records


def regime(record: dict, discard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A record's (ell, T, sigma) in the attention-dominated regime (App. D: shortest points dropped)."""
    return attention_regime(np.array(record["ell"]), np.array(record["T"]), np.array(record["sigma"]), discard)


def timings(records: list[dict], discard: int, d_key: str = "d_used") -> Timings:
    """Flat Timings over models; d from ``d_key`` ('d' true, 'd_used' what the attack knows)."""
    parts = [regime(r, discard) for r in records]
    count = [len(p[0]) for p in parts]
    return Timings(
        ell=np.concatenate([p[0] for p in parts]),
        T=np.concatenate([p[1] for p in parts]),
        sigma=np.concatenate([p[2] for p in parts]),
        d=np.repeat([float(r[d_key]) for r in records], count),
        L=np.repeat([float(r["L"]) for r in records], count),
    )


ESTIMATES = ["beta", "alpha", "gamma_ref", "gamma_tgt", "gamma_g", "k", "t", "t_eq10"] + [
    name + suffix for suffix in ("", "_eq10") for name in ["L_hat", "L_hat_rounded", "L_err", "L_err_rounded", "note"] + [
        f"{what}_{label}_{rounding}" for label in ("paper", "registry") for rounding in ("raw", "rounded") for what in ("P_hat", "P_err")]]


def param_estimates(record: dict, d_hat: float, L_hat: float, timing: dict, suffix: str = "") -> dict:
    """Eq. 3 with the default ratios ('paper') and the true ratios and tying ('registry')."""
    V = record["vocab_size"]
    true_ratios = (record["n_kv_heads"] / record["n_heads"], record["d_ffn"] / record["d"], record["tied"])
    out = {}
    for label, (kv, ffn, tied) in {"paper": (timing["kv_ratio"], timing["ffn_ratio"], False), "registry": true_ratios}.items():
        for rounding, L in (("raw", L_hat), ("rounded", max(1, round(L_hat)))):
            P_hat = total_params(d_hat, L, V, kv, ffn, tied)
            out[f"P_hat_{label}_{rounding}{suffix}"] = P_hat
            out[f"P_err_{label}_{rounding}{suffix}"] = float(relative_error(P_hat, record["P"]))
    return out


def depth_fields(g: dict, d_hat: float, L_hat: float, timing: dict, suffix: str) -> dict:
    """L_hat (raw, rounded), its relative errors and the P_hat that follow; a note when L_hat <= 0."""
    if not L_hat > 0:
        return {f"note{suffix}": f"L_hat = {L_hat:.3g}: the timings do not grow with ell^2 d (too noisy or too short)"}
    rounded = max(1, round(L_hat))
    return {f"L_hat{suffix}": L_hat, f"L_hat_rounded{suffix}": rounded, f"L_err{suffix}": float(relative_error(L_hat, g["L"])),
            f"L_err_rounded{suffix}": float(relative_error(rounded, g["L"]))} | param_estimates(g, d_hat, L_hat, timing, suffix)


def calibrates(r: dict, g: dict) -> bool:
    """Whether record ``r`` may calibrate held-out ``g``: a reference other than g and of another shape (d, L, P). A
    timing depends on the shape alone, so a reference of g's (g's own model under another name, as the paper
    profile's SmolLM2-135M-Instruct beside the embedded target, or a fine-tune of it) would hand g its own curve."""
    return r["role"] == "reference" and r["model"] != g["model"] and (r["d"], r["L"], r["P"]) != (g["d"], g["L"], g["P"])


def held_out(reference: list[dict], platform: list[dict], g: dict, timing: dict, d_key: str) -> dict:
    """L_hat, P_hat of record ``g`` (timed on its platform), calibrated on the other references:
    beta, alpha, gamma^ref on the reference platform's records, gamma^tgt on g's platform's (Eqs. 6-10, 3).

    Two depth estimators, both the paper's: ``L_hat`` is the basic estimator of §4.2, g's timings
    solved for L in T = k beta L ell^2 d_hat + alpha (Eq. 2; Eq. 9 across platforms), the intercept
    fixed by the references; ``L_hat_eq10`` is Fig. algo_timing's gamma_g / (k beta) (Eq. 10), whose
    gamma_g comes with g's own free intercept zeta_g.
    """
    def others(records: list[dict], among: set[str] | None = None) -> list[dict]:
        return [r for r in records if calibrates(r, g) and (among is None or r["model"] in among)]

    # Eq. 8's k compares the same models on both platforms: those timed on both (a reference timed on g's platform
    # alone would pool a deeper or shallower set into gamma^tgt than gamma^ref, and the pooled gamma grows with depth)
    ref = others(reference)
    both = {r["model"] for r in ref} & {r["model"] for r in others(platform)}
    tgt, tgt_on_ref = others(platform, both), others(reference, both)
    discard = timing["discard"]
    d_hat = float(g[d_key])
    row = {"model": g["model"], "role": g["role"], "platform": g["platform"], "d_source": "d_hat" if d_key == "d_used" else "true d",
           "d_true": g["d"], "d_used": d_hat, "L_true": g["L"], "P_true": g["P"], "lengths": g["ell"], "trials": g["trials"], "tokens": g["tokens"]}
    try:
        if min(len(ref), len(tgt_on_ref)) < 2:
            raise NVError(f"the fits need two reference models besides {g['model']} on each platform")
        target = timings([g], discard, d_key)
        est = platform_fits(timings(ref, discard, "d"), timings(tgt, discard, "d"), target, timings(tgt_on_ref, discard, "d"))
        beta, alpha = est.reference.slope, est.reference.intercept
        both = depths(beta, alpha, est.k, d_hat, target.ell, target.T, target.sigma, est.gamma_g)
    except NVError as exc:  # a fit that cannot give a depth is reported, not fatal
        return row | {"note": str(exc)}
    (basic, t), (eq10, t_eq10) = both["basic"], both["eq10"]
    return (row | {"beta": beta, "alpha": alpha, "gamma_ref": est.gamma_ref.slope, "gamma_tgt": est.gamma_tgt.slope,
                   "gamma_g": est.gamma_g.slope, "k": est.k, "t": t, "t_eq10": t_eq10, "note": ""}
            | depth_fields(g, d_hat, basic, timing, "") | depth_fields(g, d_hat, eq10, timing, "_eq10"))


def evaluate(records: dict[str, list[dict]], timing: dict) -> pd.DataFrame:
    """Every model held out on every platform (the reference platform is the first), with the d the
    attack knows (d_hat for the target); the target also with its true d, as the paper's figures assume."""
    reference = next(iter(records))
    rows = []
    for platform, recs in records.items():
        for g in recs:
            rows.append(held_out(records[reference], recs, g, timing, "d_used"))
            if g["role"] == "target":
                rows.append(held_out(records[reference], recs, g, timing, "d"))
    table = pd.DataFrame(rows).reindex(columns=list(dict.fromkeys([*rows[0], *ESTIMATES])))  # every column, even if no fit worked
    table.insert(3, "calibration", np.where(table.platform == reference, "same platform", f"{reference} -> " + table.platform))
    return table

METRIC_KEYS = ["model", "calibration", "d_source", "d_used", "L_true", "L_hat", "L_hat_rounded", "L_err", "P_true",
               "P_hat_registry_raw", "P_err_registry_raw", "P_hat_paper_raw", "P_err_paper_raw", "L_hat_eq10", "L_err_eq10",
               "P_hat_registry_raw_eq10", "P_err_registry_raw_eq10", "beta", "alpha", "k", "gamma_g", "lengths", "trials",
               "tokens", "note", "note_eq10"]


def metrics(table: pd.DataFrame, timing: dict) -> dict:
    """``metrics/timing.json``: the attacked model's rows in full, and the references' mean errors."""
    target = table[table.role == "target"]
    refs = table[table.role == "reference"].groupby("calibration")
    return {
        "target": [{k: json_value(row.get(k)) for k in METRIC_KEYS} for row in target.to_dict("records")],
        "references_mean": {c: {k: json_value(g[k].mean()) for k in ("L_err", "P_err_registry_raw", "P_err_paper_raw", "L_err_eq10")}
                            | {"models": len(g), "failed": int(g.L_hat.isna().sum())} for c, g in refs},
        "platforms": timing["platforms"],
        "discard": timing["discard"],
    }

