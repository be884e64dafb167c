"""Overall results (§5.1, Fig. err_d_L_N_plot for the attacked model): d_hat -> L_hat -> P_hat and their errors versus total budget.

Phase 2 depends on phase 1 only through d_hat: both depth estimators fit T on L ell^2 d_hat (the basic one, whose
L_hat is used here, and Eq. 10), so L_hat(d_hat) = L_hat(d_used) d_used / d_hat exactly; P_hat follows from
Eq. 3. A budget point combines one phase-1 budget (a row of the budget sweep: its d_hat and tokens)
with one timing budget (the first K' trials of every length, re-summarized and re-fitted), the total
budget being the sum of both token counts (§5 metric).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from nv.phase2.protocol import LengthTimings, summarize
from nv.phase2.evaluation import held_out
from nv.phase2.fit import relative_error, total_params


def with_trials(record: dict, trials: int, trim: float) -> dict:
    """A timing record cut to its first ``trials`` trials per length, re-summarized (App. D)."""
    rows = [LengthTimings(r["target"], r["ell"][:trials], r["seconds"][:trials]) for r in record["rows"]]
    stats = summarize(rows, trim)
    return record | {"rows": [r.__dict__ for r in rows], "ell": stats["ell"].tolist(), "T": stats["T"].tolist(),
                     "sigma": stats["sigma"].tolist(), "trials": trials, "tokens": int(stats["tokens"])}


def timed_tokens(record: dict) -> int:
    """§5's tokens of a timing record's timed calls: prompt + 1 each (the record's ``tokens`` count the prompts alone;
    the warm-ups' prompts are not recorded: left out, ~1 % of a sweep's)."""
    return record["tokens"] + sum(len(r["seconds"]) for r in record["rows"])


def timing_budgets(records: dict[str, list[dict]], timing: dict, trial_counts: list[int]) -> pd.DataFrame:
    """The target's L_hat (with d_used) on each platform when only K' trials per length are spent."""
    reference = next(iter(records))
    out = []
    for platform, recs in records.items():
        target = next(r for r in recs if r["role"] == "target")
        for K in trial_counts:
            if K > target["trials"]:
                continue
            g = with_trials(target, K, timing["trim"])
            row = held_out(records[reference], recs, g, timing, "d_used")
            out.append({"platform": platform, "trials": K, "timing_tokens": timed_tokens(g), "L_hat_at_d_used": row.get("L_hat", np.nan),
                        "d_used": g["d_used"], "L_true": g["L"], "P_true": g["P"], "note": row["note"]})
    return pd.DataFrame(out)


def combine(phase1: pd.DataFrame, timing: pd.DataFrame, facts: dict, kv_ratio: float, ffn_ratio: float) -> pd.DataFrame:
    """Every (phase-1 budget, timing budget) pair: d_hat, L_hat = L_hat(d_used) d_used / d_hat, P_hat
    (Eq. 3 with the given ratios and the known vocabulary), their relative errors and the total tokens.

    ``phase1``: budget-sweep rows of one estimator (N, tokens, d_hat; d_hat NaN when not saturated);
    ``facts``: the target's true d, L, P, vocab_size and tied (evaluation only).
    """
    rows = []
    for p1 in phase1.itertuples():
        for t in timing.itertuples():
            d_hat = float(p1.d_hat) if pd.notna(p1.d_hat) else np.nan
            L_hat = t.L_hat_at_d_used * t.d_used / d_hat if d_hat > 0 else np.nan
            P_hat = total_params(d_hat, L_hat, facts["vocab_size"], kv_ratio, ffn_ratio, facts["tied"]) if L_hat > 0 else np.nan
            rows.append({"N": p1.N, "platform": t.platform, "trials": t.trials, "phase1_tokens": p1.tokens,
                         "timing_tokens": t.timing_tokens, "tokens": p1.tokens + t.timing_tokens, "d_hat": d_hat, "L_hat": L_hat,
                         "P_hat": P_hat, "d_err": _err(d_hat, facts["d"]), "L_err": _err(L_hat, facts["L"]),
                         "P_err": _err(P_hat, facts["P"])})
    return pd.DataFrame(rows)


def _err(estimate: float, truth: float) -> float:
    return float(relative_error(estimate, truth)) if np.isfinite(estimate) else np.nan


RESULT_COLUMNS = {"model": "model", "role": "role", "calibration": "timing calibration", "d_true": "d", "d_used": "d_hat",
                  "L_true": "L", "L_hat": "L_hat", "L_err": "L error", "L_hat_eq10": "L_hat (Eq. 10)",
                  "L_err_eq10": "L error (Eq. 10)", "P_true": "P", "P_hat_registry_raw": "P_hat (true ratios)",
                  "P_err_registry_raw": "P error (true ratios)", "P_hat_paper_raw": "P_hat (paper ratios)",
                  "P_err_paper_raw": "P error (paper ratios)", "tokens": "timing tokens", "note": "note"}


def results_table(estimates: pd.DataFrame) -> pd.DataFrame:
    """One row per model and timing calibration: what the attack knows (d_hat: phase 1 for the target,
    the true d for references) and its L_hat, P_hat with relative errors."""
    rows = estimates[estimates.d_source == "d_hat"]
    return rows[[c for c in RESULT_COLUMNS if c in rows]].rename(columns=RESULT_COLUMNS)


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub markdown table (numbers to 3 significant digits, errors in %)."""
    def cell(column: str, value) -> str:
        if isinstance(value, float) and not np.isfinite(value):
            return ""
        if "error" in column and isinstance(value, float):
            return f"{100 * value:.1f} %"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + " --- |" * len(table.columns)]
    lines += ["| " + " | ".join(cell(c, v) for c, v in zip(table.columns, row)) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"
