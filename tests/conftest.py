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
