"""One timed model's App. D prefill sweep (the timing stages' per-model figure): kept apart from ``phase2``,
whose fits would make every timing stage depend on them."""

from __future__ import annotations

import matplotlib.pyplot as plt


def prefill_sweep(results: dict[str, dict], name: str, d: int, L: int):
    """T(ell) on each platform (``time_platform``'s records by platform), error bars sigma_T."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for platform, r in results.items():
        ax.errorbar(r["ell"], r["T"], yerr=r["sigma"], fmt="o-", ms=3, label=platform)
    ax.set(xlabel="prompt tokens ell", ylabel="prefill time T (s, minus ell=1 baseline)",
           title=f"{name}: d={d}, L={L} (error bars: sigma_T)")
    ax.legend()
    return fig
