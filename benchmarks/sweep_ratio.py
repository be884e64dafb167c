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
ratios, or with --true-sweep by their own (an oracle, for diagnosis). --resweep tries what an attacker could do instead:
a second sweep placed by the first one's attacker-side per-layer parameter count (``nv.phase2.prefill``: P_ne_hat /
L_hat = 2 d (d + d_kv + 1.5 d_ffn), the sum Eq. 11 needs), then the fits again on it. --interleave loads every
model and times all their lengths in one random order (``nv.phase2.protocol.collect_interleaved``): a drift of the
machine then falls on references and target alike, where one model after another puts it on whichever was timed
during it. Every sweep prints a speed probe of the machine before and after it (``_common.speed_probe``).
Checkpointed per length under --work: a rerun resumes. A measurement, not a speed bound: it wants an otherwise idle
machine.

Run: python benchmarks/sweep_ratio.py [--ratios 0.1 0.3] [--trials 5] [--models embedded qwen2.5-coder-0.5b]
[--shape D L KV FFN ...] [--all-lengths] [--true-sweep | --resweep] [--interleave] [--work DIR] [--json F]
(not in ``make bench``: ~50 minutes here at the defaults, ~25 at --ratios 0.1 --all-lengths with two --shape)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np

from nv.models.loading import load_model, release_memory
from nv.params import load_params
from nv.phase2.evaluation import evaluate, regime
from nv.phase2.platforms import (TimedModel, at_true_shape, platform_oracle, reference_model, run_key, time_platform,
                                 timing_record)
from nv.phase2.protocol import TimingJob, collect_interleaved
from nv.phase2.prefill import calibrate, non_embedding_hat, non_embedding_params

from _common import shape_references, speed_probe

ROOT = Path(__file__).resolve().parent.parent


def kept_lengths(model: TimedModel, r: float, args, timing: dict) -> np.ndarray:
    """The lengths ``model`` is timed at: its sweep's kept ones at ratio ``r`` (all with --all-lengths)."""
    return np.sort(model.lengths(r, timing["n_lengths"], timing["discard"] + 2))[0 if args.all_lengths else timing["discard"]:]


def inprocess_cfg(r: float, args, timing: dict) -> dict:
    """The in-process platform's settings with ratio ``r`` and --trials."""
    return {**timing["platforms"]["inprocess"], "r": r, "trials": args.trials}


def time_kept(model: TimedModel, r: float, args, params, tag: str = "") -> dict:
    """``model`` timed in process at its ``kept_lengths``: its record."""
    timing = params["timing"]
    lengths, cfg = kept_lengths(model, r, args, timing), inprocess_cfg(r, args, timing)
    probe, start = speed_probe(), time.perf_counter()
    record = time_platform(model, "inprocess", cfg, lengths, timing, params["seed"],
                           Path(args.work) / f"sweep-{model.name}-r{r}{tag}.jsonl", progress=False)
    seconds, record["speed_probe_ms"] = time.perf_counter() - start, [1e3 * probe, 1e3 * speed_probe()]
    print(f"r {r:<4} {model.name:<22} ell {int(lengths.min())}-{int(lengths.max())}  T {min(record['T']):.3f}-{max(record['T']):.3f} s"
          f"  ({seconds:.0f} s; speed probe {record['speed_probe_ms'][0]:.1f} -> {record['speed_probe_ms'][1]:.1f} ms)", flush=True)
    return record


def time_interleaved(models: list[TimedModel], r: float, args, params) -> list[dict]:
    """``models`` timed in process as ``time_kept`` does, but together: every model's lengths in one seeded random
    order (``collect_interleaved``), so a drift of the machine falls on references and targets alike. Their records."""
    timing = params["timing"]
    lengths, cfg = [kept_lengths(m, r, args, timing) for m in models], inprocess_cfg(r, args, timing)
    probe, start = speed_probe(), time.perf_counter()
    with ExitStack() as stack:
        jobs = [TimingJob(stack.enter_context(platform_oracle("inprocess", m, cfg["threads"], int(ell.max()) + 256,
                                                              params["seed"])),
                          ell, Path(args.work) / f"sweep-{m.name}-r{r}-interleaved.jsonl", run_key(m, "inprocess", cfg))
                for m, ell in zip(models, lengths)]
        rows = collect_interleaved(jobs, args.trials, timing["warmups"], params["seed"])
    records = [timing_record(m, "inprocess", cfg, ell, x, timing["trim"]) for m, ell, x in zip(models, lengths, rows)]
    seconds, probes = time.perf_counter() - start, [1e3 * probe, 1e3 * speed_probe()]
    for m, ell, x in zip(models, lengths, records):
        x["speed_probe_ms"] = probes
        print(f"r {r:<4} {m.name:<22} ell {int(ell.min())}-{int(ell.max())}  T {min(x['T']):.3f}-{max(x['T']):.3f} s", flush=True)
    print(f"r {r:<4} interleaved: {seconds:.0f} s; speed probe {probes[0]:.1f} -> {probes[1]:.1f} ms", flush=True)
    return records


def replaced(model: TimedModel, record: dict, cal, L_hat: float, discard: int, kv_ratio: float) -> TimedModel:
    """The target re-placed by its first sweep: d_kv at the default ratio, d_ffn such that d + d_kv + 1.5 d_ffn =
    P_ne_hat / (2 d L_hat), with P_ne_hat from ``nv.phase2.prefill.non_embedding_hat`` given L_hat (attacker-side)."""
    d = model.d_used
    per_layer = non_embedding_hat(cal, *regime(record, discard), d, L_hat) / L_hat
    d_kv = kv_ratio * d
    d_ffn = (per_layer / (2 * d) - d - d_kv) / 1.5
    if not d_ffn > 0:
        raise SystemExit(f"{model.name}: per-layer P_ne_hat = {per_layer:.3g} leaves no MLP width to place a sweep")
    return TimedModel(model.name, "target", model.lm, d, d_kv, d_ffn, model.p_max, model.gguf)


