"""Interactive spectrum inspection (notebooks/90_inspect_spectrum.ipynb): both detectors rerun live.

The costly step of Alg. 2 (lines 1-2: the Gram matrix and its eigenvalues) depends on the pruned
matrix Y only, not on the detector's hyperparameters; so does the robust detector's row-centred
spectrum. `Spectra` holds both once per matrix, and `recompute` reruns the two detectors (Alg. 2
lines 3-8 with p, w, w_s, g, lam_sad, lam_peak; robust with g, z_min, min_ratio) in milliseconds.
A `Source` gives the Spectra of a stored matrix or spectrum and, from a sampling folder, of any
budget N <= N_max (the first N calls of every prompt, then greedy pruning, as the budget sweep).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from nv.errors import NVError
from nv.phase1.pipeline import common_set_of
from nv.plots.phase1 import spectrum_panels
from nv.phase1.sampling import manifest, thinned_folder
from nv.phase1.spectrum import (
    SpectrumEstimate,
    centred_singular_values,
    gram_eigenvalues,
    paper_from_eigenvalues,
    robust_from_singular_values,
)

STORED = "stored"  # the budget of the source as it was saved


@dataclass(frozen=True)
class Spectra:
    """Eigenvalues lambda_i of G (uncentred Y, the paper detector's input) and singular values
    sigma_i of the row-centred Y (the robust detector's), with beta = aspect ratio of Y."""

    lam: np.ndarray
    sigma: np.ndarray
    beta: float
    shape: tuple[int, int] | None
    label: str


def spectra_from_matrix(Y, label: str) -> Spectra:
    """Both spectra of the pruned matrix Y (D' x |C|), exactly as `nv.phase1.spectrum.paper` / `robust` form them."""
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim != 2 or min(Y.shape) < 2:
        raise NVError(f"{label}: the common set is {Y.shape}, too small for a spectrum (need >= 2 x 2)")
    sigma, beta = centred_singular_values(Y)
    return Spectra(gram_eigenvalues(Y), sigma, beta, tuple(Y.shape), label)


def load_spectra(path: str | Path, key: str = "Y") -> Spectra:
    """A stored spectrum input: an .npz holding the pruned matrix under ``key`` (the pruning stage's
    common_set.npz), or the spectrum stage's spectrum.npz (``paper_lambda``, ``robust_sigma``).

    spectrum.npz does not record the shape of Y; its beta is then 1, the largest Gavish-Donoho
    threshold, so the robust detector's lower bound stays conservative.
    """
    path = Path(path)
    try:
        z = np.load(path)
    except (OSError, ValueError):
        raise NVError(f"cannot read a spectrum from {path}: expected an .npz file") from None
    with z:
        if key in z.files:
            return spectra_from_matrix(z[key], path.name)
        if {"paper_lambda", "robust_sigma"} <= set(z.files):
            return Spectra(np.asarray(z["paper_lambda"], np.float64), np.asarray(z["robust_sigma"], np.float64),
                           1.0, None, path.name)
    raise NVError(f"{path} holds neither a matrix '{key}' nor paper_lambda/robust_sigma (keys: {', '.join(z.files)})")


def recompute(spectra: Spectra, paper: dict, robust: dict) -> dict[str, SpectrumEstimate]:
    """Both estimators for these hyperparameters (``paper``: p, w, w_s, g, lam_sad, lam_peak as in
    Alg. 2, w/w_s None = the paper's defaults; ``robust``: g, z_min, min_ratio), from cached spectra."""
    return {"robust": robust_from_singular_values(spectra.sigma, spectra.beta, **robust),
            "paper": paper_from_eigenvalues(spectra.lam, **paper)}


class Source:
    """The spectra to inspect: a stored file (budget ``STORED``) and, when ``samples`` is a sampling
    folder, every budget N <= N_max of it, each computed once and cached (thinned from disk,
    ``thinned_folder``, and only its common set's columns read, ``common_set_of``: the whole sample,
    ~1.5 GB on the default profile, is never held)."""

    def __init__(self, path: str | Path, key: str = "Y", samples: str | Path | None = None, seed: int = 0):
        self.path, self.key, self.seed = Path(path), key, seed
        self.samples_dir = Path(samples) if samples else None
        self._cache: dict = {}

    @property
    def n_max(self) -> int | None:
        """Samples per prompt N_max of the sampling folder (from its manifest), None without one."""
        if self.samples_dir is None:
            return None
        return manifest(self.samples_dir)["N"]

    def spectra(self, budget: int | str = STORED) -> Spectra:
        if budget not in self._cache:
            self._cache[budget] = self._load(budget)
        return self._cache[budget]

    def _load(self, budget) -> Spectra:
        if budget == STORED:
            return load_spectra(self.path, self.key)
        if self.samples_dir is None:
            raise NVError(f"budget N = {budget} needs a sampling folder (samples=...)")
        with thinned_folder(self.samples_dir, int(budget), self.seed) as at:
            Y = common_set_of(at)[0].Y
        return spectra_from_matrix(Y, f"N = {int(budget):,} samples per prompt")


def draw(source: Source, budget, paper: dict, robust: dict, full_sigma=None, d_true: int | None = None):
    """Recompute both estimates at ``budget`` for these hyperparameters; return them and the four
    spectrum panels (`nv.plots.phase1.spectrum_panels`) titled with the source and the hyperparameters."""
    spectra = source.spectra(budget)
    estimates = recompute(spectra, paper, robust)
    fig = spectrum_panels(full_sigma, estimates["paper"], estimates["robust"], d_true)
    shape = "" if spectra.shape is None else f", D' x |C| = {spectra.shape[0]:,} x {spectra.shape[1]:,}"
    fig.suptitle(f"{spectra.label}{shape}\npaper: {_fmt(paper)}\nrobust: {_fmt(robust)}", y=1.06, fontsize=10)
    return estimates, fig


def _fmt(hyper: dict) -> str:
    return ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in hyper.items())


def summary(estimates: dict[str, SpectrumEstimate]) -> dict:
    """The estimates as JSON-ready values: reason, d_hat_raw, d_hat, g, lower bound, paper landmarks."""
    out = {}
    for method, e in estimates.items():
        out[method] = {"reason": e.reason, "saturated": e.saturated, "d_hat_raw": e.d_hat_raw, "d_hat": e.d_hat,
                       "g": e.g, "lower_bound": e.lower_bound}
        if method == "paper":
            out[method].update({k: None if e.diagnostics.get(k) is None else int(e.diagnostics[k])
                                for k in ("i_sad", "i_peak")})
    return out


def to_png(fig) -> bytes:
    """The figure as PNG bytes (for an ipywidgets Image, whatever the matplotlib backend), closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
