"""Shared fixtures: the real embedded model (loaded once per session), the project root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")


@pytest.fixture(scope="session")
def lm32():
    """The embedded SmolLM2-135M in float32 compute (exact comparisons)."""
    from nv.model import load_model

    return load_model("embedded", dtype="float32")


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


TINY = {
    "search": {"D": 120, "rounds": 2, "batch_size": 96, "explore_rounds": 1},
    "sampling": {"N": 5000, "chunk": 50},
    "spectrum": {"whitebox_prompts": 60},
    "sweep": {"budgets": [2000, 5000]},
    "model": {"batch_size": 48},
    "sample_complexity": {"D_values": [20, 40], "d_values": [8, 16], "runs": 2, "grid_points": 4},
    "carlini_baseline": {"n_prompts": 80, "precisions": ["float32"]},
}


def write_tiny_params(root: Path, dest: Path) -> Path:
    """The shipped params.yaml with the phase-1 sections shrunk to seconds of work."""
    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section].update(values)
    path = dest / "params.yaml"
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    return path
