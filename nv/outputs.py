"""What one stage hands the next (``outputs/STAGE/...``, ``metrics/``), read back: a missing, cut-short or corrupt
file is one line naming it and the stage to rerun, not a JSONDecodeError or BadZipFile traceback."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nv.errors import NPZ_ERRORS, NVError

FOREACH = ("timing_reference", "validation_phase1", "validation_timing")  # stages with one item per folder


def _rerun(path: Path, stage: str | None) -> str:
    """What to do: rerun the stage that wrote ``path`` (``stage``, or read off ``outputs/STAGE[/ITEM]/...``)."""
    parts = path.parts
    if stage is None and "outputs" in parts[:-2]:  # outputs/STAGE/.../file
        i = len(parts) - 3 - parts[-3::-1].index("outputs")  # the last: a checkout may sit under a folder so named
        stage = parts[i + 1]
        if stage in FOREACH and len(parts) > i + 3:
            stage = f"{stage}@{parts[i + 2]}"
    return f"rerun `dvc repro {stage}`" if stage else "rerun the stage that wrote it"


def read_json(path: str | Path, stage: str | None = None):
    """The JSON value in ``path``, written by ``stage`` (default: read off the path)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NVError(f"missing {path}: {_rerun(path, stage)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NVError(f"cannot read {path} ({getattr(exc, 'strerror', None) or exc}): {_rerun(path, stage)}") from None
    try:
        return json.loads(text)
    except ValueError:
        raise NVError(f"{path} is not valid JSON (cut short or edited?): {_rerun(path, stage)}") from None


def read_npz(path: str | Path, stage: str | None = None) -> dict[str, np.ndarray]:
    """Every array of the .npz ``path``, read now (a damaged member fails here, named), written by ``stage``."""
    path = Path(path)
    try:
        with np.load(path) as z:
            return {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise NVError(f"missing {path}: {_rerun(path, stage)}") from None
    except NPZ_ERRORS as exc:
        raise NVError(f"{path} is corrupt ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): "
                      f"{_rerun(path, stage)}") from None


def json_value(value):
    """A table cell as a JSON value: NaN or inf (no estimate) as null, numpy scalars as Python numbers."""
    if isinstance(value, float | np.floating) and not np.isfinite(value):
        return None
    return value.item() if isinstance(value, np.generic) else value


def interval_text(lo, hi, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """A 90 % interval as a table cell, "[lo, hi]" in ``scale`` units: an unbounded upper end (inf, or null as
    ``json_value`` stores it) as inf; no interval (lo missing) as ""."""
    def finite(v) -> bool:
        return v is not None and bool(np.isfinite(v))

    if not finite(lo):
        return ""
    return f"[{fmt.format(lo / scale)}, {fmt.format(hi / scale) if finite(hi) else 'inf'}]"


def write_json(path: str | Path, value) -> None:
    """``value`` as indented JSON in ``path``, replaced whole (a temporary file, then a rename): a reader, or a run
    stopped mid-write, never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Phase1Run:
    """One real model's phase-1 outputs: the section stages' (``item`` None: model.spec) or those of
    ``validation_phase1@NAME`` (``item``: its validation.models entry). ``d_true`` is for evaluation only."""

    spec: str
    prompts: Path
    samples: Path
    sweep: Path
    d_true: int
    item: dict | None


def phase1_runs(root: Path, spec: str, items: dict) -> list[Phase1Run]:
    """model.spec's phase-1 run, then each of ``items`` (validation.models)'."""
    out = root / "outputs"
    runs = [Phase1Run(spec, out / "prompt_search" / "prompts.json", out / "sampling" / "samples",
                      out / "budget_sweep" / "sweep.csv", read_json(out / "model_card" / "architecture.json")["d"], None)]
    for name, item in items.items():
        folder = out / "validation_phase1" / name
        runs.append(Phase1Run(item["spec"], folder / "prompts.json", folder / "samples", folder / "sweep.csv",
                              read_json(folder / "report.json")["d_true"], item))
    return runs
