"""Figures of phase 1 (§4.1, App. B.1) and the model card. Each function draws on new axes and returns the figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from nv.phase1.entropy import entropy_nats, top_k_mass
from nv.plots import mark_truth, name_band


def _drawable(text: str) -> str:
    """``text`` with every character the figures' font has no glyph for written as its code point (U+A982): an emoji
    or Javanese prompt drew as empty boxes, and as escape codes before that."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    charmap = FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap()
    out, after_code = "", False
    for ch in text:  # a space around each code point only, the prompt's own spaces kept
        code = ord(ch) not in charmap
        out += (" " if out and (code or after_code) else "") + (f"U+{ord(ch):04X}" if code else ch)
        after_code = code
    return out


def temperature_entropy(rows: dict[str, tuple[str, list[np.ndarray]]], temperatures: tuple[float, float], top_k: int):
    """App. B.1.1 figure: sorted next-token probabilities, one row per prompt, one column per tau (the paper's layout).

    ``rows`` maps a prompt's label to its text and its two log-probability vectors (one per temperature). Each panel
    also draws the other prompts at its tau in grey, so the rows' difference is seen, not only read off the numbers.
    """
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.2 * len(rows)), sharey=True, squeeze=False)
    for r, (label, (text, logps)) in enumerate(rows.items()):
        for c, (tau, logp) in enumerate(zip(temperatures, logps)):
            ax = axes[r, c]
            for other, (_, other_logps) in rows.items():
                if other != label:
                    ax.loglog(np.arange(1, len(other_logps[c]) + 1), np.sort(np.exp(other_logps[c]))[::-1], lw=1,
                              color="0.7", label=f"{other.split()[0]} prompt at T = {tau:g}")
            p = np.sort(np.exp(logp))[::-1]
            ax.loglog(np.arange(1, len(p) + 1), p, lw=1.5, color=f"C{3 * r}", label=f"{label.split()[0]} prompt")
            ax.axvspan(1, top_k, color="0.93", zorder=0)
            ax.axhline(1 / len(p), ls=":", color="0.4", lw=0.8)
            ax.text(0.98, 0.95, f"top-{top_k} mass {top_k_mass(logp, top_k):.0%}\nentropy {entropy_nats(logp):.2f} nats",
                    transform=ax.transAxes, ha="right", va="top", fontsize=9)
            ax.set_title(f"{label} \"{_drawable(text)}\", T = {tau:g}", fontsize=9)
            ax.set_xlabel("token rank")
            ax.legend(fontsize=7, loc="lower left")
        axes[r, 0].set_ylabel("probability")
    axes[0, 1].annotate("uniform 1/|V|", xy=(2, 1 / len(p)), xytext=(2, 3 / len(p)), fontsize=8, color="0.3")
    fig.suptitle(f"Next-token distributions without and with temperature scaling (shaded: the top {top_k} tokens)")
    fig.tight_layout()
    return fig


def prompt_search(argmax_prob: np.ndarray, D: int):
    """Argmax probability (T = 0 call) of every evaluated prompt, in evaluation order."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    cut = np.sort(argmax_prob)[D - 1]
    ax.semilogy(argmax_prob, ".", ms=2, color="0.5", label="evaluated prompt")
    ax.semilogy(np.minimum.accumulate(argmax_prob), color="C3", label="best so far")
    ax.axhline(cut, color="C0", ls="--", label=f"kept: the D = {D} lowest (<= {cut:.3g})")
    ax.set_xlabel("evaluation index")
    ax.set_ylabel("argmax probability (T = 1 value)")
    ax.set_title("High-entropy prompt search (App. B.1.1)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3, frameon=False)  # over no point
    fig.tight_layout()
    return fig


def distinct_tokens(distinct_per_prompt: np.ndarray, N: int, vocab_size: int):
    """Histogram of |S_q|, the distinct tokens sampled per prompt (Alg. 1 line 3)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.hist(distinct_per_prompt, bins=50, color="C0")
    ax.set_xlabel(f"distinct tokens sampled per prompt |S_q| (of |V| = {vocab_size:,})")
    ax.set_ylabel("prompts")
    ax.set_title(f"Token coverage at N = {N:,} samples per prompt")
    fig.tight_layout()
    return fig


