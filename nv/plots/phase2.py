"""Phase 2 figures: the scaling relation, measured vs predicted runtime, per-model errors, platforms."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nv.errors import NVError
from nv.phase2.evaluation import timings
from nv.phase2.fit import fit_gamma, fit_scaling, scaling_relation, transfer_factor

_LABELS = {"inprocess": "in-process (torch, CPU)", "llamacpp": "llama.cpp server (HTTP, CPU)"}


def _colors(records: dict[str, list[dict]]) -> dict[str, str]:
    """One colour per model in every platform's panel: tab10 for the references in their first order, for the real
    models (role target) a darker set none of tab10's; by position per panel, a reference changed colour between
    platforms whose reference lists differ."""
    roles: dict[str, dict] = {"reference": {}, "target": {}}
    for recs in records.values():
        for r in recs:
            roles["target" if r["role"] == "target" else "reference"].setdefault(r["model"], None)
    dark = ["k", "0.45", "darkviolet", "darkgreen", "saddlebrown"]
    return ({m: f"C{i % 10}" for i, m in enumerate(roles["reference"])}
            | {m: dark[i % len(dark)] for i, m in enumerate(roles["target"])})


def _marker(record: dict) -> dict:
    return {"marker": "*", "s": 90, "zorder": 3} if record["role"] == "target" else {"marker": "o", "s": 18}


SCALING_TITLE = "Timing scaling relation T ~ beta L ell^2 d + alpha (hollow: short lengths discarded, App. D)"


def scaling(records: dict[str, list[dict]], discard: int, title: str = SCALING_TITLE):
    """Paper's scaling figure (Fig. scaling_block_b): prefill time T versus L ell^2 d, one panel per
    platform, log-log (the models span two decades: linear axes piled the small ones at the origin); filled points are
    the fitted attention regime, hollow ones the discarded short lengths; the line is Eq. 2 fitted on the reference
    models (true d and L). Real models (role target: the attacked model, and in the validation every model of the set)
    are stars, each in its own colour: off the line is what their family details do to the single scaling law."""
    fig, axes = plt.subplots(1, len(records), figsize=(8.4 * len(records), 4.6), squeeze=False)
    colors = _colors(records)
    for ax, (platform, recs) in zip(axes[0], records.items()):
        refs = [r for r in recs if r["role"] == "reference"]
        pts = timings(refs, discard, "d")
        fit = fit_scaling(pts.L, pts.d, pts.ell, pts.T, pts.sigma)
        span = []
        for r in recs:
            x = r["L"] * np.array(r["ell"]) ** 2 * r["d"]
            span += [x.min(), x.max()]
            order = np.argsort(r["ell"])
            label = f"{r['model']} (d={r['d']}, L={r['L']})" + (" target" if r["role"] == "target" else "")
            color = colors[r["model"]]
            ax.scatter(x[order[discard:]], np.array(r["T"])[order[discard:]], color=color, label=label, **_marker(r))
            ax.scatter(x[order[:discard]], np.array(r["T"])[order[:discard]], facecolor="none", edgecolor=color, s=14)
        xs = np.geomspace(min(span), max(span), 50)
        line = fit.slope * xs + fit.intercept
        ax.plot(xs[line > 0], line[line > 0], "k--", lw=1,
                label=f"Eq. 2 fit: beta={fit.slope:.3g} s per layer x token^2 x dim, alpha={fit.intercept:.3g} s")
        ax.set(xlabel="L ell^2 d (layers x tokens^2 x hidden size)", ylabel="prefill time T (s, minus ell=1 baseline)",
               title=_LABELS.get(platform, platform), xscale="log", yscale="log")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: the points stay visible
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def measured_vs_predicted(records: dict[str, list[dict]], table: pd.DataFrame):
    """Fig. scaling_law: measured T versus Eq. 2's prediction with the leave-one-out beta, alpha and
    the true L, d of each model (same-platform calibration), log-log (two decades of T)."""
    fig, axes = plt.subplots(1, len(records), figsize=(5.4 * len(records), 4.8), squeeze=False)
    colors = _colors(records)
    for ax, (platform, recs) in zip(axes[0], records.items()):
        same = table[(table.platform == platform) & (table.d_source == "d_hat")].set_index("model")
        span = []
        for r in recs:
            row = same.loc[r["model"]]
            pred = scaling_relation(row["k"] * row["beta"], row["alpha"], r["L"], r["d"], np.array(r["ell"]))
            ax.scatter(pred, r["T"], color=colors[r["model"]], label=r["model"], **_marker(r))
            span += [v for v in (*pred, *r["T"]) if v > 0]  # what a log axis can show
        ends = [min(span), max(span)]
        ax.plot(ends, ends, ":", color="0.4", lw=1, label="measured = predicted")
        ax.set(xlabel="predicted T = k beta L ell^2 d + alpha (s)", ylabel="measured T (s)", title=_LABELS.get(platform, platform),
               xscale="log", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle("Measured versus predicted prefill time (each model held out of its own calibration)")
    fig.tight_layout()
    return fig


def errors(table: pd.DataFrame):
    """Fig. val_plot_n_layers / cross_gpu: relative error of L_hat and P_hat per model and calibration;
    dark bars: the basic estimator of §4.2 (Eq. 2 solved for L; Eq. 9 across platforms), light: the same with L_hat
    rounded to an integer, hatched: Eq. 10's gamma_g / (k beta). P_hat uses the true ratios (registry). A missing
    estimate (no fit) is a red cross in a band under the axis, never a bar-less 0 %. The legend sits under the
    panels, where it hides no bar."""
    rows = table[table.d_source == "d_hat"]
    groups = list(dict.fromkeys(rows.calibration))
    fig, axes = plt.subplots(2, len(groups), figsize=(6.5 * len(groups), 8.4), squeeze=False, sharey="row")
    for r, (what, col) in enumerate([("L", "L_err{}"), ("P", "P_err_registry_raw{}")]):
        color = "C0" if what == "L" else "C2"
        rounded = "L_err_rounded" if what == "L" else "P_err_registry_rounded"
        top = 100 * float(np.nanmax(rows[[col.format(""), rounded, col.format("_eq10")]].to_numpy(dtype=float), initial=0.0))
        top = max(top, 1.0)
        for c, group in enumerate(groups):
            ax = axes[r, c]
            sub = rows[rows.calibration == group]
            x = np.arange(len(sub))
            ax.bar(x - 0.27, 100 * sub[col.format("")], 0.27, color=color,
                   label="basic (Eq. 2 solved for L)" if group == "same platform" else "basic (Eq. 9)")
            ax.bar(x, 100 * sub[rounded], 0.27, color=color, alpha=0.4, label="basic, L_hat rounded")
            ax.bar(x + 0.27, 100 * sub[col.format("_eq10")], 0.27, color="white", edgecolor=color, hatch="///",
                   label="gamma_g / (k beta) (Eq. 10)")
            # a missing bar (no fit) and one of exactly 0 % look alike: no fit is a cross under the axis, 0 % a dot on it
            ax.axhspan(-0.14 * top, -0.02 * top, color="crimson", alpha=0.07, zorder=0)
            zero = False
            for shift, values in ((-0.27, sub[col.format("")]), (0.0, sub[rounded]), (0.27, sub[col.format("_eq10")])):
                for xi, v in zip(x, values.to_numpy(dtype=float)):
                    if np.isnan(v):
                        ax.plot(xi + shift, -0.08 * top, "x", color="crimson", ms=7, mew=2, zorder=4)
                    elif v == 0:
                        ax.plot(xi + shift, 0, "o", color=color, ms=4, zorder=4)
                        zero = True
            ax.plot([], [], "x", color="crimson", ms=7, mew=2, label="no fit (no estimate; shaded band)")
            if zero:
                ax.plot([], [], "o", color=color, ms=4, label="an error of exactly 0 %")
            ax.axhline(0, color="0.4", lw=0.8)
            ax.set_xlim(-0.6, len(sub) - 0.4)
            ax.set_ylim(-0.14 * top, 1.08 * top)
            ax.set_xticks(x, [m + (" *" if role == "target" else "") for m, role in zip(sub.model, sub.role)], rotation=35,
                          ha="right", fontsize=7)
            ax.set(ylabel=f"|relative error| of {what}_hat (%)", title=f"{group}: {what}_hat")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=2, frameon=False)
    fig.suptitle("Leave-one-out |relative error| per model (* = the attacked model, d from phase 1)")
    fig.tight_layout()
    return fig


def cross_platform(records: dict[str, list[dict]], discard: int):
    """App. B.3.3: the L-unknown relations T ~ gamma ell^2 d + zeta of the reference models on each
    platform, the target's end-to-end curve on each, and the transfer factor k = gamma_tgt/gamma_ref of Eq. 8 as the
    fit uses it: both gammas over the references timed on both platforms (``nv.phase2.fit.platform_fits``);
    where a gamma is not positive the title says there is no k, and why."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (platform, recs) in enumerate(records.items()):
        refs = [r for r in recs if r["role"] == "reference"]
        pts = timings(refs, discard, "d")
        gamma = fit_gamma(pts.d, pts.ell, pts.T, pts.sigma)
        x = pts.ell**2 * pts.d
        axes[0].scatter(x, pts.T, s=10, color=f"C{i}", alpha=0.6, label=f"{_LABELS.get(platform, platform)} references")
        xs = np.geomspace(x.min(), x.max(), 50)
        axes[0].plot(xs, gamma.slope * xs + gamma.intercept, color=f"C{i}", lw=1,
                     label=f"gamma = {gamma.slope:.3g} s per token^2 x dim (its {len(refs)} references)")
        target = next(r for r in recs if r["role"] == "target")
        axes[1].plot(target["ell"], target["T"], "o-", ms=3, color=f"C{i}", label=_LABELS.get(platform, platform))
    axes[0].set(xlabel="ell^2 d (tokens^2 x hidden size)", ylabel="prefill time T (s)",
                title="L-unknown fits on each platform (Eqs. 6-7)",
                xscale="log", yscale="log")  # the platforms' lengths differ ~10x: linear axes hid one in a corner
    axes[0].legend(fontsize=7, loc="lower right")  # the points rise to the upper right
    axes[1].set(xlabel="prompt tokens ell", ylabel="prefill time T (s)", title="the attacked model, end to end")
    axes[1].legend(fontsize=7)
    names = list(records)
    if len(names) == 2:
        both = {r["model"] for r in records[names[1]] if r["role"] == "reference"}
        gamma = []
        for platform in names:
            pts = timings([r for r in records[platform] if r["role"] == "reference" and r["model"] in both], discard, "d")
            gamma.append(fit_gamma(pts.d, pts.ell, pts.T, pts.sigma).slope)
        ratio, over = f"k = gamma_{names[1]} / gamma_{names[0]}", f"over the {len(both)} references timed on both"
        try:
            fig.suptitle(f"Cross-platform calibration: {ratio} = {gamma[1]:.3g} / {gamma[0]:.3g} = "
                         f"{transfer_factor(gamma[1], gamma[0]):.2f} {over}\n(both gammas over those {len(both)}; "
                         "the legend's are each platform's over all its references)")
        except NVError:  # the fits report it per model (``evaluation.held_out``); the figure shows the failure
            fig.suptitle(f"No cross-platform calibration: {ratio} needs both gammas positive {over}\n"
                         f"(gamma_{names[0]} = {gamma[0]:.3g} s, gamma_{names[1]} = {gamma[1]:.3g} s: the timings too noisy or too short)", color="crimson")
    fig.tight_layout()
    return fig
