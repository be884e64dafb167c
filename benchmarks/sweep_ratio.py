"""Depth from the App. D prefill sweep, in process: what biases the basic estimator on a target (issue 13)?

For each crossover ratio r of --ratios (Eq. 11; the default profile's 0.1 gives sweeps of a few hundred tokens, the
paper's 0.6 would take hours here), every model of params.yaml's ``timing_family``, the random shapes of --shape and
the real models of --models are timed back to back with App. D's protocol (``collect_timings``: warm-ups, the
ell = 1 baseline, K fresh random-prefix prompts per length), at the sweep's kept lengths only (the fits drop the 12
shortest of the 24 points, ``timing.discard``) or with --all-lengths at all of them. Then
``nv.phase2.evaluation.evaluate`` holds out every model in turn, as the `timing_fit` stage does, and this prints per
r each model's basic (Eq. 9) and Eq. 10 L_hat with its error, and the share of its top length's prefill time that is
attention (b L d ell^2 of T ~ b L d ell^2 + c P_ne ell + a, ``nv.phase2.prefill.calibrate`` on the references). The
real models use their true d (phase 1's snapped d_hat equals it) and place their sweep by the attacker's default
ratios, or with --true-sweep by their own (an oracle, for diagnosis). Checkpointed per length under --work: a rerun
resumes. A measurement, not a speed bound: it wants an otherwise idle machine.

Run: python benchmarks/sweep_ratio.py [--ratios 0.1 0.3] [--trials 5] [--models embedded qwen2.5-coder-0.5b]
[--shape D L KV FFN ...] [--all-lengths] [--true-sweep] [--work DIR] [--json F]
(not in ``make bench``: ~50 minutes here at the defaults, ~25 at --ratios 0.1 --all-lengths with two --shape)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from nv.models.loading import load_model, release_memory, resolve
from nv.params import load_params
from nv.phase2.evaluation import evaluate
from nv.phase2.platforms import TimedModel, reference_model, time_platform
from nv.phase2.prefill import calibrate, non_embedding_params

from _common import shape_references

ROOT = Path(__file__).resolve().parent.parent


def time_kept(model: TimedModel, r: float, args, params) -> dict:
    """``model`` timed in process at the kept lengths of its sweep at ratio ``r`` (all with --all-lengths): its record."""
    timing = params["timing"]
    lengths = np.sort(model.lengths(r, timing["n_lengths"]))[0 if args.all_lengths else timing["discard"]:]
    cfg = {**timing["platforms"]["inprocess"], "r": r, "trials": args.trials}
    start = time.perf_counter()
    record = time_platform(model, "inprocess", cfg, lengths, timing, params["seed"],
                           Path(args.work) / f"sweep-{model.name}-r{r}.jsonl", progress=False)
    print(f"r {r:<4} {model.name:<22} ell {int(lengths.min())}-{int(lengths.max())}  T {min(record['T']):.3f}-{max(record['T']):.3f} s"
          f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return record


def _depth(L_hat: float, L: int) -> str:
    """L_hat and its signed error, or n/a where the fit gave no depth."""
    return f"{L_hat:12.1f} {(L_hat - L) / L:+7.0%}" if np.isfinite(L_hat) else f"{'n/a':>12} {'':>7}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.3])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--models", nargs="*", default=["embedded", "qwen2.5-coder-0.5b"])
    ap.add_argument("--shape", nargs=4, type=int, action="append", default=[], metavar=("D", "L", "KV", "FFN"),
                    help="one more random-weight reference of this shape (repeatable), e.g. an MLP as wide as the 0.5B's")
    ap.add_argument("--all-lengths", action="store_true", help="time all of each sweep's points (the fits still drop the shortest)")
    ap.add_argument("--true-sweep", action="store_true",
                    help="place the real models' sweeps by their true KV and MLP ratios (an oracle, for diagnosis) instead of "
                         "the attacker's defaults")
    ap.add_argument("--work", default="/tmp/nv-sweep-ratio")
    ap.add_argument("--json", help="write every record and estimate here")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["model", "timing", "timing_family"])
    model, timing = params["model"], params["timing"]
    base = load_model("embedded", dtype=model["dtype"], device=model["device"])
    records: dict[float, list[dict]] = {r: [] for r in args.ratios}
    for name, entry in {**params["timing_family"], **shape_references(args.shape)}.items():
        ref = reference_model(name, entry, base, params["seed"])
        for r in args.ratios:  # back to back: both ratios see the machine in the same state
            records[r].append(time_kept(ref, r, args, params))
        del ref
        gc.collect()
    for spec in args.models:
        lm = base if spec == "embedded" else load_model(spec, dtype=model["dtype"], device=model["device"])
        source, gguf = resolve(spec)
        a = lm.arch
        kv, ffn = (a.n_kv_heads / a.n_heads, a.d_ffn / a.d) if args.true_sweep else (timing["kv_ratio"], timing["ffn_ratio"])
        target = TimedModel(spec, "target", lm, a.d, kv * a.d, ffn * a.d, a.max_positions, Path(source) / gguf if gguf else None)
        for r in args.ratios:
            records[r].append(time_kept(target, r, args, params))
        del lm, target
        release_memory()
    out = {}
    print(f"\n{'r':<5} {'model':<22} {'L':>3} {'ell_top':>7} {'attention share':>15} {'L_hat basic':>12} {'error':>7}"
          f" {'L_hat Eq. 10':>12} {'error':>7}")
    for r, recs in records.items():
        cal = calibrate([x for x in recs if x["role"] == "reference"])
        table = evaluate({"inprocess": recs}, {**timing, "discard": timing["discard"] if args.all_lengths else 0})
        table = table[table.d_source == "d_hat"]  # d_used: the references' true d, the targets' d (= d_hat)
        out[r] = {"calibration": vars(cal), "estimates": table.to_dict("records"), "records": recs}
        for x, row in zip(recs, table.itertuples()):
            top = max(x["ell"])
            quad = cal.b * x["L"] * x["d"] * top**2
            share = quad / (quad + cal.c * non_embedding_params(x) * top + cal.a)
            print(f"{r:<5} {x['model']:<22} {x['L']:>3} {top:7.0f} {share:15.0%} {_depth(row.L_hat, x['L'])} {_depth(row.L_hat_eq10, x['L'])}")
        refs = table[table.role == "reference"]
        print(f"{r:<5} references' median |error|: basic {refs.L_err.median():.0%}, Eq. 10 {refs.L_err_eq10.median():.0%}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