def resweep(recs: list[dict], targets: dict[str, TimedModel], r: float, args, params, discard: int) -> list[dict]:
    """The references' records of ratio ``r`` and each target's second sweep, placed by ``replaced`` from its first."""
    timing = params["timing"]
    cal = calibrate([x for x in recs if x["role"] == "reference"])
    table = evaluate({"inprocess": recs}, {**timing, "discard": discard})
    table = table[table.d_source == "d_hat"]
    second = [x for x in recs if x["role"] == "reference"]
    for x, row in zip(recs, table.itertuples()):
        if x["role"] != "target":
            continue
        if not np.isfinite(row.L_hat):
            raise SystemExit(f"{x['model']}: the first sweep gave no L_hat to place a second one")
        first = targets[x["model"]]
        again = replaced(first, x, cal, row.L_hat, discard, timing["kv_ratio"])
        true_sum = x["d"] * (1 + x["n_kv_heads"] / x["n_heads"]) + 1.5 * x["d_ffn"]
        print(f"r {r:<4} {x['model']:<22} Eq. 11's d + d_kv + 1.5 d_ffn: first sweep "
              f"{first.d_used + first.d_kv_used + 1.5 * first.d_ffn_used:.0f}, re-placed "
              f"{again.d_used + again.d_kv_used + 1.5 * again.d_ffn_used:.0f}, true {true_sum:.0f}", flush=True)
        second.append(time_kept(again, r, args, params, tag="-resweep"))
    return second


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
    ap.add_argument("--resweep", action="store_true",
                    help="time each real model again, placed by its first sweep's attacker-side per-layer parameter count")
    ap.add_argument("--interleave", action="store_true",
                    help="load every model and time all their lengths in one random order (collect_interleaved) instead "
                         "of one model after another")
    ap.add_argument("--work", default="/tmp/nv-sweep-ratio")
    ap.add_argument("--json", help="write every record and estimate here")
    args = ap.parse_args()
    if args.resweep and args.true_sweep:
        ap.error("--resweep places the sweep from the attacker's data; --true-sweep from the truth: choose one")
    if args.interleave and args.resweep:
        ap.error("--resweep times its second sweeps after the first ones: it does not combine with --interleave")
    params = load_params(ROOT / "params.yaml", ["model", "timing", "timing_family"])
    model, timing = params["model"], params["timing"]
    base = load_model("embedded", dtype=model["dtype"], device=model["device"])
    records: dict[float | str, list[dict]] = {r: [] for r in args.ratios}
    held: list[TimedModel] = []  # --interleave: every model loaded, timed together below
    for name, entry in {**params["timing_family"], **shape_references(args.shape)}.items():
        ref = reference_model(name, entry, base, params["seed"])
        if args.interleave:
            held.append(ref)
            continue
        for r in args.ratios:  # back to back: both ratios see the machine in the same state
            records[r].append(time_kept(ref, r, args, params))
        del ref
        gc.collect()
    targets: dict[str, TimedModel] = {}
    for spec in args.models:
        lm = base if spec == "embedded" else load_model(spec, dtype=model["dtype"], device=model["device"])
        target = at_true_shape(spec, "target", lm, spec)
        if not args.true_sweep:  # the attacker's placement: d with the default ratios
            target = replace(target, d_kv_used=timing["kv_ratio"] * target.d_used, d_ffn_used=timing["ffn_ratio"] * target.d_used)
        if args.interleave:
            held.append(target)
            continue
        for r in args.ratios:
            records[r].append(time_kept(target, r, args, params))
        if args.resweep:
            targets[spec] = target
        else:
            del lm, target
            release_memory()
    for r in args.ratios if args.interleave else []:
        records[r] = time_interleaved(held, r, args, params)
    discard = timing["discard"] if args.all_lengths else 0
    if args.resweep:
        for r in args.ratios:
            records[f"{r} resweep"] = resweep(records[r], targets, r, args, params, discard)
    out = {}
    print(f"\n{'r':<5} {'model':<22} {'L':>3} {'ell_top':>7} {'attention share':>15} {'L_hat basic':>12} {'error':>7}"
          f" {'L_hat Eq. 10':>12} {'error':>7}")
    for r, recs in records.items():
        cal = calibrate([x for x in recs if x["role"] == "reference"])
        table = evaluate({"inprocess": recs}, {**timing, "discard": discard})
        table = table[table.d_source == "d_hat"]  # d_used: the references' true d, the targets' d (= d_hat)
        out[r] = {"calibration": vars(cal), "estimates": table.to_dict("records"), "records": recs}
        for x, row in zip(recs, table.itertuples()):
            top = max(x["ell"])
            quad = cal.b * x["L"] * x["d"] * top**2
            share = quad / (quad + cal.c * non_embedding_params(x) * top + cal.a)
            print(f"{r!s:<5} {x['model']:<22} {x['L']:>3} {top:7.0f} {share:15.0%} {_depth(row.L_hat, x['L'])} {_depth(row.L_hat_eq10, x['L'])}")
        refs = table[table.role == "reference"]
        print(f"{r!s:<5} references' median |error|: basic {refs.L_err.median():.0%}, Eq. 10 {refs.L_err_eq10.median():.0%}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
