"""The overall figure (§5.1, Fig. err_d_L_N_plot for the attacked model): relative error of d_hat, L_hat, P_hat versus total budget."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nv.plots.validation import FAIL_Y, error_axis, fail_band, k_markers, log_axis


def _percents(errors) -> str:
    """Relative errors as "1.0 / 2.0 %"; a timing budget without a fit says so."""
    return " / ".join(f"{100 * v:.1f}" if np.isfinite(v) else "no fit" for v in errors) + " %"


def error_vs_budget(table: pd.DataFrame, model: str):
    """One panel per platform: relative errors of d, L and P against the total tokens (phase 1 +
    timing); a colour per estimate, a marker per timing budget K' (trials per length), and the values written out in
    a corner (the K' markers of one phase-1 budget stack). Phase-1 budgets without a saturated spectrum have no d_hat:
    red crosses in the "no estimate" band above the axes."""
    platforms = list(dict.fromkeys(table.platform))
    fig, axes = plt.subplots(1, len(platforms), figsize=(6.2 * len(platforms), 4.6), squeeze=False, sharey=True)
    for ax, platform in zip(axes[0], platforms):
        sub = table[table.platform == platform]
        markers = k_markers(sub.trials)
        for K, rows in sub.groupby("trials"):  # K' by marker, the estimate by colour
            marker, rows = markers[int(K)], rows.sort_values("tokens")
            for what, color in (("d", "C0"), ("L", "C1"), ("P", "C2")):
                ax.plot(rows.tokens, 100 * rows[f"{what}_err"], "-", marker=marker, ms=5, mfc="none", color=color, alpha=0.8)
            ax.plot([], [], marker, mfc="none", color="0.3", label=f"K' = {K} timing trials")
        for what, color in (("d", "C0"), ("L", "C1"), ("P", "C2")):
            ax.plot([], [], "-", color=color, label=f"{what}_hat")
        fail_band(ax, sub[sub.d_hat.isna()].tokens.unique(), FAIL_Y, "spectrum not saturated: no d_hat")
        # the timing budgets add few tokens to a phase-1 budget: their markers stack, so the values are also written out
        lines = [f"N = {N:.3g} ({rows.phase1_tokens.iloc[0]:.2g} tokens + timing): d {100 * rows.d_err.iloc[0]:.1f} %\n"
                 f"   K' = {'/'.join(f'{k:g}' for k in rows.trials)}: L {_percents(rows.L_err)}, P {_percents(rows.P_err)}"
                 for N, rows in sub[sub.d_hat.notna()].sort_values("trials").groupby("N")]
        if lines:
            ax.text(0.02, 0.86, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "0.7", "pad": 2})
        ax.axhline(30, ls=":", color="0.5", lw=1)
        error_axis(ax)
        ax.margins(x=0.08)  # the largest budget off the axis' edge
        log_axis(ax, "total budget (tokens: phase 1 + timing)")
        ax.set(ylabel="|relative error| (%)", title=f"{model} on {platform}")
        ax.legend(fontsize=7)
    fig.suptitle("Overall: d from the common-set spectrum, then L and P from timing (dotted: 30 %)")
    fig.tight_layout()
    return fig