def coverage(coverage_per_token: np.ndarray, D: int, D_prime: int, C: int):
    """Prompts that never drew each token (tokens sorted by coverage) and the common set kept by greedy pruning: on a
    log scale, where the fraction observing it sat flat at 1 up to |C| on a linear one."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    missing = np.sort(D - np.asarray(coverage_per_token))
    ax.plot(np.arange(1, len(missing) + 1), missing, color="C0", label="prompts that never drew the token")
    ax.axvline(C, color="C3", ls="--", label=f"common set |C| = {C:,} over D' = {D_prime:,} of D = {D:,} prompts")
    ax.axhline(D - D_prime, color="C3", ls=":", label=f"D - D' = {D - D_prime:,} prompts pruned")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(-0.2, D * 1.5)
    ax.set_xlabel("token (sorted by coverage)")
    ax.set_ylabel(f"prompts missing it (of D = {D:,})")
    ax.set_title("Greedy NaN pruning (App. B.1.2)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def spectrum_panels(full_sigma: np.ndarray | None, paper, robust, d_true: int | None, budget: str | None = None):
    """The spectrum comparison figure: (a) full-logit singular values (white-box), (b) common-set
    eigenvalues, (c) a_i = arctan(lambda_i), (d) slope s_tilde with saddle, peak and AOI; the
    robust estimator's row-centred singular values and its d_hat are overlaid in (b). Without the white-box
    spectrum, (a) lists the verdicts and the ``budget`` they were read at."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    a, b, c, d = axes.ravel()
    if full_sigma is not None:
        a.semilogy(np.arange(1, len(full_sigma) + 1), full_sigma, color="C2")
        mark_truth(a, d_true)
        a.legend(fontsize=8)
        a.set_title("(a) full log-prob matrix, white-box, float32 logits (row-centred)")
        a.set_xlabel("index i")
        a.set_ylabel("singular value")
    else:  # a black-box run has no white-box spectrum: panel (a) states the verdicts instead of staying empty
        a.axis("off")
        found = (f"d_hat_raw = {robust.d_hat_raw} (g = {robust.g}: {robust.d_hat})" if robust.saturated
                 else f"not saturated: d >= {robust.lower_bound}")
        lines = ["(a) black-box run: no white-box spectrum", *([f"budget: {budget}"] if budget else []), "",
                 f"robust estimator: {found}",
                 f"paper detector: {paper.reason}" + (f", d_hat_raw = {paper.d_hat_raw}" if paper.d_hat_raw is not None else ""),
                 f"common-set spectrum: {len(robust.diagnostics['sigma'])} singular values"]
        if d_true:
            lines.append(f"true d (white-box, evaluation only): {d_true}")
        a.text(0.02, 0.95, "\n".join(lines), va="top", fontsize=11, transform=a.transAxes)
    lam = paper.diagnostics["lambda"]
    b.semilogy(np.arange(1, len(lam) + 1), np.maximum(lam, 1e-300), color="C0", label="eigenvalues of G = Y Y^T")
    sig = robust.diagnostics["sigma"]
    b.semilogy(np.arange(1, len(sig) + 1), sig**2, color="C1", lw=1, label="row-centred sigma^2 (robust)")
    if robust.saturated:
        b.axvline(robust.d_hat_raw, color="C1", ls="--", label=f"robust d_hat = {robust.d_hat_raw}")
    else:
        b.axvline(robust.lower_bound, color="C1", ls="-.", label=f"robust: not saturated, d >= {robust.lower_bound}")
    mark_truth(b, d_true)
    b.set_title("(b) common-set spectrum")
    b.set_xlabel("index i")
    b.set_ylabel("eigenvalue lambda_i")
    b.legend(fontsize=8)
    av = paper.diagnostics["a"]
    c.plot(np.arange(1, len(av) + 1), av, color="C0")
    lam_sad, lam_peak = paper.diagnostics["lam_sad"], paper.diagnostics["lam_peak"]  # the detector's own (Alg. 2)
    named = {np.pi: "pi", np.pi / 2: "pi/2"}  # the paper's defaults by name
    sad, peak = (f"arctan({named.get(v, f'{v:.3g}')})" for v in (lam_sad, lam_peak))
    c.axhline(np.arctan(lam_sad), color="0.5", ls="--", lw=0.8, label=f"{sad}: the saddle is sought below it")
    c.axhline(np.arctan(lam_peak), color="0.5", ls=":", lw=1.0, label=f"{peak}: the peak is sought below it")
    mark_truth(c, d_true)
    c.set_title("(c) arctan-transformed spectrum a_i")
    c.set_xlabel("index i")
    c.set_ylabel("a_i = arctan(lambda_i)")
    c.legend(fontsize=8)
    s = paper.diagnostics["s_tilde"]
    d.plot(np.arange(1, len(s) + 1), s, color="C0", label="smoothed slope s_tilde")
    unsought = np.asarray(av) > np.arctan(lam_sad)  # Alg. 2 takes no minimum of s_tilde there as the saddle
    if unsought.any():
        d.fill_between(np.arange(1, len(av) + 1), 0, 1, where=unsought, transform=d.get_xaxis_transform(), color="0.88",
                       zorder=0, label=f"a_i > {sad}: no saddle sought")
    i_sad, i_peak = paper.diagnostics.get("i_sad"), paper.diagnostics.get("i_peak")
    if i_sad is not None:
        d.axvline(i_sad, color="C4", ls=":", label=f"saddle i_sad = {i_sad}")
    if i_sad is not None and i_peak is not None:
        d.axvline(i_peak, color="C5", ls=":", label=f"peak i_peak = {i_peak}")
        d.axvspan(i_sad, i_peak, color="C4", alpha=0.1, label="AOI")
    if paper.d_hat_raw is not None:
        d.axvline(paper.d_hat_raw, color="C3", ls="--", label=f"paper d_hat = {paper.d_hat_raw}")
    mark_truth(d, d_true)
    d.set_title(f"(d) windowed slope; paper detector: {paper.reason}")
    d.set_xlabel("index i")
    d.set_ylabel("d a_i / d i")
    d.legend(fontsize=8)
    fig.tight_layout()
    return fig


