"""Depth from the attention probe (nv.phase2.probe, issue 13) on the reference family and the real models, one platform.

Times every model of params.yaml's ``timing_family`` and the real models named by --models with the probe's protocol
(a cached context of ell_c tokens, then K timed calls that add ~60 fresh tokens each; contexts on [ell_max / 8,
ell_max]), fits each model's slope g = dT/d ell_c, calibrates b on the family and prints each reference's leave-one-out
L_hat and each real model's L_hat = g / (s b d) with its error against the issue's 10 %; with --matched, also each real
model's L_hat from references at its own d only (nv.phase2.probe.matched_references). The real models use their true
d: phase 1's snapped d_hat equals it on all three (README: validation). Checkpointed per context under --work: a
rerun resumes. A measurement, not a speed bound: it wants an otherwise idle machine, and it exits 1 only on a failed fit.

Run: python benchmarks/attention_probe.py [--models embedded qwen2.5-coder-0.5b] [--platform inprocess|llamacpp]
[--references NAME ...] [--shape D L KV FFN ...] [--head-dim 64] [--matched L ...] [--trials 10] [--ell-max 2048]
[--work DIR]
(not in ``make bench``: ~10 minutes in process here, 12 on the llama.cpp server, 22-27 there at --ell-max 4096).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from nv.models.loading import load_model, release_memory
from nv.models.reference_family import HEAD_DIM
from nv.params import load_params
from nv.phase2.platforms import TimedModel, at_true_shape, platform_oracle, reference_model
from nv.phase2.probe import calibrate_probe, depth_probe, fit_probe, leave_one_out, matched_references, measure_cached
from nv.phase2.protocol import collect_timings

from _common import shape_references

ROOT = Path(__file__).resolve().parent.parent


def probe(model: TimedModel, platform: str, contexts: np.ndarray, args, params) -> dict:
    """One model's probe on ``platform``: its facts, rows and fit."""
    cfg = params["timing"]["platforms"][platform]
    run_id = {**model.facts(), "platform": platform, "probe": True}
    checkpoint = Path(args.work) / f"probe-{model.name}-{platform}.jsonl"
    start = time.perf_counter()
    with platform_oracle(platform, model, cfg["threads"], int(contexts.max()) + 512, params["seed"], prompt_cache=True) as oracle:
        rows = collect_timings(oracle, contexts, args.trials, params["timing"]["warmups"], params["seed"], checkpoint, run_id,
                               measure=measure_cached)
    fit = fit_probe(rows)
    print(f"{model.name:<22} L {model.lm.arch.L:>3}  d {model.lm.arch.d:>5}  g {fit.g * 1e6:8.3f} us/token (se {fit.g_se * 1e6:.3f})"
          f"  t0 {fit.t0:.3f} s  s {fit.s:.0f}  g/(s L d) {fit.rate / (model.lm.arch.L * model.lm.arch.d) * 1e12:.3f} ps"
          f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return {**model.facts(), "g": fit.g, "g_se": fit.g_se, "t0": fit.t0, "s": fit.s, "rate": fit.rate,
            "rows": [r.record() for r in rows]}


def report(r: dict, L_hat: float, how: str) -> None:
    err = (L_hat - r["L"]) / r["L"]
    print(f"{r['model']:<22} {r['L']:>4} {L_hat:7.1f} {err:+8.1%}   {'MET' if abs(err) <= 0.10 else 'MISSED'} (10 %), {how}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["embedded", "qwen2.5-coder-0.5b"])
    ap.add_argument("--references", nargs="*", help="names of timing_family to time (default: all)")
    ap.add_argument("--shape", nargs=4, type=int, action="append", default=[], metavar=("D", "L", "KV", "FFN"),
                    help="one more random-weight reference of this shape (repeatable): what g depends on besides L d")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM, help="the head size of the --shape references (KV heads in these)")
    ap.add_argument("--matched", nargs="*", type=int, metavar="L",
                    help="also time references at each real model's own d of these depths (the attacker's default "
                         "KV and MLP ratios) and calibrate its b on them alone")
    ap.add_argument("--platform", default="inprocess", choices=["inprocess", "llamacpp"])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ell-max", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/nv-attention-probe")
    ap.add_argument("--json", help="write every model's rows and fit here")
    args = ap.parse_args()
    if args.matched is not None and len(set(args.matched)) < 2:
        ap.error("--matched needs at least two depths (b is a fit through their rates)")
    params = load_params(ROOT / "params.yaml", ["model", "timing", "timing_family"])
    model = params["model"]
    contexts = np.unique(np.rint(np.linspace(args.ell_max / 8, args.ell_max, 8)).astype(int))
    base = load_model("embedded", dtype=model["dtype"], device=model["device"])
    results = []
    family = params["timing_family"]
    unknown = sorted(set(args.references or []) - set(family))
    if unknown:
        ap.error(f"--references {unknown} not in params.yaml's timing_family")
    references = {name: entry for name, entry in family.items() if args.references is None or name in args.references}
    references.update(shape_references(args.shape, args.head_dim))
    for name, entry in references.items():
        results.append(probe(reference_model(name, entry, base, params["seed"]), args.platform, contexts, args, params))
        gc.collect()
    for spec in args.models:
        lm = base if spec == "embedded" else load_model(spec, dtype=model["dtype"], device=model["device"])
        a = lm.arch
        if args.matched:  # timed next to the target, so both see the machine in the same state
            for name, entry in matched_references(a.d, tuple(args.matched), params["timing"]["kv_ratio"],
                                                  params["timing"]["ffn_ratio"]).items():
                row = probe(reference_model(name, entry, base, params["seed"]), args.platform, contexts, args, params)
                results.append({**row, "role": "matched", "for": spec})
                gc.collect()
        timed = at_true_shape(spec, "target", lm, spec)
        results.append(probe(timed, args.platform, contexts, args, params))
        del lm, timed
        release_memory()
    refs = [r for r in results if r["role"] == "reference"]
    targets = [r for r in results if r["role"] == "target"]
    b = None
    if len(refs) >= 2:
        rate, L, d = (np.array([r[k] for r in refs], dtype=np.float64) for k in ("rate", "L", "d"))
        b = calibrate_probe(rate, L, d)
        print(f"\nb = {b * 1e12:.4f} ps per (new token x context token x layer x hidden unit), from {len(refs)} references")
    print(f"\n{'model':<22} {'L':>4} {'L_hat':>7} {'error':>8}")
    if b is not None:
        for r, L_hat in zip(refs, leave_one_out(rate, L, d) if len(refs) >= 3 else []):  # each needs two others
            r["L_hat"] = float(L_hat)
            print(f"{r['model']:<22} {r['L']:>4} {L_hat:7.1f} {(L_hat - r['L']) / r['L']:+8.1%}   (leave-one-out)")
        for r in targets:
            r["L_hat"] = depth_probe(r["rate"], b, r["d"])
            report(r, r["L_hat"], "the family's b")
    for r in targets if args.matched else []:
        own = [m for m in results if m["role"] == "matched" and m["for"] == r["model"]]
        rate, L, d = (np.array([m[k] for m in own], dtype=np.float64) for k in ("rate", "L", "d"))
        r["L_hat_matched"] = depth_probe(r["rate"], calibrate_probe(rate, L, d), r["d"])
        report(r, r["L_hat_matched"], f"b at its own d from {', '.join(m['model'] for m in own)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"platform": args.platform, "b": b, "contexts": contexts.tolist(),
                                               "trials": args.trials, "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
