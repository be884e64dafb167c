"""Every name the code uses resolves: pyflakes over the package, the benchmarks and the tests finds no undefined
name and no dead import. Such a bug waits where no other test goes: a benchmark's second shape (``del S`` of a
sample ``unseen_models.py`` no longer loaded raised NameError after its first row), an error branch."""

from __future__ import annotations

import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_finds_no_undefined_name_and_no_dead_import():
    out, err = io.StringIO(), io.StringIO()
    found = checkRecursive([str(ROOT / part) for part in ("nv", "benchmarks", "tests")], Reporter(out, err))
    assert found == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
