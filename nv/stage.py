"""Run one section notebook with papermill, parameterized from params.yaml (a DVC stage's cmd).

``python -m nv.stage NAME [--item KEY] [--params FILE]`` validates the stage's sections of
params.yaml, passes each section as one dict parameter (plus ``seed`` and the project ``root``),
checks that the notebook declares every one of them (papermill would silently ignore an unknown
name), and writes the executed notebook to ``outputs/NAME/NAME.ipynb``. A per-item stage (DVC
``foreach``) gets one entry of its ``each`` section as ``item`` (with ``item_name``) and writes
to ``outputs/NAME/KEY/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nv.errors import NVError, run_main
from nv.params import load_params

@dataclass(frozen=True)
class Stage:
    notebook: str
    sections: tuple[str, ...]
    each: str | None = None  # params section (or section.key) with one entry per DVC foreach item


STAGES: dict[str, Stage] = {
    "model_card": Stage("notebooks/00_model_card.ipynb", ("model", "model_card")),
    "prompt_search": Stage("notebooks/10_prompt_search.ipynb", ("model", "search")),
    "sampling": Stage("notebooks/11_sampling.ipynb", ("model", "sampling", "spectrum")),
    "pruning": Stage("notebooks/12_pruning.ipynb", ()),
    "spectrum": Stage("notebooks/13_spectrum.ipynb", ("model", "spectrum")),
    "budget_sweep": Stage("notebooks/14_budget_sweep.ipynb", ("spectrum", "sweep")),
    "exactness": Stage("notebooks/15_exactness.ipynb", ("model", "sampling", "spectrum", "exactness", "validation")),
    "planner": Stage("notebooks/16_planner.ipynb", ("model", "sweep", "validation", "planner")),
    "sample_complexity": Stage("notebooks/20_sample_complexity.ipynb", ("model", "sample_complexity")),
    "carlini_baseline": Stage("notebooks/21_carlini_baseline.ipynb", ("model", "spectrum", "carlini_baseline")),
    "timing_reference": Stage("notebooks/30_timing_collect.ipynb", ("model", "timing"), each="timing_family"),
    "timing_target": Stage("notebooks/30_timing_collect.ipynb", ("model", "timing", "timing_target")),
    "timing_fit": Stage("notebooks/31_timing_fit.ipynb", ("timing", "timing_family")),
    "overall": Stage("notebooks/40_overall_results.ipynb", ("timing", "timing_family", "overall")),
    "validation_phase1": Stage("notebooks/50_validation_phase1.ipynb", ("model", "search", "sampling", "spectrum"),
                               each="validation.models"),
    "validation_timing": Stage("notebooks/51_validation_timing.ipynb", ("model", "timing"), each="validation.models"),
    "validation": Stage("notebooks/52_validation.ipynb",
                        ("model", "timing", "timing_family", "overall", "spectrum", "validation")),
    "defences": Stage("notebooks/60_defences.ipynb", ("model", "spectrum", "sampling", "timing", "timing_family", "defences")),
}


def _ipc_kernel_manager():
    """A kernel manager whose kernel talks over local IPC sockets instead of TCP on loopback: the kernel
    warns about unencrypted TCP on every start, and a stage talks only to its own kernel."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _default_transport(self) -> str:
            return "ipc"

    return IPCKernelManager


def run_stage(
    name: str, params_path: str | Path = "params.yaml", root: str | Path | None = None, item: str | None = None
) -> Path:
    """Execute stage ``name``'s notebook (for ``item`` of a per-item stage); return the executed notebook."""
    import papermill

    if name not in STAGES:
        raise NVError(f"unknown stage {name!r}; known: {', '.join(STAGES)}")
    stage = STAGES[name]
    root = Path(root or os.getcwd()).resolve()
    section, _, key = (stage.each or "").partition(".")
    params = load_params(root / params_path, list(stage.sections) + ([section] if section else []))
    out = root / "outputs" / name
    if stage.each:
        entries = params.pop(section)
        entries = entries[key] if key else entries
        if item not in entries:
            raise NVError(f"stage {name} runs per item of '{stage.each}': --item must be one of {sorted(entries)}, got {item!r}")
        params.update(item=entries[item], item_name=item)
        out = out / item
    elif item is not None:
        raise NVError(f"stage {name} takes no --item")
    notebook = root / stage.notebook
    declared = set(papermill.inspect_notebook(str(notebook)))
    values = {"root": str(root), **params}
    unknown = sorted(set(values) - declared)
    if unknown:
        raise NVError(f"{stage.notebook} does not declare parameter(s) {unknown} in its parameters cell")
    out.mkdir(parents=True, exist_ok=True)
    executed = out / f"{name}.ipynb"
    os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")
    try:
        papermill.execute_notebook(str(notebook), str(executed), parameters=values, kernel_name="python3", cwd=str(root),
                                   progress_bar=False, kernel_manager_class=_ipc_kernel_manager())
    except papermill.PapermillExecutionError as exc:
        raise NVError(f"stage {name} failed in {stage.notebook}: {exc.ename}: {exc.evalue}") from None
    return executed


def stage_times(root: str | Path | None = None) -> list[tuple[str, float]]:
    """(stage or stage@item, wall seconds) of every executed stage notebook under outputs/, from papermill's record:
    of the items params.yaml names now (another profile's folders are left over, not this run's); a run that failed
    labelled so; a notebook cut short (papermill rewrites it after every cell) left out with a line on stderr."""
    import json

    import yaml

    base = Path(root or os.getcwd()).resolve()
    try:
        params = yaml.safe_load((base / "params.yaml").read_text())
    except (OSError, yaml.YAMLError):
        params = None
    times = []
    for name, stage in STAGES.items():
        items = params
        for key in (stage.each or "").split(".") if stage.each else ():
            items = items.get(key) if isinstance(items, dict) else None
        for executed in sorted(base.glob(f"outputs/{name}/{name}.ipynb")) + sorted(base.glob(f"outputs/{name}/*/{name}.ipynb")):
            item = None if executed.parent.name == name else executed.parent.name
            if item is not None and isinstance(items, dict) and item not in items:
                continue
            try:
                record = json.loads(executed.read_text())["metadata"].get("papermill", {})
            except (OSError, ValueError, KeyError, AttributeError):
                print(f"nv.stage times: {executed} is unreadable (a run cut short?): left out", file=sys.stderr)
                continue
            if record.get("duration") is not None:
                label = name if item is None else f"{name}@{item}"
                times.append((label + (" (failed)" if record.get("exception") else ""), float(record["duration"])))
    return times


def print_times() -> int:
    """``python -m nv.stage times``: where the time of the last run of each stage went (README)."""
    times = stage_times()
    total = sum(t for _, t in times)
    for label, t in sorted(times, key=lambda x: -x[1]):
        print(f"{label:45s} {t / 60:7.1f} min  {100 * t / total:5.1f} %")
    print(f"{'total':45s} {total / 60:7.1f} min")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nv.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"one of: {', '.join(STAGES)}; or 'times' (wall time of each stage's last run)")
    parser.add_argument("--item", help="the entry of a per-item (DVC foreach) stage")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    if args.name == "times":
        return print_times()
    return run_main(lambda: run_stage(args.name, args.params, item=args.item))


if __name__ == "__main__":
    sys.exit(main())
