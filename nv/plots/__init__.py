"""Figures, one module per part of the paper: ``phase1`` (§4.1, App. B.1: prompt search, sampling,
common set, spectrum panels, budget sweep), ``theory`` (§5.2, App. F: sample complexity, Carlini
baseline), ``phase2`` (§4.2, App. B.3: timing scaling, calibration, errors), ``overall`` (§5.1),
``validation`` (§5.1 across models), ``sweep`` (one timed model's App. D prefill sweep), and beyond the paper
``exactness`` (the (D, N, tau) grid), ``planner`` (the pilot's predicted common set) and ``defences`` (each
defence's effect and price).
The helpers every figure shares live here: the non-interactive backend, ``save``, ``mark_truth``, ``name_band``
and each phase-1 estimator's marker (``ESTIMATOR_MARKERS``)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ESTIMATOR_MARKERS = {"robust": "s", "paper": "o", "incomplete": "D"}  # one marker per estimator, in every figure that compares them


def save(fig, path: str | Path) -> Path:
    """Save ``fig`` as PNG (deterministic metadata) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def mark_truth(ax, d_true: int | None) -> None:
    """A dotted vertical line at the true hidden dimension, when it is known."""
    if d_true:
        ax.axvline(d_true, color="k", ls=":", lw=1, label=f"true d = {d_true}")


def name_band(ax, y: float, ticks) -> None:
    """Name the "no estimate" band at height ``y`` on the y axis, a red tick beside the error ``ticks``: a label inside
    the band was covered by its own markers (every figure with the band names it so). Call it once the y limits are
    set: an error tick within a tenth of the axis of the band is left out, its label would touch the band's."""
    low, high = ax.get_ylim()
    ticks = [t for t in ticks if abs(y - t) >= 0.1 * (high - low)]
    ax.set_yticks([*ticks, y], [f"{t:g}" for t in ticks] + ["no estimate"])
    ax.yaxis.get_major_ticks()[len(ticks)].label1.set_color("red")  # also where a shared y axis hides the labels
