"""Real DVC + papermill runs in a copy of the project (what `make repro` does, at tiny size)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "JUPYTER_PREFER_ENV_PATH": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def project(root, tmp_path_factory) -> Path:
    """The committed + untracked (not ignored) files of the project, as a fresh git repo."""
    dest = tmp_path_factory.mktemp("project")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (root / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
    run(["git", "init", "-q"], dest)
    run([str(BIN / "dvc"), "pull", "-q", "data.dvc"], dest)
    return dest


def tiny(project: Path, **sections) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    for name, values in sections.items():
        params[name].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))


def test_model_card_stage_runs_then_nothing_reruns(project):
    tiny(project, model_card={"top_k": 50})
    run([str(BIN / "dvc"), "repro", "model_card"], project)
    assert (project / "figures" / "temperature_entropy.png").stat().st_size > 10_000
    card = project / "outputs" / "model_card"
    assert (card / "model_card.ipynb").is_file() and "top50_mass" in (card / "temperature_entropy.csv").read_text()
    again = run([str(BIN / "dvc"), "repro", "model_card"], project)
    assert "didn't change, skipping" in again.stdout
    assert "Running stage" not in again.stdout
    status = run([str(BIN / "dvc"), "status"], project)
    assert "up to date" in status.stdout
