"""Validation figures across models (§5.1-5.2): Fig. val_plot (d_hat error versus budget), Fig. err_d_L_N_plot, the
per-model L_hat / P_hat errors, Fig. L_param_err_budget (the scaling relation with the real models marked is
``nv.plots.phase2.scaling``).

A failure must look like one: a budget without a saturated spectrum is drawn as a red cross in a "no
estimate" band above the axes, never on the 0 % line; the robust estimator's lower bound is shown beside it.
"""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from nv.plots import name_band

FAIL = {"marker": "X", "color": "red", "ms": 8, "ls": "none", "zorder": 4}
FAIL_Y = 112  # the no-estimate band's height on a |error| (%) axis: its tick clear of the 100 one


def k_markers(trials) -> dict[int, str]:
    """A marker per timing budget K' (trials per length), by its place among all of ``trials``: one K' the same
    marker in every model's points and in the legend."""
    return {int(K): m for K, m in zip(sorted(set(trials)), itertools.cycle("osD^v"))}


def log_axis(ax, xlabel: str) -> None:
    """Log x axis with readable, non-overlapping major ticks only."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(numticks=6))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(xlabel)


def error_axis(ax) -> None:
    """A |relative error| (%) axis up to the no-estimate band at ``FAIL_Y``, the band named on it (``name_band``); a
    0 % point whole, not half under the axis."""
    ax.set_ylim(-4, FAIL_Y + 8)
    name_band(ax, FAIL_Y, range(0, 101, 20))


def fail_band(ax, xs, top: float, label: str | None, color: str | None = None) -> None:
    """Crosses just above the plotted range (edged in the model's ``color``: which model failed), in a red band, for
    budgets with no estimate; ``name_band`` names it on the axis once the limits are set."""
    if len(xs):  # the model's colour inside a red outline
        ax.plot(list(xs), [top] * len(xs), label=label, **(FAIL | ({"mfc": color, "mec": "red", "mew": 1.2} if color else {})))
    ax.axhspan(top * 0.96, top * 1.04, color="red", alpha=0.07)


def dodge(xs, model, colors: dict) -> np.ndarray:
    """``xs`` on a log axis shifted by 0.05 decade per model (``model``'s place among ``colors``' models, centred):
    models at the same budget side by side, none hiding another's marker or cross."""
    i, n = list(colors).index(model), len(colors)
    return np.asarray(xs, dtype=np.float64) * 10 ** (0.05 * (i - (n - 1) / 2))


def below(ax) -> None:
    """The legend under the axes, where it can hide no point (successes sit near 0 % at the largest budgets)."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def _colors(models) -> dict:
    return {m: f"C{i}" for i, m in enumerate(dict.fromkeys(models))}


def d_vs_budget(phase1: pd.DataFrame):
    """Fig. val_plot: signed relative error of d_hat_raw versus samples per prompt N, one faint line per model
    and the bold mean error over the models saturated at that N, a panel per estimator. Unsaturated budgets:
    red crosses in the no-estimate band; the robust and missing-data estimators' lower bound as an open triangle.
    The models' points are side by side at a shared N (``dodge``)."""
    methods = [m for m in ("robust", "paper", "incomplete") if (phase1.method == m).any()]
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4.4), sharey=True, squeeze=False)
    axes = axes[0]
    colors = _colors(phase1.model)
    for ax, method in zip(axes, methods):
        rows = phase1[phase1.method == method]
        top = 115.0
        for model, r in rows.groupby("model", sort=False):
            r = r.sort_values("N")
            ok = r[r.saturated]
            ax.plot(dodge(ok.N, model, colors), 100 * (ok.d_hat_raw - ok.d_true) / ok.d_true, "o-", color=colors[model], alpha=0.7, ms=6,
                    label=f"{model} (d = {int(r.d_true.iloc[0])})")
            fail = r[~r.saturated]
            fail_band(ax, dodge(fail.N, model, colors), top, None, colors[model])
            if method != "paper" and len(fail):  # d >= bound: the error is at least the bound's, so the triangle points up
                ax.plot(dodge(fail.N, model, colors), 100 * (fail.lower_bound - fail.d_true) / fail.d_true, "^", mfc="none", color=colors[model], ms=7)
        mean = rows[rows.saturated].groupby("N").apply(lambda g: 100 * np.mean((g.d_hat_raw - g.d_true) / g.d_true),
                                                          include_groups=False)
        ax.plot(mean.index, mean.values, "k_-", lw=2.5, ms=14, mew=2.5, label="mean error of the saturated models")
        if method != "paper":
            ax.plot([], [], "^", mfc="none", color="0.3", label="not saturated: lower bound (error at least)")
        ax.plot([], [], label="not saturated: no estimate", **FAIL)
        ax.axhline(0, color="0.6", lw=0.8)
        log_axis(ax, "samples per prompt N")
        ax.set_ylim(-105, top + 12)
        name_band(ax, top, range(-100, 101, 50))
        ax.set_title(f"{method} estimator")
        below(ax)
    axes[0].set_ylabel("relative error of d_hat_raw (%)")
    fig.suptitle("Hidden dimension versus budget on every model (Fig. val_plot)")
    fig.tight_layout()
    return fig


