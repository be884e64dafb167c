"""The defences figure (issue 15; README: Defences): per knob, what the attack still learns at each setting, with and
without its counter-measure, under each setting's price; and one table of which defence stops which phase, at what
price."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nv.phase1.spectrum import d_interval

WRONG = {"marker": "o", "ms": 15, "mfc": "none", "mec": "red", "mew": 1.8, "ls": "none"}
OFFSET = (-0.18, 0.0, 0.18)  # x offsets of the variants' markers, so that none hides another
VARIANTS = {"no_counter": ("without counter-measure", "C3", "s"), "attack": ("with counter-measure", "C0", "o"),
            "attack_10x": ("with counter-measure, 10x budget", "C2", "D")}
NO_COUNTER = ("the attack (this knob has no counter-measure)", "C4")
BOUND = "^"  # a lower bound: d >= the marker


def short_price(cost: str) -> str:
    """A setting's price in a few characters (the full text is in results.md)."""
    if cost.startswith("KL"):
        return cost.split(",")[0]
    if cost.endswith("ms per request"):
        return f"+{cost.split()[0]} ms"
    if cost.startswith("log-probs off by"):
        return f"off {cost.split()[3]} nats" + (" & withheld" if "withheld" in cost else "")  # a mean |error|
    if "withheld" in cost:
        return f"{cost.split()[0]} % withheld"
    return cost


def _phase1(ax, p1: pd.DataFrame, knob: str, d_true: int, g: int, estimator: str) -> None:
    """What the attacker gets for d at each setting: a saturated estimate (filled; ringed red where wrong), or the
    lower bound of a "not saturated" one (a triangle: d >= it), in the variant's colour; the band within g below d,
    where a bound still leaks d, shaded."""
    tol = d_true - d_interval(d_true, None)[0]
    top = 1.12 * d_true
    base = p1[p1.knob == "none"].iloc[0]
    sub = p1[p1.knob == knob]
    countered = (sub.variant == "no_counter").any()
    for j, (variant, (label, color, marker)) in enumerate(VARIANTS.items()):
        v = sub[sub.variant == variant]
        if v.empty:
            continue
        if variant == "attack" and not countered:
            label, color = NO_COUNTER
        points = ([base] if variant != "attack_10x" else [None]) + [r for _, r in v.iterrows()]
        for i, r in enumerate(points):
            if r is None:
                continue
            raw, lb = r[f"{estimator}_d_hat_raw"], r[f"{estimator}_lower_bound"]
            xi = i + OFFSET[j]
            if pd.notna(raw):
                ax.plot(xi, min(raw, top), marker=marker, color=color, ms=8, ls="none", label=label)
                if abs(raw - d_true) > tol:
                    ax.plot(xi, min(raw, top), **WRONG)
                    ax.annotate(f"wrong: {raw:.0f}", (xi, min(raw, top)), textcoords="offset points", xytext=(8, 6),
                                fontsize=8, color="red")
            else:
                y = float(lb or 0)
                ax.plot(xi, y, marker=BOUND, color=color, mfc="white", mew=2, ms=9, ls="none", label=label)
                ax.annotate(f"{y:.0f}", (xi, y), textcoords="offset points", xytext=(0, -13), fontsize=8, color=color,
                            ha="center")
    ax.axhspan(d_true - g + 0.5, d_true - tol, color="orange", alpha=0.18, label=f"a bound here leaks d (within {g} below it)")
    ax.axhspan(d_true - tol, d_true + tol, color="green", alpha=0.25, label=f"exact (d ± {tol:g})")
    ax.axhline(d_true, color="green", lw=1)
    ax.set_ylim(0, top)
    ax.set_ylabel(f"d the attacker gets ({estimator})")


