"""Figure of where phase 1 becomes exact (issue 14; ``nv.phase1.exactness``): the (D, N) grid per model and tau."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.transforms import offset_copy
import numpy as np
import pandas as pd

from nv.phase1.exactness import OUTCOMES, cheapest_exact
from nv.phase1.spectrum import snap
from nv.plots import ESTIMATOR_MARKERS

OUTCOME_COLORS = dict(zip(OUTCOMES, ("tab:green", "tab:orange", "0.65", "tab:red")))
MARKERS = {method: (shift, ESTIMATOR_MARKERS[method])  # x shift of each estimator, marker
           for method, shift in (("robust", 0.8), ("paper", 1.0), ("incomplete", 1.25))}


def _said(rows: pd.DataFrame) -> str:
    """What an estimator said in one cell: its d_hat_raw, "≥" its lower bound, or "-" (no estimate, or not run)."""
    if rows.empty:
        return "-"
    r = rows.iloc[0]
    return f"{r.d_hat_raw:.0f}" if pd.notna(r.d_hat_raw) else f"≥{r.lower_bound:.0f}" if pd.notna(r.lower_bound) else "-"


def grid(table, paper_budget: tuple[int, int] | None = None, adaptive: pd.DataFrame | None = None,
         paper_g: int | None = None):
    """Where phase 1 becomes exact: one panel per (model, tau), each (N, D) cell a square (robust), a circle (paper
    estimator) and a diamond (missing-data estimator, where the table has it) coloured by outcome (exact: d within
    ``d_interval``'s max(3, 0.5 % of d_hat_raw) of d_hat_raw), what each said written under the cell in that order
    (``_said``), dashed lines of equal token cost, the cheapest exact cell of each estimator
    ringed and listed in the panel's corner with its raw answer (and, given ``paper_g``, the paper estimator's as
    Alg. 2 reports it, snapped to g ceil(d_hat / g)); ``paper_budget`` = (D, N) of the paper's own sampling, a star
    (its token cost at the panel's mean prompt length); ``adaptive`` (``exactness.adaptive_stop``'s stops: model,
    temperature, N, d_hat_raw, stop), a triangle where the adaptive loop stopped on all D prompts."""
    panels = list(table.groupby(["model", "temperature"], sort=False))
    ncols = 2 if len(panels) == 4 else min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 5.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    best = cheapest_exact(table).set_index(["model", "temperature", "method"])
    shift = {m: v for m, v in MARKERS.items() if m in set(table.method)}
    for ax, ((model, tau), g) in zip(axes.flat, panels):
        cheapest = []
        per_call = float(np.median(g.tokens / (g.D * g.N)))  # prompt + output tokens per call
        for method, (x, marker) in shift.items():
            rows = g[g.method == method]
            ax.scatter(rows.N * x, rows.D, c=[OUTCOME_COLORS[o] for o in rows.outcome], marker=marker, s=70,
                       edgecolors="k", linewidths=0.5, zorder=3)
            b = best.loc[(model, tau, method)]
            if np.isfinite(b.tokens):
                ax.scatter(b.N * x, b.D, s=300, facecolors="none", edgecolors="k", linewidths=1.4, zorder=4)
                raw = rows[(rows.D == b.D) & (rows.N == b.N)].d_hat_raw.iloc[0]
                snapped = f" (Alg. 2 reports {snap(int(raw), paper_g)})" if method == "paper" and paper_g else ""
                cheapest.append(f"{method}: {b.tokens:.2g} tokens at {b.D:,.0f} x {b.N:.3g}, raw {raw:.0f}{snapped}")
        for (N, D), cell in g.groupby(["N", "D"]):  # what each estimator said, left to right: d_hat_raw or d >= bound
            said = [_said(cell[cell.method == method]) for method in shift]
            ax.annotate("/".join(said), (N, D), textcoords="offset points", xytext=(0, -10), ha="center", va="top",
                        fontsize=6, color="0.2", zorder=4,  # one line under the cell, below a cheapest cell's ring
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.8})  # over the cost lines
        ax.text(0.02, 0.98, "cheapest exact (ringed):\n" + ("\n".join(cheapest) or "none on this grid"),
                transform=ax.transAxes, ha="left", va="top", fontsize=6.5, zorder=5,
                bbox={"facecolor": "white", "edgecolor": "0.7", "pad": 2})
        stops = adaptive[(adaptive.model == model) & (adaptive.temperature == tau) & adaptive.N.notna()] \
            if adaptive is not None and len(adaptive) else pd.DataFrame()
        above = offset_copy(ax.transData, fig=fig, y=26, units="points")  # over its own (N, all D) cell, pointing at it
        for r in stops.itertuples():
            said = f"raw {r.d_hat_raw:.0f}" if pd.notna(r.d_hat_raw) else f"d >= {r.lower_bound:.0f}"
            ax.scatter(r.N, g.D.max(), marker="v", s=90, color="tab:blue", edgecolors="k", zorder=4, transform=above)
            verdict = (f"stops at N = {r.N:.2g}" if r.stop == "stable" else
                       f"no stop by N = {r.N:.2g} (its next round: past the draws)")
            ax.annotate(f"adaptive (D = {g.D.max():,}): {said},\n{verdict}", (r.N, g.D.max()), textcoords="offset points",
                        xytext=(0, 34), ha="center", fontsize=7, color="tab:blue")
        N_lo, N_hi = g.N.min() / 2, g.N.max() * 2
        D_lo, D_hi = g.D.min() / 1.6, g.D.max() * (3.2 if len(stops) else 1.6)
        if paper_budget:
            D_p, N_p = paper_budget
            ax.scatter(N_p, D_p, marker="*", s=220, color="k", zorder=4)
            ax.annotate(f"paper's budget: {D_p * N_p * per_call:.2g} tokens", (N_p, D_p), textcoords="offset points",
                        xytext=(-10, 0), ha="right", va="center", fontsize=7)
            N_hi, D_hi = max(N_hi, N_p * 2), max(D_hi, D_p * 2.5)  # room above the star for the corner list
        N_line = np.geomspace(N_lo, N_hi, 50)
        for exponent in range(int(np.floor(np.log10(D_lo * N_lo * per_call))),
                              int(np.ceil(np.log10(D_hi * N_hi * per_call))) + 1):
            ax.plot(N_line, 10.0**exponent / (per_call * N_line), ls="--", color="0.75", lw=0.8, zorder=1)
            D_label = 10.0**exponent / (per_call * N_hi / 1.25)  # at the right edge, clear of the corner list
            if D_lo < D_label < D_hi:
                ax.text(N_hi / 1.25, D_label, f"1e{exponent}", fontsize=7, color="0.5", ha="center", va="center",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
        ax.set(xscale="log", yscale="log", xlim=(N_lo, N_hi), ylim=(D_lo, D_hi), xlabel="samples per prompt N",
               ylabel="prompts D", title=f"{model}, tau = {tau:g}, true d = {int(g.d_true.iloc[0])}")
        Ns, Ds = sorted({*g.N, *([N_p] if paper_budget else [])}), sorted({*g.D, *([D_p] if paper_budget else [])})
        ax.set_xticks(Ns, [f"{v:.0e}".replace("e+0", "e") for v in Ns])  # the grid's own N and D: its cells readable
        ax.set_yticks(Ds, [f"{v:,.0f}" for v in Ds])
        ax.minorticks_off()
    handles = [plt.Line2D([], [], ls="", marker="s", mfc=c, mec="k",
                          label="exact: |d_hat_raw - d| <= max(3, 0.5 % d_hat_raw)" if o == "exact" else o)
               for o, c in OUTCOME_COLORS.items()]
    handles += [plt.Line2D([], [], ls="", marker=marker, mfc="w", mec="k", label=f"{method} ({where})")
                for (method, (_, marker)), where in zip(shift.items(), ("left", "middle", "right") if len(shift) == 3
                                                        else ("left", "right"))]
    handles += [plt.Line2D([], [], ls="", marker="$576$", ms=14, color="0.2",
                           label="under a cell: what each said (≥: lower bound)"),
                plt.Line2D([], [], ls="", marker="o", ms=12, mfc="none", mec="k", label="cheapest exact"),
                plt.Line2D([], [], ls="--", color="0.75", label="equal token cost")]
    if adaptive is not None and len(adaptive):
        handles.append(plt.Line2D([], [], ls="", marker="v", mfc="tab:blue", mec="k", label="adaptive stop (over its cell)"))
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // 3), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle("Where phase 1 becomes exact: outcome of each estimator per (D, N), the first D prompts, N calls thinned")
    fig.tight_layout(rect=(0, 0.055, 1, 1))
    return fig


def threshold(table: pd.DataFrame, limits: pd.DataFrame):
    """What decides a cell's outcome: the robust estimator's answer over d (d_hat_raw, or the lower bound when not
    saturated) against the common set's ``edge_ratio`` R, one panel per model, one marker per tau, coloured by outcome;
    ``limits`` (``exactness.threshold``) shades the band where the model's threshold R* lies when R separates the
    exact cells from the others."""
    robust = table[table.method == "robust"]
    models = list(dict.fromkeys(robust.model))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    markers = dict(zip(sorted(robust.temperature.unique()), "os^Dvp<>"))
    lim = limits.set_index("model")
    for ax, model in zip(axes.flat, models):
        g = robust[robust.model == model]
        answer = g.d_hat_raw.fillna(g.lower_bound) / g.d_true
        for tau, marker in markers.items():
            at = g.temperature == tau
            if at.any():
                ax.scatter(g.R[at], answer[at], c=[OUTCOME_COLORS[o] for o in g.outcome[at]], marker=marker, s=45,
                           edgecolors="k", linewidths=0.5, zorder=3)
        row = lim.loc[model]
        if row.separates:
            ax.axvspan(row.R_max_not_exact, row.R_min_exact, color="tab:green", alpha=0.25, zorder=1)
            ax.annotate(f"R* in ({row.R_max_not_exact:.0f}, {row.R_min_exact:.0f}] (shaded)", (0.02, 0.97),
                        xycoords="axes fraction", fontsize=8, va="top", zorder=5,  # top left: above the small-R cells'
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # low answers, wherever the band lies
        elif row.separates is False:
            ax.annotate("exact and not-exact cells overlap in R", (0.02, 0.95), xycoords="axes fraction", fontsize=8,
                        va="top", color="tab:red")
        ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
        ax.set(xscale="log", ylim=(0, 1.15), xlabel="R = D' |C| / (sqrt D' + sqrt |C|)^2 of the common set",
               ylabel="robust answer / d (lower bound when not saturated)",
               title=f"{model}, true d = {int(g.d_true.iloc[0])}: {len(g)} cells")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # decade labels only (after the log scale, which resets formatters): minor ones overlap on narrow ranges
    handles = [plt.Line2D([], [], ls="", marker="s", mfc=c, mec="k", label=o) for o, c in OUTCOME_COLORS.items()
               if o != "no estimate"]
    handles += [plt.Line2D([], [], ls="", marker=m, mfc="w", mec="k", label=f"tau = {t:g}") for t, m in markers.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle("What decides exactness: the common set's shape through R, against a threshold of the model")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
