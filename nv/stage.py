"""Run one section notebook with papermill, parameterized from params.yaml (a DVC stage's cmd).

``python -m nv.stage NAME [--params FILE]`` validates the stage's sections of params.yaml,
passes each section as one dict parameter (plus ``seed`` and the project ``root``), checks
that the notebook declares every one of them (papermill would silently ignore an unknown
name), and writes the executed notebook to ``outputs/NAME/NAME.ipynb``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nv.errors import NVError
from nv.params import load_params

@dataclass(frozen=True)
class Stage:
    notebook: str
    sections: tuple[str, ...]


STAGES: dict[str, Stage] = {
    "model_card": Stage("notebooks/00_model_card.ipynb", ("model", "model_card")),
    "prompt_search": Stage("notebooks/10_prompt_search.ipynb", ("model", "search")),
    "sampling": Stage("notebooks/11_sampling.ipynb", ("model", "sampling")),
    "pruning": Stage("notebooks/12_pruning.ipynb", ()),
    "spectrum": Stage("notebooks/13_spectrum.ipynb", ("model", "spectrum")),
    "budget_sweep": Stage("notebooks/14_budget_sweep.ipynb", ("spectrum", "sweep")),
    "sample_complexity": Stage("notebooks/20_sample_complexity.ipynb", ("model", "sample_complexity")),
    "carlini_baseline": Stage("notebooks/21_carlini_baseline.ipynb", ("model", "spectrum", "carlini_baseline")),
}


def run_stage(name: str, params_path: str | Path = "params.yaml", root: str | Path | None = None) -> Path:
    """Execute stage ``name``'s notebook; return the executed notebook's path."""
    import papermill

    if name not in STAGES:
        raise NVError(f"unknown stage {name!r}; known: {', '.join(STAGES)}")
    stage = STAGES[name]
    root = Path(root or os.getcwd()).resolve()
    params = load_params(root / params_path, list(stage.sections))
    notebook = root / stage.notebook
    declared = set(papermill.inspect_notebook(str(notebook)))
    values = {"root": str(root), **params}
    unknown = sorted(set(values) - declared)
    if unknown:
        raise NVError(f"{stage.notebook} does not declare parameter(s) {unknown} in its parameters cell")
    out = root / "outputs" / name
    out.mkdir(parents=True, exist_ok=True)
    executed = out / f"{name}.ipynb"
    os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")
    try:
        papermill.execute_notebook(
            str(notebook), str(executed), parameters=values, kernel_name="python3", cwd=str(root), progress_bar=False
        )
    except papermill.PapermillExecutionError as exc:
        raise NVError(f"stage {name} failed in {stage.notebook}: {exc.ename}: {exc.evalue}") from None
    return executed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nv.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"one of: {', '.join(STAGES)}")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        run_stage(args.name, args.params)
    except NVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
