"""Figure of the budget planner (issue 14; ``nv.phase1.planner``): predicted against measured common-set size."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def common_set_vs_N(table: pd.DataFrame, curves: dict[str, tuple[np.ndarray, np.ndarray]], summary: pd.DataFrame):
    """One panel per model: the strict common set measured at each budget (dots) and the pilot's prediction (line),
    the greedy-pruned common set (squares), the true d, the planner's N for |C| >= d and the measured stops: the
    budget sweep's first exact N and the adaptive loop's (``sampling.N: auto``, where it stops inside the draws)."""
    models = list(dict.fromkeys(table.model))
    fig, axes = plt.subplots(1, len(models), figsize=(5.4 * len(models), 7.0), squeeze=False)  # the legend below
    for ax, model in zip(axes[0], models):
        rows, s = table[table.model == model], summary.set_index("model").loc[model]
        N, mu = curves[model]
        ax.plot(N, np.where(mu >= 1, mu, np.nan), color="C0",  # below one token the log axis has nothing to show
                label=f"predicted from the pilot ({s.pilot_prompts:.0f} x {s.pilot_N:,.0f})")
        ax.plot(rows.N, np.maximum(rows.measured_C, 0.5), "o", color="C0", label="measured: tokens under every prompt")
        ax.plot(rows.N, rows.pruned_C, "s", mfc="none", color="C2",
                label=f"measured: greedy-pruned common set (over D' = {rows.pruned_D.min():,.0f}-{rows.pruned_D.max():,.0f} "
                      "of the prompts)")
        ax.axhline(s.d_true, color="k", ls=":", lw=1, label=f"true d = {s.d_true:.0f}")
        if np.isfinite(s.N_for_d):
            ax.axvline(s.N_for_d, color="C0", ls="--", lw=1, label=f"planner: |C| >= d at N = {s.N_for_d:,.0f}")
        if np.isfinite(s.stop_N):
            ax.axvline(s.stop_N, color="C3", ls="-.", lw=1,
                       label=f"robust estimator exact from N = {s.stop_N:,.0f} (budget sweep)")
        if np.isfinite(s.adaptive_stop_N):
            ratio = f" ({s.adaptive_stop_N / s.N_for_d:.2g}x the planner's)" if np.isfinite(s.N_for_d) else ""
            ax.axvline(s.adaptive_stop_N, color="C1", ls="-", lw=1.2,
                       label=f"adaptive loop stops at N = {s.adaptive_stop_N:,.0f}{ratio}")
        ax.set(xscale="log", yscale="log", ylim=(0.5, None), xlabel="samples per prompt N",
               ylabel=f"common set |C| (strict: under all D = {s.D:,.0f} prompts)", title=model)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)  # under the x label
    fig.suptitle("Budget planner: the common set of the full attack predicted from a pilot (Theorem 1's mean, fitted tail)",
                 y=1.02)
    fig.tight_layout()
    return fig
