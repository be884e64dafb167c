"""Figures shared by the notebooks. Each function draws on new axes and returns the figure."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from nv.entropy import entropy_nats, top_k_mass  # noqa: E402


def save(fig, path: str | Path) -> Path:
    """Save ``fig`` as PNG (deterministic metadata) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def temperature_entropy(rows: dict[str, np.ndarray], temperatures: tuple[float, float], top_k: int):
    """App. B.1.1 figure: sorted next-token probabilities, one row per prompt, one column per tau.

    ``rows`` maps a prompt label to its two log-probability vectors (one per temperature).
    """
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.2 * len(rows)), sharey=True, squeeze=False)
    for r, (label, logps) in enumerate(rows.items()):
        for c, (tau, logp) in enumerate(zip(temperatures, logps)):
            ax = axes[r, c]
            p = np.sort(np.exp(logp))[::-1]
            ranks = np.arange(1, len(p) + 1)
            ax.loglog(ranks, p, lw=1.2, color="C0" if r == 0 else "C3")
            ax.axvspan(1, top_k, color="0.9", zorder=0)
            ax.axhline(1 / len(p), ls=":", color="0.4", lw=0.8)
            ax.text(
                0.98, 0.95,
                f"top-{top_k} mass {top_k_mass(logp, top_k):.0%}\nentropy {entropy_nats(logp):.2f} nats",
                transform=ax.transAxes, ha="right", va="top", fontsize=9,
            )
            ax.set_title(f"{label}, T = {tau:g}", fontsize=10)
            ax.set_xlabel("token rank")
        axes[r, 0].set_ylabel("probability")
    axes[0, 1].annotate("uniform 1/|V|", xy=(2, 1 / len(p)), xytext=(2, 3 / len(p)), fontsize=8, color="0.3")
    fig.suptitle("Next-token distributions without and with temperature scaling (shaded: top-k tokens)")
    fig.tight_layout()
    return fig
