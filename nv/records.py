"""The committed run's records as the README quotes them: its tables rendered from ``metrics/*.json``.

The README's tables of the committed run (the validation table, the attacked model's phase 2, the planner's check,
the tokens to exact) sit between ``<!-- records: NAME -->`` and ``<!-- /records -->`` and are written from the DVC
metrics by ``python -m nv.records`` (after a run whose records are adopted); ``--check`` fails where the README no
longer says what ``metrics/`` holds, and ``tests/test_docs.py`` runs it. Pure functions from the metrics' dicts to
markdown; the file I/O is ``sync`` and ``main`` at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

from nv.errors import NVError, run_main
from nv.models.packaged import PACKAGED
from nv.outputs import interval_text
from nv.overall import to_markdown

OPEN, CLOSE = "<!-- records: ", "<!-- /records -->"
# a block ends at the first closing marker and may not contain another opening one
BLOCK = re.compile(r"(<!-- records: (\w+) -->\n)((?:(?!<!-- records: ).)*?)(<!-- /records -->)", re.S)


def label(model: str) -> str:
    """A model's name in tables: the spec as params names it, with a packaged model's file name up to "-Instruct"
    beside it where the two differ (``embedded (SmolLM2-135M)``)."""
    name = re.split("-instruct", PACKAGED[model].file, flags=re.I)[0] if model in PACKAGED else model
    return f"`{model}`" if name.lower() == model.lower() else f"`{model}` ({name})"


def sci(x: float, digits: int = 2) -> str:
    """3.8·10^10, 10^5, 4.53·10^5: the README's way of writing a budget x > 0 (``digits`` significant)."""
    e = math.floor(math.log10(x))
    m = round(x / 10 ** e, digits - 1)
    if m >= 10:
        m, e = m / 10, e + 1
    mant = f"{m:.{digits - 1}f}".rstrip("0").rstrip(".")
    return f"10^{e}" if mant == "1" else f"{mant}·10^{e}"


def pct(estimate: float, truth: float) -> str:
    """Signed relative error in %, two significant digits (-7.0 %, +26 %), rounded once from the exact ratio."""
    e = 100 * (estimate - truth) / truth
    return f"{round(e, 1) + 0.0:+.1f} %" if abs(round(e, 1)) < 10 else f"{e:+.0f} %"


def table(header: list[str], rows: list[list[str]]) -> str:
    """The rows (cells already written) as a markdown table, by the project's one table writer."""
    return to_markdown(pd.DataFrame(rows, columns=header))


def span(m: dict, what: str, suffix: str, scale: float, fmt: str) -> str:
    """A metrics entry's interval ``{what}_lo{suffix}``, ``{what}_hi{suffix}`` as text (``interval_text``: an
    unbounded end, null where fewer than two references gave a fit, as inf)."""
    return interval_text(m[f"{what}_lo{suffix}"], m[f"{what}_hi{suffix}"], scale, fmt)


def validation(metrics: dict) -> str:
    """``metrics/validation.json``: d_hat, L_hat, P_hat of every validation model with their 90 % intervals."""
    rows = []
    for m in metrics["models"]:
        tied = PACKAGED[m["model"]].facts.get("tied_embeddings") if m["model"] in PACKAGED else None
        if m["saturated"]:
            d = f"**{m['d_hat_raw']:.0f}** [{math.floor(m['d_lo'])}, {math.ceil(m['d_hi'])}]"
        else:
            d = "**not saturated**" + ("" if m["lower_bound"] is None else f": d >= {m['lower_bound']:.0f}")  # paper: no bound
        L = P = L10 = Pp = Po = "no estimate"
        if m.get("L_hat") is not None:
            L = (f"{m['L_hat']:.1f} ({pct(m['L_hat'], m['L_true'])}, {m['rule']}) {span(m, 'L', '', 1, '{:.1f}')}; "
                 f"{span(m, 'L', '_rule', 1, '{:.1f}')}")
            if m.get("P_hat") is not None:
                P = (f"**{m['P_hat'] / 1e6:.0f} M ({pct(m['P_hat'], m['P_true'])})** {span(m, 'P', '', 1e6, '{:.0f}')}; "
                     f"{span(m, 'P', '_rule', 1e6, '{:.0f}')}")
            Pp = f"{m['P_hat_paper'] / 1e6:.0f} M ({pct(m['P_hat_paper'], m['P_true'])})"
            Po = f"{m['P_hat_oracle'] / 1e6:.0f} M ({pct(m['P_hat_oracle'], m['P_true'])})"
        if m.get("L_hat_eq10") is not None:
            L10 = f"{m['L_hat_eq10']:.1f} ({pct(m['L_hat_eq10'], m['L_true'])})"
        rows.append([label(m["model"]), str(m["d_true"]), d, str(m["L_true"]), L, L10,
                     f"{m['P_true'] / 1e6:.1f} M" + (" (tied)" if tied else ""), P, Pp, Po])
    return table(["model", "d", "d_hat_raw (90 %)", "L", "L_hat (rule's estimator; 90 %: hull; rule's alone)",
                  "L_hat Eq. 10", "P", "P_hat attacker-side (90 %: hull; rule's alone)", "P_hat paper ratios",
                  "P_hat true ratios (oracle)"], rows)


