"""Real DVC + papermill runs of every stage in a copy of the project, at tiny parameters."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_FAMILY, write_tiny_params

BIN = Path(sys.executable).parent
FIGURES = [
    "temperature_entropy.png", "prompt_search.png", "sampling_distinct_tokens.png", "common_set_coverage.png",
    "spectrum_compare.png", "validation_budget.png", "unsaturated_spectrum.png", "expected_N_vs_D.png",
    "spectrum_carlini_vs_common_set.png", "cost_overhead.png", "timing_scaling.png", "timing_measured_vs_predicted.png",
    "timing_errors.png", "timing_cross_platform.png", "overall_error_vs_budget.png",
]
STAGES = {"model_card", "prompt_search", "sampling", "pruning", "spectrum", "budget_sweep", "sample_complexity",
          "carlini_baseline", "timing_target", "timing_fit", "overall"} | {f"timing_reference@{m}" for m in TINY_FAMILY}


def dvc(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "JUPYTER_PREFER_ENV_PATH": "1"}
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def ran(stdout: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", stdout)


@pytest.fixture(scope="module")
def project(root, tmp_path_factory) -> Path:
    """The committed + untracked (not ignored) files of the project, as a fresh git repo, tiny params."""
    dest = tmp_path_factory.mktemp("project")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for f in files:
        if (root / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
    for f in FIGURES:  # committed figures must be regenerated, not found
        (dest / "figures" / f).unlink(missing_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    dvc("pull", "-q", "data.dvc", cwd=dest)
    write_tiny_params(root, dest)
    return dest


def test_repro_runs_every_stage_and_writes_every_figure(project):
    out = dvc("repro", cwd=project)
    assert set(ran(out)) == STAGES
    for f in FIGURES:
        assert (project / "figures" / f).stat().st_size > 10_000, f
    metrics = json.loads((project / "metrics" / "hidden_dim.json").read_text())
    for key in ("model", "estimator", "d_true", "d_hat_raw", "d_hat", "rel_error", "d_hat_paper", "D", "D_prime",
                "common_set_size", "N", "tokens", "calls", "i_sad", "i_peak"):
        assert key in metrics
    assert metrics["d_true"] == 576 and metrics["D"] == 120 and metrics["N"] == 5000
    sweep = (project / "outputs" / "budget_sweep" / "sweep.csv").read_text()
    assert sweep.count("\n") == 1 + 2 * 2  # header + 2 budgets x 2 estimators
    card = (project / "outputs" / "model_card" / "temperature_entropy.csv").read_text()
    assert "top100_mass" in card
    timing = json.loads((project / "metrics" / "timing.json").read_text())
    rows = {(r["calibration"], r["d_source"]): r for r in timing["target"]}
    assert set(rows) == {("same platform", "d_hat"), ("same platform", "true d"),
                         ("inprocess -> llamacpp", "d_hat"), ("inprocess -> llamacpp", "true d")}
    for row in rows.values():
        for key in ("model", "L_true", "P_true", "lengths", "trials", "d_used", "note"):
            assert row[key] is not None, key
        assert row["L_true"] == 30 and row["trials"] == 2 and row["d_used"] == 576 and len(row["lengths"]) >= 4
        # tiny sweeps are mostly noise: a depth, or the reason there is none
        assert (row["L_hat"] is not None and row["L_hat"] > 0 and row["k"] > 0) or row["note"], row
    assert rows[("same platform", "d_hat")]["k"] in (1.0, None)


def test_second_repro_reruns_nothing(project):
    out = dvc("repro", cwd=project)
    assert ran(out) == [] and "didn't change" in out
    assert "up to date" in dvc("status", cwd=project)


def test_a_spectrum_parameter_reruns_only_dependent_stages(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["spectrum"]["robust"]["z_min"] = 9.0
    (project / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    watched = [project / "metrics" / "hidden_dim.json", project / "outputs" / "budget_sweep" / "sweep.csv"]
    before = [f.read_text() for f in watched]
    stages = set(ran(dvc("repro", cwd=project)))
    hidden, sweep = (f.read_text() != b for f, b in zip(watched, before))
    # phase 2 reads phase 1's d_hat, the overall stage the sweep and phase 2: they rerun only if those changed
    timing = {"timing_target", "timing_fit"} if hidden else set()
    overall = {"overall"} if hidden or sweep else set()
    assert stages == {"spectrum", "budget_sweep", "carlini_baseline"} | timing | overall


def test_adding_a_reference_model_reruns_only_its_stage(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["timing_family"]["t-192x2"] = {"d": 192, "L": 2, "n_kv_heads": 1, "d_ffn": 384}
    (project / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    assert set(ran(dvc("repro", cwd=project))) == {"timing_reference@t-192x2", "timing_fit", "overall"}


def test_exp_run_on_one_phase1_parameter_reruns_only_dependent_stages(project):
    """`dvc exp run -S` (a reviewer's one-parameter experiment) on the committed copy runs only the stages
    that read the parameter, and phase 2 and the overall stage only if their inputs changed."""
    dvc("repro", cwd=project)  # nothing after the tests above; the whole pipeline when this test runs alone
    for args in (["config", "user.name", "nv-test"], ["config", "user.email", "nv-test@localhost"], ["add", "-A"],
                 ["commit", "-q", "-m", "base"]):  # dvc exp needs a commit, and commits the experiment itself
        subprocess.run(["git", *args], cwd=project, check=True, capture_output=True, timeout=300)
    watched = [project / "metrics" / "hidden_dim.json", project / "outputs" / "budget_sweep" / "sweep.csv"]
    before = [f.read_text() for f in watched]
    stages = set(ran(dvc("exp", "run", "-S", "spectrum.robust.z_min=7.5", cwd=project)))
    hidden, sweep = (f.read_text() != b for f, b in zip(watched, before))
    timing = {"timing_target", "timing_fit"} if hidden else set()
    overall = {"overall"} if hidden or sweep else set()
    assert stages == {"spectrum", "budget_sweep", "carlini_baseline"} | timing | overall
    assert yaml.safe_load((project / "params.yaml").read_text())["spectrum"]["robust"]["z_min"] == 7.5
    assert len(dvc("exp", "list", "--name-only", cwd=project).split()) == 1