def _phase2(ax, p2: pd.DataFrame, knob: str, L_tolerance: float) -> None:
    """The signed error of L_hat at each setting, the band where the attack works shaded; no fit a cross in the red
    band at the top, in the variant's colour."""
    top = 100.0
    sub = p2[p2.knob == knob]
    for j, (variant, (label, color, marker)) in enumerate(VARIANTS.items()):
        v = sub[sub.variant == variant]
        base = p2[(p2.knob == "none") & (p2.variant == variant)].iloc[0]
        errs = [base.L_hat / base.L_true - 1] + list(v.L_hat / v.L_true - 1)
        for i, e in enumerate(errs):
            xi = i + OFFSET[j]
            if not np.isfinite(e):
                ax.plot(xi, top * 1.1, marker="X", color=color, mec="red", ms=9, ls="none", label=label)
                continue
            y = float(np.clip(100 * e, -top, top))
            ax.plot(xi, y, marker=marker, color=color, ms=8, ls="none", label=label)
            if abs(100 * e) > top:
                ax.annotate(f"{100 * e:+.0f} %", (xi, y), textcoords="offset points", xytext=(4, 2), fontsize=8, color=color)
    ax.axhspan(-100 * L_tolerance, 100 * L_tolerance, color="green", alpha=0.15,
               label=f"attack works (|L error| <= {100 * L_tolerance:g} %)")
    ax.axhline(0, color="green", lw=1)
    ax.axhspan(top * 1.03, top * 1.17, color="red", alpha=0.07)
    ax.annotate("no fit", (0.01, top * 1.1), xycoords=("axes fraction", "data"), color="red", fontsize=8,
                ha="left", va="center")  # over the undefended setting, which fails only if the attack does undefended
    ax.set_ylim(-top * 1.05, top * 1.2)
    ax.set_yticks(np.arange(-top, top + 1, 50))
    ax.set_ylabel("(L_hat - L) / L (%)")


def _verdicts(ax, weakest: pd.DataFrame) -> None:
    """The weakest table (``nv.defences.weakest``) as a coloured grid: green where a swept setting stops the phase
    (the setting and its price), red where none does."""
    def shown(text: str) -> tuple[str, str]:
        if text.startswith(("none of", "nothing")):
            return "none stops it", "#f4c7c3"
        if text.startswith("not emulable"):
            return "(not emulable)", "#eeeeee"
        setting, _, cost = text.partition(" (")
        return f"{setting}  ({short_price(cost[:-1])})", "#c8e6c9"
    cells, colours = [], []
    for _, r in weakest.iterrows():
        a, b = shown(r["default budget"]), shown(r["10x budget"])
        cells.append([r.knob, f"{r.phase}: {'d' if r.phase == 1 else 'L, P'}", a[0], b[0]])
        colours.append(["white", "white", a[1], b[1]])
    ax.axis("off")
    table = ax.table(cellText=cells, cellColours=colours, loc="center", cellLoc="left", colWidths=[0.2, 0.1, 0.35, 0.35],
                     colLabels=["knob", "phase: hides", "weakest setting that stops it (price), default budget",
                                "the same at 10x the budget"])
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.35)
    ax.set_title("Which defence stops the attack, at what price (every statistic the attacker holds must miss; a "
                 "phase-1 bound within g of d leaks d)", fontsize=10)


def outcome_vs_strength(p1: pd.DataFrame, p2: pd.DataFrame, table: pd.DataFrame, weakest: pd.DataFrame, d_true: int,
                        g: int, estimator: str, L_tolerance: float):
    """One panel per knob (phase 1: the d the attacker gets, ``_phase1``; phase 2: L_hat's signed error,
    ``_phase2``), each setting's price under its tick; below them the verdict table (``_verdicts``)."""
    knobs = [k for k in dict.fromkeys(table.knob) if k != "none"]
    cols = 4
    rows = math.ceil(len(knobs) / cols)
    fig = plt.figure(figsize=(5.2 * cols, 4.2 * rows + 4.2))
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1] * rows + [0.95])
    for n, knob in enumerate(knobs):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        phase = int(table[table.knob == knob].phase.iloc[0])
        rows_t = table[table.knob == knob]
        labels = ["none\n(undefended)"] + [f"{s}\n{short_price(c)}" for s, c in zip(rows_t.setting, rows_t.cost)]
        x = np.arange(len(labels))
        if phase == 1:
            _phase1(ax, p1, knob, d_true, g, estimator)
            ax.set_title(f"phase 1 vs {knob} (d = {d_true})")
        else:
            _phase2(ax, p2, knob, L_tolerance)
            ax.set_title(f"phase 2 vs {knob} (L = {int(p2.L_true.iloc[0])})")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel(f"{knob} (setting, and its price)", fontsize=8)
        ax.set_xlim(-0.5, len(labels) - 0.5)
    _verdicts(fig.add_subplot(grid[rows, :]), weakest)
    legend = {}
    for ax in fig.axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    legend["a triangle: not saturated, d >= the value beside it"] = plt.Line2D([], [], marker=BOUND, color="0.4", mfc="white",
                                                                              mew=2, ms=9, ls="none")
    legend["wrong: saturated, off by more than the tolerance"] = plt.Line2D([], [], **WRONG)
    fig.suptitle("What each defence leaves the attacker (x: setting, and what its users pay: KL of the served "
                 "distribution, error of the reported log-probs, or added latency per request)", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.98))
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    return fig
