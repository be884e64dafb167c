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

from conftest import write_tiny_params

BIN = Path(sys.executable).parent
FIGURES = [
    "temperature_entropy.png", "prompt_search.png", "sampling_distinct_tokens.png", "common_set_coverage.png",
    "spectrum_compare.png", "validation_budget.png", "unsaturated_spectrum.png", "expected_N_vs_D.png",
    "spectrum_carlini_vs_common_set.png", "cost_overhead.png",
]
STAGES = {"model_card", "prompt_search", "sampling", "pruning", "spectrum", "budget_sweep", "sample_complexity",
          "carlini_baseline"}


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


def test_second_repro_reruns_nothing(project):
    out = dvc("repro", cwd=project)
    assert ran(out) == [] and "didn't change" in out
    assert "up to date" in dvc("status", cwd=project)


def test_a_spectrum_parameter_reruns_only_dependent_stages(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["spectrum"]["robust"]["z_min"] = 9.0
    (project / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    assert set(ran(dvc("repro", cwd=project))) == {"spectrum", "budget_sweep", "carlini_baseline"}