def timing(metrics: dict) -> str:
    """``metrics/timing.json``: the attacked model's L_hat and P_hat with phase 1's d_hat, per calibration."""
    rows = []
    for t in metrics["target"]:
        if t["d_source"] != "d_hat":
            continue
        where = (f"same platform (`{next(iter(metrics['platforms']))}`)" if t["calibration"] == "same platform"
                 else "`{}` -> `{}` (k = {:.1f})".format(*t["calibration"].split(" -> "), t["k"]))
        cells = [where]
        for key, truth in (("L_hat", "L_true"), ("L_hat_eq10", "L_true")):
            v = t.get(key)
            cells.append(f"{v:.1f} ({pct(v, t[truth])})" if v is not None else "no estimate")
        for key in ("P_hat_registry_raw", "P_hat_paper_raw"):
            v = t.get(key)
            cells.append(f"{v / 1e6:.1f} M ({pct(v, t['P_true'])})" if v is not None else "no estimate")
        rows.append(cells)
    d_used = next(t["d_used"] for t in metrics["target"] if t["d_source"] == "d_hat")
    return table([f"attacked model (d_hat = {d_used:.0f} from phase 1)", "L_hat (§4.2 basic, Eq. 9)", "L_hat (Eq. 10)",
                  "P_hat (true ratios)", "P_hat (paper ratios 1/4, 3.5, untied)"], rows)


def planner(metrics: dict) -> str:
    """``metrics/planner.json``: the strict common set measured and predicted from the pilot at each budget, and the
    distinct tokens a prompt drew (the sample's size)."""
    rows = []
    for model in dict.fromkeys(c["model"] for c in metrics["checks"]):
        checks = [c for c in metrics["checks"] if c["model"] == model]
        rows.append([label(model), " / ".join(sci(c["N"], 3) for c in checks),
                     " / ".join(f"{c['measured_C']:,}" for c in checks),
                     " / ".join(f"{c['predicted_C']:,.0f}" for c in checks),
                     " / ".join(f"{c['N_ratio']:.2f}" for c in checks) + " x N",
                     " / ".join(f"{c['measured_distinct']:,.0f}" for c in checks),
                     " / ".join(f"{c['predicted_distinct']:,.0f}" for c in checks)])
    return table(["model", "N", "measured \\|C\\| (strict)", "predicted", "N the planner asks for that \\|C\\|",
                  "distinct tokens a prompt drew", "predicted"], rows)


METHODS = {"robust": "robust", "incomplete": "missing-data", "paper": "paper"}


def _cheapest(row: dict) -> str:
    """One estimator's tokens to exact: the cheapest exact cell, or why there is none."""
    if row["tokens"] is not None:
        cell = f"{sci(row['tokens'], 3)} ({row['D']:.0f}, {sci(row['N'], 3)})"
        if row["stays_exact"] is False:
            cell += ", not exact at every dearer cell"
    elif row["best_lower_bound"] is not None:
        cell = f"not exact (d >= {row['best_lower_bound']:.0f} at {sci(row['max_tokens_tried'], 3)})"
    elif not row["wrong_cells"]:
        return "no estimate"
    else:
        cell = "never exact"
    if row["wrong_cells"]:
        cell += f"; **wrong in {row['wrong_cells']} of {row['cells']} cells**"
    return cell


def tokens_to_exact(metrics: dict) -> str:
    """``metrics/efficiency.json``: per model and temperature each estimator's cheapest exact cell (D, N)."""
    groups: dict[tuple, dict] = {}
    for r in metrics["tokens_to_exact"]:
        groups.setdefault((r["model"], r["temperature"]), {})[r["method"]] = r
    rows = [[label(model), f"{tau:g}"] + [_cheapest(g[m]) if m in g else "" for m in METHODS]
            for (model, tau), g in groups.items()]
    return table(["model", "tau"] + [f"{name}: tokens to exact (D, N)" for name in METHODS.values()], rows)


RENDER = {"validation": ("validation.json", validation), "timing": ("timing.json", timing),
          "planner": ("planner.json", planner), "tokens_to_exact": ("efficiency.json", tokens_to_exact)}


def sync(readme: str, metrics_dir: Path) -> str:
    """``readme`` with every records block rewritten from the metrics under ``metrics_dir``. Each block of ``RENDER``
    must be there once, each opened and closed: anything else is an NVError, so a lost marker never swallows text."""
    names = [m[2] for m in BLOCK.finditer(readme)]
    if readme.count(OPEN) != len(names) or readme.count(CLOSE) != len(names):
        raise NVError(f"README: {readme.count(OPEN)} '{OPEN}NAME -->' markers, {readme.count(CLOSE)} '{CLOSE}', "
                      f"{len(names)} blocks: every block needs both")
    if sorted(names) != sorted(RENDER):
        raise NVError(f"README: records blocks {sorted(names)}, expected each of {sorted(RENDER)} once")

    def block(m: re.Match) -> str:
        file, render = RENDER[m[2]]
        try:
            metrics = json.loads((metrics_dir / file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise NVError(f"{metrics_dir / file}: cannot read the metrics ({exc})") from exc
        return m[1] + render(metrics) + m[4]
    return BLOCK.sub(block, readme)


def main(argv: list[str] | None = None) -> int:
    """``python -m nv.records [--check]``: 0 written or in sync, 1 stale (``--check``), 2 a broken README or metrics."""
    parser = argparse.ArgumentParser(description="Write (or --check) the README's tables of the committed run from metrics/.")
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--metrics", type=Path, default=Path("metrics"))
    parser.add_argument("--check", action="store_true", help="exit 1 if the README differs from what metrics/ gives")
    args = parser.parse_args(argv)

    def work() -> int:
        old = args.readme.read_text()
        new = sync(old, args.metrics)
        if args.check:
            stale = [m[2] for m, n in zip(BLOCK.finditer(old), BLOCK.finditer(new)) if m[0] != n[0]]
            if stale:
                print(f"{args.readme}: records blocks not what {args.metrics}/ holds: {', '.join(stale)} "
                      f"(python -m nv.records)", file=sys.stderr)
            return 1 if stale else 0
        args.readme.write_text(new)
        return 0
    return run_main(work)


if __name__ == "__main__":
    sys.exit(main())
