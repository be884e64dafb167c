"""The README's indexes stay true: every function its equation index names exists, the figures it names are the
ones the DVC stages write, and its tables of the committed run are what ``metrics/`` holds (a renamed function, a
dropped figure or a table a run behind fails here, not in a reader's hands)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import yaml

from nv import records

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def equation_rows() -> list[tuple[str, list[str]]]:
    """(paper cell, backticked names of the function cell) of each row of the README's equation index."""
    table = README.split("Every numbered equation and result the method uses", 1)[1].split("\n\n", 2)[1]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return [(cells[0].strip("| "), re.findall(r"`([A-Za-z_][\w.]*)`", cells[-1])) for cells in rows]


def test_every_function_of_the_equation_index_exists():
    rows = equation_rows()
    papers = " ".join(paper for paper, _ in rows)
    for n in range(1, 12):  # the paper's numbered equations (App. F's proof steps are named, not numbered, here)
        assert re.search(rf"Eqs?\. (\d+-)?{n}\b|Eqs\. {n}-", papers) or any(
            int(a) <= n <= int(b) for a, b in re.findall(r"Eqs\. (\d+)-(\d+)", papers)), f"Eq. {n} is not indexed"
    checked = 0
    for paper, names in rows:
        module = None
        for name in names:
            if name.startswith("nv."):
                module_name, _, attr = name.rpartition(".")
                module = importlib.import_module(module_name)
            else:  # a name after a dotted one lives in the same module
                assert module is not None, f"{paper}: `{name}` comes before any `nv.module.function`: name its module"
                attr = name
            assert callable(getattr(module, attr, None)), f"{paper}: the README names {module.__name__}.{attr}: no such function"
            checked += 1
    assert checked >= 20


def test_the_figures_the_readme_names_are_the_ones_the_stages_write():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    written = set()
    for stage in stages.values():
        stage = stage.get("do", stage)
        for out in stage.get("outs", []) + stage.get("plots", []):
            path = out if isinstance(out, str) else next(iter(out))
            if path.startswith("figures/"):
                written.add(path)
    named = set(re.findall(r"figures/[\w.-]+\.png", README))
    assert written and written == named, (sorted(written - named), sorted(named - written))
    assert all((ROOT / f).is_file() for f in written)  # committed with the run that made them


def test_the_readme_tables_of_the_committed_run_are_what_metrics_holds(tmp_path):
    blocks = [m[2] for m in records.BLOCK.finditer(README)]
    assert sorted(blocks) == sorted(records.RENDER), blocks  # every table of the records is in the README, once
    assert records.sync(README, ROOT / "metrics") == README, "README out of date with metrics/: python -m nv.records"
    stale = tmp_path / "README.md"
    stale.write_text(README.replace("<!-- records: validation -->\n", "<!-- records: validation -->\n| stale |\n", 1))
    assert records.main(["--readme", str(stale), "--metrics", str(ROOT / "metrics"), "--check"]) == 1
    assert records.main(["--readme", str(stale), "--metrics", str(ROOT / "metrics")]) == 0
    assert stale.read_text() == README
    # a lost closing marker or a missing block is a one-line error, and nothing is written
    broken = README.replace("<!-- /records -->", "", 1)
    stale.write_text(broken)
    assert records.main(["--readme", str(stale), "--metrics", str(ROOT / "metrics")]) == 2
    assert stale.read_text() == broken
    first = next(records.BLOCK.finditer(README))
    stale.write_text(README.replace(first[0], "", 1))
    assert records.main(["--readme", str(stale), "--metrics", str(ROOT / "metrics"), "--check"]) == 2


def test_an_unbounded_interval_or_a_missing_p_hat_renders(tmp_path):
    """An interval with fewer than two references with a fit is stored with a null end, and a depth without an
    attacker-side P_hat with a null P_hat: the validation table says inf and "no estimate" (it was a TypeError)."""
    import json

    metrics = json.loads((ROOT / "metrics" / "validation.json").read_text())
    entry = metrics["models"][0]
    assert entry["L_hat"] is not None
    entry.update(L_hi=None, L_hi_rule=None, P_hat=None)
    rendered = records.validation(metrics)
    row = next(line for line in rendered.splitlines() if records.label(entry["model"]) in line)
    assert f"{entry['L_lo']:.1f}, inf]" in row and "no estimate" in row
    # the paper detector abstains without a lower bound (spectrum.method: paper; a TypeError, a review)
    entry.update(saturated=False, lower_bound=None)
    row = next(line for line in records.validation(metrics).splitlines() if records.label(entry["model"]) in line)
    assert "**not saturated** |" in row


def test_a_relative_error_is_rounded_once():
    """+15.48 % reads +15 %, not +16 % by way of 15.5; under 10 % one decimal, 9.96 % reads +10 %."""
    assert records.pct(570.47, 494.0) == "+15 %"
    assert records.pct(28.38, 30) == "-5.4 %"
    assert records.pct(109.96, 100) == "+10 %"
    assert records.pct(30.0, 30) == records.pct(29.99, 30) == "+0.0 %"