def _per_model(ax, cases: pd.DataFrame, x: str, what: str, colors: dict, top: float) -> None:
    """|error| of ``what`` versus column ``x``: faint line per model (side by side at a shared x: ``dodge``), bold
    mean over models; failures in the band."""
    markers = k_markers(cases.trials.dropna())
    for model, r in cases.groupby("model", sort=False):
        r = r.sort_values(x)
        ok = r[r[f"{what}_err"].notna()]
        ax.plot(dodge(ok[x], model, colors), 100 * ok[f"{what}_err"].abs(), "-", color=colors[model], alpha=0.5, label=model)
        for K in sorted(ok.trials.unique()):  # the cases of one phase-1 budget differ in K'
            with_K = ok[ok.trials == K]
            ax.plot(dodge(with_K[x], model, colors), 100 * with_K[f"{what}_err"].abs(), markers[int(K)], color=colors[model], alpha=0.8, ms=5,
                    zorder=4)
        fail_band(ax, dodge(r[r[f"{what}_err"].isna()][x], model, colors), top, None, colors[model])
    ok = cases[cases[f"{what}_err"].notna()]
    if len(ok):  # each model's k-th phase-1 budget at its largest K', averaged (models differ in budgets and K')
        full = ok.loc[ok.groupby(["model", "N"]).trials.idxmax()].sort_values(["model", "N"])
        means = full.assign(rank=full.groupby("model").cumcount()).groupby("rank").agg(
            x=(x, "mean"), e=(f"{what}_err", lambda e: e.abs().mean()), n=("model", "size"))
        means = means[means.n == ok.model.nunique()]
        ax.plot(means.x, 100 * means.e, "k_-", lw=2.5, ms=14, mew=2.5, alpha=0.6, zorder=3,  # under the models' markers
                label="mean of the models (each at its largest K')")
    for K, marker in markers.items():
        ax.plot([], [], marker, color="0.3", label=f"K' = {K} timing trials")
    ax.margins(x=0.08)  # the largest budget off the axis' edge


def err_d_L_N(cases: pd.DataFrame, reference_platform: str, estimator: str):
    """Fig. err_d_L_N_plot: |relative error| of d, L and P versus total budget (tokens), the reference platform
    against F, every (phase-1 budget, K') case; one faint line per model, bold mean; d from phase 1's ``estimator``."""
    sub = cases[(cases.setup == "F") & (cases.platform == reference_platform)]
    colors = _colors(sub.model)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, what in zip(axes, ("d", "L", "P")):
        _per_model(ax, sub, "tokens", what, colors, FAIL_Y)
        ax.plot([], [], label="no d_hat at this budget", **FAIL)
        error_axis(ax)
        log_axis(ax, "total budget (tokens: phase 1 + timing)")
        ax.set_ylabel(f"|relative error| of {what}_hat (%)")
        ax.set_title({"d": f"hidden dimension d ({estimator})", "L": "depth L (rule)", "P": "parameters P (attacker-side)"}[what])
        below(ax)
    fig.suptitle(f"Errors versus total budget on every model ({reference_platform}, references F)")
    fig.tight_layout()
    return fig


def L_param_err_budget(cases: pd.DataFrame, reference_platform: str, price: float, estimator: str):
    """Fig. L_param_err_budget: |relative error| of d_hat (phase 1's ``estimator``), L_hat and P_hat versus API calls
    and versus cost in USD."""
    sub = cases[(cases.setup == "F") & (cases.platform == reference_platform)]
    colors = _colors(sub.model)
    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    for i, what in enumerate(("d", "L", "P")):
        for ax, x, label in ((axes[i, 0], "calls", "API calls"), (axes[i, 1], "usd", f"cost (USD at ${price:g} per million tokens)")):
            _per_model(ax, sub, x, what, colors, FAIL_Y)
            ax.plot([], [], label="no estimate at this budget", **FAIL)
            error_axis(ax)
            log_axis(ax, label)
            ax.set_ylabel(f"|relative error| of {what}_hat" + (f" ({estimator})" if what == "d" else "") + " (%)")
            below(ax)
    fig.suptitle(f"Hidden-dimension, depth and parameter-count errors versus query budget ({reference_platform}, references F)")
    fig.tight_layout()
    return fig


