"""Figures of the sample-complexity and Carlini-baseline stages (§5.2). Each returns a new figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from nv.errors import NVError
from nv.plots import ESTIMATOR_MARKERS, mark_truth

PAPER_OVERHEAD = (12, 190)  # §5: NightVision costs ~12-190x the logit-bias attack (23 configurations)


def expected_n_vs_d(theory, empirical, vocab_size: int, temperature: float, note: str = ""):
    """Fig. expected-N-vs-D: samples per prompt N for a common set of size d, one panel per D.

    ``theory`` has one row per (D, d) with expected_N (root of mu(N) = d, strict common set) and
    bound_N (Corollary 1, 95 %); ``empirical`` one row per (D, d) with n95 (pruned common set,
    mean + 1.645 sd over runs) and grid_step (the ratio between sample counts tried).
    """
    Ds = sorted(theory.D.unique())
    fig, axes = plt.subplots(1, len(Ds), figsize=(4.4 * len(Ds), 3.8), sharey=True, squeeze=False)
    for ax, D in zip(axes[0], Ds):
        th = theory[theory.D == D].sort_values("d")
        em = empirical[empirical.D == D].sort_values("d")
        ax.plot(th.d, th.expected_N, "-", color="C0", label="expected N (strict: mu(N) = d)")
        ax.plot(th.d, th.bound_N, "-", color="C1", label="95 % upper bound (Corollary 1)")
        ax.errorbar(em.d, em.n95, yerr=[em.n95 * (1 - 1 / em.grid_step), np.zeros(len(em))], fmt="^-", color="C2",
                    capsize=3, label="empirical 95 % N, pruned (bar: grid step)")
        ax.set_yscale("log")
        ax.set_title(f"D = {D:,} prompts")
        ax.set_xlabel("target common-set size d")
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel("samples per prompt N")
    axes[0, 0].legend(fontsize=8)
    title = f"Samples per prompt for a common set of size d (|V| = {vocab_size:,}, T = {temperature:g})"
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=11)
    fig.tight_layout()
    return fig


def carlini_vs_common_set(carlini: dict[str, tuple[np.ndarray, int]], common_sigma: np.ndarray,
                          common_shape: tuple[int, int], common_d_hat: int | None, d_true: int | None):
    """(a) singular values of the row-centred Carlini matrix Q (label -> (sigma, d_hat) per run),
    (b) the common-set spectrum of phase 1 (row-centred singular values of Y, D' x |C|)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for k, (label, (sigma, d_hat)) in enumerate(carlini.items()):
        a.semilogy(np.arange(1, len(sigma) + 1), sigma, color=f"C{k}", label=f"{label}: largest gap at d_hat = {d_hat}")
    b.semilogy(np.arange(1, len(common_sigma) + 1), common_sigma, color="C0", label="common set Y (row-centred)")
    if common_d_hat is not None:
        b.axvline(common_d_hat, color="C1", ls="--", label=f"robust d_hat = {common_d_hat}")
    for ax in (a, b):
        mark_truth(ax, d_true)
        ax.set_xlabel("index i")
        ax.set_ylabel("singular value sigma_i")
        ax.legend(fontsize=8)
    a.set_title(f"(a) logit-bias attack (Carlini et al.): Q, n = {len(sigma):,} prompts x |V|")
    b.set_title(f"(b) common-set prompting: Y, D' x |C| = {common_shape[0]:,} x {common_shape[1]:,}")
    fig.tight_layout()
    return fig


def cost_overhead(d: int, overheads: dict[str, dict]):
    """Fig. carlini_vs_us for one model (the paper's axis d has one point here): per estimator (``overheads``: method -> nv.theory.carlini.cost_overhead),
    NightVision's tokens to reach the error target over Carlini's d |V| (l_sys + 2), annotated with the samples per
    prompt N it took; an upward arrow marks a lower bound where the estimator never reached the target."""
    if not overheads:
        raise NVError("the cost-overhead figure needs at least one estimator's budget sweep")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lo, hi = PAPER_OVERHEAD
    ax.axhspan(lo, hi, color="0.9", label=f"the paper's range: {lo}-{hi}x (23 configurations)")
    first = next(iter(overheads.values()))
    target = f"rel. error <= {first['max_rel_error']:.0%}"
    for k, (method, overhead) in enumerate(overheads.items()):
        x, name = k, {"paper": "paper's detector"}.get(method, method)  # not the paper's range above
        if overhead["ratio"] is not None:
            ax.scatter([x], [overhead["ratio"]], s=70, marker=ESTIMATOR_MARKERS.get(method, "o"), color=f"C{k}", zorder=3,
                       label=f"{name}: {overhead['ratio']:.3g}x at N = {overhead['N']:,}")
        else:
            lb = overhead["lower_bound"]
            ax.scatter([x], [lb], marker="^", s=70, color=f"C{k}", zorder=3, label=f"{name}: {target} not reached, > {lb:.3g}x")
            ax.annotate("", xy=(x, lb * 4), xytext=(x, lb), arrowprops={"arrowstyle": "->", "color": f"C{k}"},
                        annotation_clip=False)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))  # 10x, 20x, 50x, ...: plain numbers
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bounds = [o["lower_bound"] for o in overheads.values() if o["ratio"] is None]
    if bounds:  # room for the arrows over the lower bounds
        ax.set_ylim(top=max(ax.get_ylim()[1], 5 * max(bounds)))
    ax.set_xlim(-0.6, len(overheads) - 0.4)
    ax.set_xticks(range(len(overheads)), list(overheads))
    ax.set_xlabel(f"estimator (this model: d = {d})")
    ax.set_ylabel("cost ratio (ours / Carlini et al.)")
    ax.set_title(f"Cost overhead to reach {target} (Carlini: {first['carlini_tokens']:.3g} tokens)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
