"""The defences figure (issue 15; README: Defences): the attack's outcome versus each knob's strength, with and
without the attack's counter-measure, the provider's price under each setting."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nv.phase1.spectrum import d_interval
from nv.plots import name_band

WRONG = {"marker": "o", "ms": 15, "mfc": "none", "mec": "red", "mew": 1.8, "ls": "none"}
OFFSET = (-0.18, 0.0, 0.18)  # x offsets of the variants' crosses in the band, so that none hides another
VARIANTS = {"no_counter": ("without counter-measure", "C3", "s"), "attack": ("with counter-measure", "C0", "o"),
            "attack_10x": ("with counter-measure, 10x budget", "C2", "^")}
# each variant's line drawn over the last one's, thinner and with a smaller marker: equal outcomes stay visible
STYLE = {"no_counter": {"ls": "-", "lw": 3.2, "ms": 9}, "attack": {"ls": "--", "lw": 2.2, "ms": 7},
         "attack_10x": {"ls": ":", "lw": 1.4, "ms": 4.5}}


def _price_label(setting, cost: str) -> str:
    """A tick label: the setting and its price in short (the full text is in results.md)."""
    if cost.startswith("KL"):
        short = cost.split(",")[0]
    elif cost.endswith("ms per request"):
        short = f"+{cost.split()[0]} ms"
    else:
        short = "free"
    return f"{setting}\n{short}"


def outcome_vs_strength(p1: pd.DataFrame, p2: pd.DataFrame, table: pd.DataFrame, d_true: int, estimator: str,
                        L_tolerance: float):
    """One panel per knob. Phase 1: |d_hat_raw - d| for saturated estimates, a wrong one (off by more than the
    tolerance) ringed in red; "not saturated" drawn as a cross in the red band above the axes, in the variant's
    colour, with its lower bound beside it; the exactness tolerance shaded. Phase 2: |L_hat - L| / L with the
    tolerance line; no fit is a cross in the band, in the variant's colour. Tick labels carry the provider's price of
    each setting. The variants' lines narrow in drawing order (``STYLE``), so one that equals another shows beside it."""
    knobs = [k for k in dict.fromkeys(table.knob) if k != "none"]
    cols = 4
    rows = math.ceil(len(knobs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    base1 = p1[p1.knob == "none"].iloc[0]
    base2 = p2[(p2.knob == "none") & (p2.variant == "no_counter")].iloc[0]
    for ax, knob in zip(axes.flat, knobs):
        phase = int(table[table.knob == knob].phase.iloc[0])
        rows_t = table[table.knob == knob]
        labels = ["none\n(undefended)"] + [_price_label(s, c) for s, c in zip(rows_t.setting, rows_t.cost)]
        x = np.arange(len(labels))
        if phase == 1:
            top, tol = 300.0, d_true - d_interval(d_true, None)[0]
            sub = p1[p1.knob == knob]
            countered = (sub.variant == "no_counter").any()  # a knob without a counter-measure has the attack alone
            for j, (variant, (label, color, marker)) in enumerate(VARIANTS.items()):
                v = sub[sub.variant == variant]
                if v.empty:
                    continue
                if variant == "attack" and not countered:
                    label, color = "the attack (this knob has no counter-measure)", "C4"
                first = base1 if variant != "attack_10x" else None
                points = ([first] if first is not None else [None]) + [r for _, r in v.iterrows()]
                ys, fails = [], []
                for i, r in enumerate(points):
                    if r is None:
                        ys.append(np.nan)
                        continue
                    raw = r[f"{estimator}_d_hat_raw"]
                    if pd.isna(raw):
                        ys.append(np.nan)
                        fails.append((i, r[f"{estimator}_lower_bound"]))
                    else:
                        ys.append(abs(raw - d_true))
                ax.plot(x, np.minimum(ys, top), marker=marker, color=color, label=label, alpha=0.85, **STYLE[variant])
                for i, y in enumerate(ys):
                    if y > tol:  # saturated and off: a wrong answer, not a point near the exact band
                        ax.plot(i, min(y, top), **WRONG)
                        ax.annotate(f"wrong: {y:+.0f}" if y > top else "wrong", (i, min(y, top)), textcoords="offset points",
                                    xytext=(9, 4 + 8 * j), fontsize=7.5, color="red")
                for i, lb in fails:  # its lower bound written down from the cross, each variant at its own x
                    ax.plot(i + OFFSET[j], top * 1.1, marker="X", color=color, mec="red", ms=9, ls="none")
                    ax.annotate(f"d >= {int(lb or 0)}", (i + OFFSET[j], top * 1.1), textcoords="offset points",
                                xytext=(0, -8), fontsize=7, color=color, rotation=90, ha="center", va="top")
            ax.axhspan(0, tol, color="green", alpha=0.12, label=f"exact (|error| <= {tol:g})")
            ax.axhspan(top * 1.03, top * 1.17, color="red", alpha=0.07)
            ax.set_ylim(-5, top * 1.2)
            name_band(ax, top * 1.1, np.arange(0, top + 1, 50))  # no error tick in the band: a cross there has no value
            ax.set_ylabel(f"|d_hat_raw - d| ({estimator})")
            ax.set_title(f"phase 1 vs {knob}")
        else:
            top = 100.0
            sub = p2[p2.knob == knob]
            for j, (variant, (label, color, marker)) in enumerate(VARIANTS.items()):
                v = sub[sub.variant == variant]
                b = p2[(p2.knob == "none") & (p2.variant == variant)].iloc[0]
                errs = [b.L_err] + list(v.L_err)
                ys = [100 * abs(e) if np.isfinite(e) else np.nan for e in errs]
                ax.plot(x, np.minimum(ys, top), marker=marker, color=color, label=label, alpha=0.85, **STYLE[variant])
                for i, y in enumerate(ys):
                    if not np.isfinite(y):  # which variant found no fit: its colour, beside the others'
                        ax.plot(i + OFFSET[j], top * 1.1, marker="X", color=color, mec="red", ms=9, ls="none")
                    elif y > top:
                        ax.annotate(f"{y:.0f} %", (i, top), textcoords="offset points", xytext=(3, 2), fontsize=7, color=color)
            ax.axhline(100 * L_tolerance, color="0.4", ls=":", lw=1, label=f"attack works below {100 * L_tolerance:g} %")
            ax.axhspan(top * 1.03, top * 1.17, color="red", alpha=0.07)
            ax.annotate("no fit", (0.01, top * 1.1), xycoords=("axes fraction", "data"), color="red", fontsize=8,
                        ha="left", va="center")  # over the undefended setting, which fails only if the attack does undefended
            ax.set_ylim(-3, top * 1.2)
            ax.set_yticks(np.arange(0, top + 1, 25))
            ax.set_ylabel("|L_hat - L| / L (%)")
            ax.set_title(f"phase 2 vs {knob} (L = {int(base2.L_true)})")
        ax.set_xticks(x, labels, fontsize=7.5)
        ax.set_xlabel(f"{knob} (setting, and its price)", fontsize=8)
        ax.set_xlim(-0.4, len(labels) - 0.4)
    for ax in list(axes.flat)[len(knobs):]:
        ax.axis("off")
    legend = {}
    for ax in axes.flat:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    legend["in the red band: not saturated (phase 1) / no fit (phase 2), in the variant's colour"] = plt.Line2D(
        [], [], marker="X", color="0.5", mec="red", ms=9, ls="none")
    legend["wrong: saturated, off by more than the tolerance"] = plt.Line2D([], [], **WRONG)
    fig.suptitle("What each defence does to the attack (x: setting, and the price its users pay: KL of the served "
                 "distribution, added latency per request, or free for reported values only)", fontsize=12)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 4), fontsize=8, frameon=False)
    return fig
