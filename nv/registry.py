"""The paper's model table (Tab. model-architectures, App. C) as data: ``data/models.csv`` tracked by ``data.dvc``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from nv.errors import NVError

COLUMNS = ["model_id", "family", "role", "L", "d", "d_ffn", "n_heads", "n_kv_heads", "vocab_size", "tied", "type"]


def load_registry(data_dir: str | Path = "data") -> pd.DataFrame:
    """The 39 models of App. C (32 validation + 7 development), one row each."""
    path = Path(data_dir) / "models.csv"
    if not path.is_file():
        raise NVError(f"model registry {path} is missing: run 'dvc pull data.dvc' (or 'make repro')")
    table = pd.read_csv(path)
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise NVError(f"model registry {path} lacks columns {missing}")
    return table
