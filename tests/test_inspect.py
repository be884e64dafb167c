"""Interactive inspection: nv.phase1.inspect's cached recompute and the notebook executed headless by papermill.

The input is synthetic, not a real model's: a toy oracle (``tests/synthetic.LowRankOracle``, a random linear "LM" over
a 300-token vocabulary whose logits have rank R exactly, so the right answer is known) stands in for the model, and
only the code around it is the pipeline's own: its samples go through nv.phase1.sampling.collect (shards + manifest
as the sampling stage writes them) and nv.phase1.pipeline.common_set into common_set.npz as the pruning stage stores
it. The spectral estimators on the real SmolLM2 common set are tested in tests/test_softmax_bottleneck.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from nv.errors import NVError
from nv.phase1 import pipeline
from nv.phase1.inspect import STORED, Source, load_spectra, recompute, spectra_from_matrix, summary
from nv.phase1.pipeline import common_set, estimate_both
from nv.phase1.sampling import collect, load_samples
from nv.phase1.spectrum import paper as paper_detector
from nv.phase1.spectrum import robust as robust_detector
from synthetic import LowRankOracle

R, VOCAB, D, N = 12, 300, 80, 20_000
PAPER = {"p": 0.54, "g": 128, "w": None, "w_s": None, "lam_sad": float(np.pi), "lam_peak": float(np.pi / 2)}
ROBUST = {"g": 8, "z_min": 8.0, "min_ratio": 1.05}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A project root with outputs/sampling/samples and outputs/pruning/common_set.npz of the toy LM (synthetic data
    in the stages' file formats, written by the pipeline's own collect and common_set)."""
    root = tmp_path_factory.mktemp("inspect")
    prompts = [f"prompt {q}" for q in range(D)]
    samples = collect(LowRankOracle(), prompts, N, 2.0, 0, root / "outputs" / "sampling" / "samples", VOCAB,
                      checkpoint_root=root / ".checkpoints", identity={"model": "low-rank"}, chunk=40, progress=False)
    cs = common_set(load_samples(samples))
    (root / "outputs" / "pruning").mkdir(parents=True)
    np.savez(root / "outputs" / "pruning" / "common_set.npz", Y=cs.Y.astype(np.float32), rows=cs.pruned.rows,
             cols=cs.pruned.cols)  # as notebooks/12_pruning.ipynb stores it
    return root


def test_recompute_matches_the_stage_estimators_and_follows_each_hyperparameter(stored):
    Y = np.load(stored / "outputs" / "pruning" / "common_set.npz")["Y"].astype(np.float64)
    spectra = load_spectra(stored / "outputs" / "pruning" / "common_set.npz")
    assert spectra.shape == Y.shape and min(Y.shape) > 3 * R
    est = recompute(spectra, PAPER, ROBUST)
    stage = estimate_both(Y, {"paper": PAPER, "robust": ROBUST})  # what the spectrum stage computes
    assert summary(est) == summary(stage)
    assert (est["robust"].saturated, est["robust"].d_hat_raw, est["robust"].d_hat) == (True, R, 16)
    # grid g snaps the same raw index; a stricter z_min or min_ratio turns the drop into a lower bound
    assert recompute(spectra, PAPER, {**ROBUST, "g": 1})["robust"].d_hat == R
    for strict in ({"z_min": 1e9}, {"min_ratio": 1e9}):
        e = recompute(spectra, PAPER, {**ROBUST, **strict})["robust"]
        assert (e.saturated, e.reason, e.d_hat) == (False, "not saturated", None) and 0 < e.lower_bound <= R + 1
    # the paper detector: its saddle must lie where a_i <= arctan(lam_sad); a tiny lam_sad finds none
    assert recompute(spectra, {**PAPER, "lam_sad": 1e-30}, ROBUST)["paper"].reason == "no saddle"


def test_paper_hyperparameters_move_the_paper_estimate():
    n, d = 200, 100  # a designed spectrum (as tests/test_spectrum.py) where the paper detector finds d exactly
    i = np.arange(n)
    lam = np.where(i < d, 10 ** (2 - 2.5 * i / d), 10 ** (-2 - 3 * ((i - d) / (n - d)) ** 3))
    rng = np.random.default_rng(0)
    Y = (np.linalg.qr(rng.normal(size=(n, n)))[0] * np.sqrt(lam)) @ np.linalg.qr(rng.normal(size=(260, n)))[0].T
    spectra = spectra_from_matrix(Y, "designed")
    np.testing.assert_allclose(spectra.lam, lam, rtol=1e-6, atol=1e-9)
    base = recompute(spectra, {**PAPER, "g": 1}, ROBUST)["paper"]
    assert (base.reason, base.d_hat_raw, base.d_hat) == ("ok", d, d)
    assert paper_detector(Y, **PAPER).d_hat == recompute(spectra, PAPER, ROBUST)["paper"].d_hat == 128
    assert recompute(spectra, {**PAPER, "g": 64}, ROBUST)["paper"].d_hat == 128  # ceil(100 / 64) * 64
    assert recompute(spectra, {**PAPER, "p": 0.99}, ROBUST)["paper"].reason == "no saddle"
    assert robust_detector(Y, **ROBUST).lower_bound == recompute(spectra, PAPER, ROBUST)["robust"].lower_bound