LINEAR = 100  # the signed error axis is linear within +-LINEAR %, logarithmic beyond (symlog): nothing is cut off
CAP = 1e4  # an infinite interval end is drawn to CAP % and written "to inf"


def L_P_errors(top: pd.DataFrame):
    """Per-model signed errors at the full budget: L by both estimators and the rule, P attacker-side (with their
    90 % intervals: the hull and the rule's estimator's), with the paper's default ratios and with the true ratios; one
    panel per setup. The axis is linear within +-100 % and logarithmic beyond, so every bar and interval end is drawn;
    an estimate without a fit is a red cross on the axis' floor (-100 %), never a bar of 0 %."""
    setups = list(dict.fromkeys(top.setup))
    fig, axes = plt.subplots(len(setups), 1, figsize=(13, 4.6 * len(setups)), squeeze=False)
    bars = [("L_hat_basic", "L basic (§4.2)", "L_true"), ("L_hat_eq10", "L Eq. 10", "L_true"), ("L_hat", "L rule", "L_true"),
            ("P_hat", "P attacker-side", "P_true"), ("P_hat_paper", "P paper ratios", "P_true"), ("P_hat_oracle", "P true ratios (oracle)", "P_true")]
    for ax, setup in zip(axes[:, 0], setups):
        rows = top[top.setup == setup].reset_index(drop=True)
        labels = [f"{r.model}\n{r.calibration}" for r in rows.itertuples()]
        width = 0.8 / len(bars)
        high = LINEAR
        for j, (col, name, truth) in enumerate(bars):
            err = 100 * (rows[col] - rows[truth]) / rows[truth]
            x = np.arange(len(rows)) + (j - len(bars) / 2 + 0.5) * width
            ax.bar(x, err, width, color=f"C{j}", label=name)  # NaN: no bar
            if err.isna().any():  # on the axis' floor, drawn over it
                ax.plot(x[err.isna()], [-100] * int(err.isna().sum()), clip_on=False, **FAIL)
            high = max([high, *err.dropna()])
            if col in ("L_hat", "P_hat"):  # thick: the rule's estimator's interval; thin: the hull of both estimators'
                for suffix, style in (("_rule", {"ecolor": "0.55", "lw": 4, "capsize": 0}), ("", {"ecolor": "k", "lw": 1, "capsize": 2})):
                    lo, hi = (100 * (rows[f"{col[0]}_{b}{suffix}"] - rows[truth]) / rows[truth] for b in ("lo", "hi"))
                    for xi, h in zip(x, hi):
                        if np.isinf(h) and suffix == "":
                            ax.annotate("to inf", (xi, CAP), ha="left", va="top", fontsize=7, xytext=(3, -2),
                                        textcoords="offset points")
                    hi = hi.clip(upper=CAP)
                    high = max([high, *hi.dropna()])
                    ok = err.notna()
                    ax.errorbar(x[ok], err[ok], yerr=[(err - lo).clip(lower=0)[ok], (hi - err).clip(lower=0)[ok]],
                                fmt="none", **style)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-25, 25):
            ax.axhline(y, color="0.6", ls=":", lw=0.8)
        ax.axhline(LINEAR, color="0.8", lw=0.8)
        ax.set_yscale("symlog", linthresh=LINEAR, linscale=2.5)
        ax.set_ylim(-100, 1.5 * high)
        ticks = [-100, -50, -25, 0, 25, 50, 100] + [v for v in (300, 1000, 3000, 10000) if v < 1.5 * high]
        ax.set_yticks(ticks, [f"{v:+,d}".replace("+0", "0") for v in ticks])
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(np.arange(len(rows)), labels, fontsize=7)
        ax.set_ylabel("signed relative error (%)")
        ax.set_title(f"references: {setup} (90 % intervals, thin: hull of both depth estimators', thick: the rule's "
                     "estimator's; dotted: +-25 %; linear to 100 %, logarithmic above the grey line)", fontsize=10)
    axes[0, 0].plot([], [], label="no fit: no estimate", **FAIL)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), fontsize=8, ncol=7, loc="upper center", frameon=False)  # hides no bar
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    return fig