BAND = 130  # budget_sweep's "no estimate" band, above the error axis (0-100 %): a row in it per estimator


def budget_sweep(table, d_true: int | None):
    """Relative error of d_hat (raw) versus token budget for every estimator of the table; failures marked."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    # (colour, failure marker, its size, label offset, estimate marker, its size, hollow): the estimates' markers
    # nest (a large hollow circle, a middle square, a small diamond), so estimators that agree stay visible.
    # the failure's row in the band (data units from BAND), its reason written to its right: the three estimators'
    # markers and reasons stacked at one budget had covered each other
    styles = {"robust": ("C1", "x", 9, 10, "o", 11, True), "paper": ("C0", "+", 11, 0, "s", 7, False),
              "incomplete": ("C2", "1", 11, -10, "D", 4, False)}
    for method, (color, marker, ms, dy, ok_marker, ok_ms, hollow) in styles.items():
        rows = table[table.method == method]
        if rows.empty:
            continue
        ok = rows[rows.d_hat_raw.notna()]
        ax.plot(ok.tokens, np.minimum(ok.rel_error * 100, 100), "-", color=color, marker=ok_marker, ms=ok_ms,
                mfc="none" if hollow else color, label=f"{method}: d_hat")
        for _, r in ok[ok.rel_error > 1].iterrows():  # an error over 100 % sits on the 100 line with its value, not in the band
            ax.annotate(f"{100 * r.rel_error:.0f} %", (r.tokens, 100), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color=color)
        fail = rows[rows.d_hat_raw.isna()]
        for _, r in fail.iterrows():  # in the band above the error axis: no error value, the reason written by it
            ax.plot(r.tokens, BAND + dy, marker, color=color, ms=ms)
            ax.annotate(r.reason, (r.tokens, BAND + dy), textcoords="offset points", xytext=(6, 0), ha="left",
                        va="center", fontsize=7, color=color)
    ax.axhline(10, color="0.6", ls=":", lw=0.8, label="10 %")
    ax.axhspan(BAND - 16, BAND + 16, color="red", alpha=0.07)
    ax.set_xscale("log")
    budgets = np.unique(table.tokens)  # labelled at the sweep's own budgets: a decade's tick alone named one of them
    ax.set_xticks(budgets, [f"{b:.3g}".replace("e+0", "e").replace("e+", "e") for b in budgets])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlim(budgets[0] / 1.4, budgets[-1] * 2.2)  # room right of the last budget for its reasons
    ax.set_ylim(-5, BAND + 18)
    name_band(ax, BAND, range(0, 101, 20))
    ax.set_xlabel("token budget (§5: (system + input + output tokens) x samples)")
    ax.set_ylabel(f"|relative error| of d_hat_raw (%), true d = {d_true}")
    ax.set_title("Hidden-dimension error versus budget (x, +, Y: no estimate, with the reason)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
