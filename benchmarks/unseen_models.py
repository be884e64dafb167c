"""Phase 1 on model files it was not developed on (issue 13: "any model file outside this list must work the same
way"): random-weight LLaMA-style shapes (``nv.models.reference_family``, the embedded model's tokenizer) written as
GGUF files, each attacked by the user's own command, ``nv attack --simulate FILE.gguf``, with the default
params.yaml; then the budget planner's N for |C| >= d from a pilot inside each run's sample (``nv.phase1.planner``,
params' ``planner``), against the run's own stop. Prints per shape the stop, the common set, both estimators, the
tokens, the planner's ratio, wall time and the command's peak RSS; exits 1 when the report's estimate is wrong (a lower
bound at most d is not wrong): robust's, or the missing-data estimator's where robust is not saturated and it is
(report.json's ``estimator``; marked "(incomplete)"). The planner's factor 2 is reported MET or MISSED, not failed.

Run: python benchmarks/unseen_models.py [--shape D,L,N_KV,D_FFN ...] [--seed S] [--work DIR] (not in ``make bench``:
~4-7 min, ~3.5 GB of memory and ~2 GB of disk a shape here). The weights are drawn with --seed (default 1): the timing stages draw their
reference family with params.yaml's seed (0), so the default files hold weights no stage has seen. A shape's GGUF and
run folder (report, sample) are kept under --work; the rounds' checkpoints go once the attack has finished (an
interrupted attack resumes from them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from nv.errors import NVError, run_main
from nv.models.loading import LoadedModel, embedded_gguf, load_model
from nv.models.reference_family import Shape, random_llama, shape_from_entry, write_gguf
from nv.params import load_params
from nv.phase1.planner import fit, pilot_of
from nv.phase1.spectrum import d_interval

from _common import GIB, verdict

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ["384,12,2,1024", "512,16,2,1408", "640,20,2,1728"]  # the shapes of params.yaml's llama.cpp references


def shape_entry(spec: str) -> dict:
    """``d,L,n_kv_heads,d_ffn`` as a family entry (``nv.models.reference_family.shape_from_entry``)."""
    try:
        return dict(zip(("d", "L", "n_kv_heads", "d_ffn"), (int(x) for x in spec.split(",")), strict=True))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is four integers d,L,n_kv_heads,d_ffn, got {spec!r}") from None


def model_file(shape: Shape, seed: int, work: Path, embedded: LoadedModel) -> Path:
    """The GGUF of one random-weight shape (``embedded``'s tokenizer), written once under ``work``."""
    path = work / f"random-{shape.d}x{shape.L}-kv{shape.n_kv_heads}-ffn{shape.d_ffn}-seed{seed}.gguf"
    if not path.is_file():
        write_gguf(random_llama(shape, embedded.tokenizer, "float32", seed, path.stem), embedded_gguf(), path)
    return path


def attack(path: Path, out: Path) -> tuple[dict, float, float]:
    """``nv attack --simulate path`` as a user runs it: its report, wall seconds and peak RSS (GiB, from wait4)."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "nv.cli", "attack", "--simulate", str(path), "--out", str(out), "--quiet"],
                             cwd=ROOT)  # the default params.yaml
    _, status, usage = os.wait4(child.pid, 0)  # reaped here, so tell Popen
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise NVError(f"nv attack on {path.name} failed with exit {child.returncode} (its message above)")
    shutil.rmtree(out / ".checkpoints", ignore_errors=True)  # the rounds: as large again as the sample
    return json.loads((out / "report.json").read_text()), time.perf_counter() - t0, usage.ru_maxrss * 1024 / GIB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", type=shape_entry, help="d,L,n_kv_heads,d_ffn (repeatable; default: the three of SHAPES)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random weights (default 1; the timing family's is 0)")
    ap.add_argument("--work", default="/tmp/nv-unseen")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["planner"])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    wrong = []
    embedded = load_model(dtype="float32")  # the tokenizer and vocabulary of the random shapes
    shapes = [shape_from_entry(e, embedded.arch.vocab_size, embedded.arch.max_positions)  # every shape checked first
              for e in args.shape or [shape_entry(s) for s in SHAPES]]
    print(f"{'shape':<22} {'stop N':>9} {'common set':>13} {'d_hat (d)':>12} {'paper (snapped)':>16} {'tokens':>8} "
          f"{'planner N (stop/it)':>21} {'wall':>7} {'RSS':>8}", flush=True)
    for shape in shapes:
        path = model_file(shape, args.seed, work, embedded)
        report, wall, rss = attack(path, work / path.stem)
        d = report["d_true"]  # the file's header
        lo, hi = d_interval(report["d_hat_raw"], report["lower_bound"])
        said = str(report["d_hat_raw"]) if report["saturated"] else f"d >= {report['lower_bound']}"
        said += "" if report["estimator"] == "robust" else " (incomplete)"  # pipeline.metrics: its answer where robust has none
        if not lo <= d <= hi:
            wrong.append(f"{path.name}: {report['estimator']} says {said} for d = {d}")
        planner = params["planner"]
        pilot = pilot_of(work / path.stem / "samples", planner["pilot_prompts"], planner["pilot_N"], params["seed"])
        N_for_d = fit(pilot, planner["min_seen"]).samples_for(d, report["D"])
        ratio = report["N"] / N_for_d if N_for_d and report["adaptive_stop"] == "stable" else None  # a stop, not a cap
        plan = "-" if ratio is None else f"{N_for_d:.2g} ({ratio:.2f}x {'MET' if 0.5 <= ratio <= 2 else 'MISSED'})"
        paper = f"{report['d_hat_paper_raw']} ({report['d_hat_paper']})" if report["d_hat_paper_raw"] else report["paper_reason"]
        print(f"{path.stem[7:]:<22} {report['N']:>9,} {report['D_prime']:>6,} x {report['common_set_size']:<6,} "
              f"{said + f' ({d})':>12} {paper:>16} {report['tokens']:>8.2g} {plan:>21} "
              f"{wall / 60:>5.1f} m {rss:>6.2f} G", flush=True)
    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(run_main(main))
