"""Phase 1 at the paper's scale on this CPU (issue 14): D = 20,000 prompts x N = 10^6 samples at tau = 2 on the
embedded model through the simulator, then greedy pruning and both estimators. Prints the wall time and peak
memory of each step, the common set and d_hat of each estimator.

Not in ``make bench`` (it takes about an hour here). Run: python benchmarks/paper_scale.py [--D 20000] [--N 1000000]
[--work DIR]. The prompts are D random 5-character prompts (seeded), not the prompt search's: the search would add
~2 forward passes per kept prompt in float32 (about an hour here) and is timed by the prompt_search stage. The
draws go to shards under --work (~12 bytes per observed entry) and are reused by a rerun. Exits 1 when the robust
estimator gives a wrong number (a lower bound below 576 is not wrong).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench_phase1_algos import _peak_rss, _reset_peak_rss
from nv.oracle import Simulator
from nv.phase1.exactness import outcome
from nv.phase1.pipeline import common_set, estimate_both
from nv.phase1.sampling import collect, load_samples
from nv.phase1.search import random_prompts
from nv.params import load_params

ROOT = Path(__file__).resolve().parent.parent


def step(name: str, fn, *args, **kw):
    """Run one step; print its wall time and the process's peak RSS during it."""
    _reset_peak_rss()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    print(f"{name:<28} {time.perf_counter() - t0:8.1f} s   peak RSS {_peak_rss():6.2f} GiB", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--D", type=int, default=20_000)
    ap.add_argument("--N", type=int, default=1_000_000)
    ap.add_argument("--work", default="/tmp/nv-paper-scale")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["model", "spectrum"])
    seed, tau = params["seed"], 2.0
    prompts = random_prompts(np.random.default_rng(seed), args.D, 5)
    sim = step("load the model", Simulator.from_params, params["model"])
    folder = step(f"sample {args.D:,} x {args.N:,}", collect, sim, prompts, args.N, tau, seed, Path(args.work) / "samples",
                  sim.vocab_size, checkpoint_root=Path(args.work) / "checkpoints", identity={"bench": "paper_scale"}, chunk=500)
    S = step("load Y_hat", load_samples, folder)
    print(f"  observed entries {S.counts.nnz:,}, distinct tokens per prompt median {int(np.median(np.diff(S.counts.indptr))):,}, "
          f"tokens (§5) {S.tokens():.3g}", flush=True)
    cs = step("greedy pruning", common_set, S)
    print(f"  common set D' x |C| = {cs.Y.shape[0]:,} x {cs.Y.shape[1]:,}", flush=True)
    del S
    estimates = step("both estimators", estimate_both, cs.Y, params["spectrum"])
    d_true = sim.lm.arch.d
    for method, e in estimates.items():
        said = f"d_hat_raw = {e.d_hat_raw}" if e.d_hat_raw is not None else f"{e.reason}" + (
            f", d >= {e.lower_bound}" if e.lower_bound is not None else "")
        print(f"  {method:<7} {said} (true d = {d_true})")
    return 1 if outcome(estimates["robust"], d_true) == "wrong" else 0


if __name__ == "__main__":
    sys.exit(main())
