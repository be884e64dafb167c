"""dvc.yaml: each stage depends on its notebook and exactly the nv modules that notebook imports (transitively),
so a change to an imported module reruns the stage and a change elsewhere in nv reruns nothing."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _module_file(name: str) -> Path | None:
    for path in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py"):
        if path.is_file():
            return path
    return None


def _nv_imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n == "nv" or n.startswith("nv.")}


def imported_modules(notebook: Path) -> set[str]:
    """Files of every nv module (and package __init__ on the way) the notebook's code cells import."""
    cells = json.loads(notebook.read_text())["cells"]
    todo = list(_nv_imports("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    seen: set[Path] = set()
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):
            path = _module_file(".".join(parts[:i]))
            if path and path not in seen:
                seen.add(path)
                todo += _nv_imports(path.read_text())
    return {str(p.relative_to(ROOT)) for p in seen}


def test_every_stage_depends_on_exactly_the_nv_modules_its_notebook_imports():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        deps = stage.get("do", stage)["deps"]
        notebook = next(d for d in deps if d.startswith("notebooks/"))
        declared = {d for d in deps if d.startswith("nv/")}
        assert declared == imported_modules(ROOT / notebook), name
        assert all((ROOT / d).exists() for d in declared), name


def test_the_import_walk_sees_a_module_pulled_in_transitively():
    spectrum = imported_modules(ROOT / "notebooks" / "13_spectrum.ipynb")
    assert {"nv/phase1/spectrum.py", "nv/oracle/multinomial.py", "nv/models/packaged.py"} <= spectrum
    assert "nv/phase2/fit.py" not in spectrum and "nv/cli.py" not in spectrum