def test_source_budgets_are_the_sweeps_common_sets_and_cached(stored, monkeypatch):
    """A budget is the common set of the first N calls of every prompt (the same draws as thinning in memory), thinned
    from disk and only the common set's columns read: the whole sample is never loaded."""
    reads = []

    def spy(folder, columns=None):
        reads.append(columns is not None and not columns.all())
        return load_samples(folder, columns)

    monkeypatch.setattr(pipeline, "load_samples", spy)
    src = Source(stored / "outputs" / "pruning" / "common_set.npz", samples=stored / "outputs" / "sampling" / "samples")
    assert src.n_max == N and src.spectra(STORED).shape == src.spectra(N).shape
    small = src.spectra(2000)
    assert len(reads) == 2 and all(reads)  # one read a budget, of some columns only
    Y = common_set(load_samples(stored / "outputs" / "sampling" / "samples").subsample(2000, 0)).Y
    assert small.shape == Y.shape and small.shape[1] < src.spectra(STORED).shape[1]
    np.testing.assert_allclose(small.lam, spectra_from_matrix(Y, "direct").lam)
    assert src.spectra(2000) is small
    with pytest.raises(NVError, match="sub-budget"):
        src.spectra(N + 1)
    with pytest.raises(NVError, match="sampling folder"):
        Source(stored / "outputs" / "pruning" / "common_set.npz").spectra(2000)


def test_load_spectra_reads_the_spectrum_stage_file_and_rejects_others(stored, tmp_path):
    spectra = load_spectra(stored / "outputs" / "pruning" / "common_set.npz")
    np.savez(tmp_path / "spectrum.npz", paper_lambda=spectra.lam, robust_sigma=spectra.sigma, full_sigma=spectra.sigma)
    from_file = load_spectra(tmp_path / "spectrum.npz")
    assert from_file.beta == 1.0 and from_file.shape is None
    assert recompute(from_file, PAPER, ROBUST)["robust"].d_hat_raw == R
    np.savez(tmp_path / "other.npz", x=np.ones(3))
    with pytest.raises(NVError, match="neither a matrix 'Y'"):
        load_spectra(tmp_path / "other.npz")
    with pytest.raises(NVError, match="cannot read"):
        load_spectra(tmp_path / "missing.npz")


@pytest.mark.parametrize("budget", [STORED, 2000])
def test_notebook_runs_headless_and_saves_the_initial_figure(stored, root, budget):
    import papermill

    out = f"outputs/inspect-{budget}"
    os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")
    papermill.execute_notebook(
        str(root / "notebooks" / "90_inspect_spectrum.ipynb"), str(stored / f"inspect-{budget}.ipynb"),
        parameters={"root": str(stored), "budgets": [2000, 10_000], "budget": budget, "d_true": R, "out": out,
                    "spectrum": {"paper": PAPER, "robust": ROBUST}, "seed": 0},  # the toy root has no params.yaml
        kernel_name="python3", cwd=str(stored), progress_bar=False,
    )
    png = (stored / out / "spectrum.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert not (stored / "figures").exists()
    record = json.loads((stored / out / "estimates.json").read_text())
    src = Source(stored / "outputs" / "pruning" / "common_set.npz", samples=stored / "outputs" / "sampling" / "samples")
    assert record["budget"] == budget and record["spectrum"] == {"paper": PAPER, "robust": ROBUST}
    assert record["estimates"] == summary(recompute(src.spectra(budget), PAPER, ROBUST))
    assert record["shape"] == list(src.spectra(budget).shape)
    if budget == STORED:
        assert record["estimates"]["robust"]["d_hat_raw"] == R


def test_moving_a_control_redraws_the_panels_and_the_estimates(stored, root):
    """The notebook's cells run in-process (no frontend): changing a widget's value reruns the detectors."""
    import nbformat

    notebook = nbformat.read(root / "notebooks" / "90_inspect_spectrum.ipynb", 4)
    cells = [c.source for c in notebook.cells if c.cell_type == "code"]
    ns: dict = {}
    exec(cells[0], ns)
    ns.update(root=str(stored), budgets=[2000], d_true=R, out="outputs/inspect-live",
              spectrum={"paper": PAPER, "robust": ROBUST}, seed=0)
    for source in cells[1:]:
        exec(source, ns)
    controls, image, status = ns["controls"], ns["image"], ns["status"]
    first = bytes(image.value)
    assert first.startswith(b"\x89PNG") and f"d_hat = 16 (raw {R})" in status.value
    controls["g_robust"].value = 1
    assert f"d_hat = {R} (raw {R})" in status.value and bytes(image.value) != first
    controls["budget"].value = 2000
    assert ns["src"].spectra(2000).shape[1] < ns["src"].spectra(STORED).shape[1] and f"d_hat = {R}" in status.value
    controls["lam_sad"].value = controls["lam_sad"].min
    assert "paper</b>: no saddle" in status.value
