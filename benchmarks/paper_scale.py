"""Phase 1 at the paper's scale on this CPU (issue 14): D = 20,000 prompts x N = 10^6 samples at tau = 2 on the
embedded model through the simulator, then greedy pruning and both estimators. Prints the wall time and peak
memory of each step, the common set and d_hat of each estimator; exits 1 when a bound is missed (15 min, 8 GiB) or
the robust estimator gives a wrong number (a lower bound below 576 is not wrong).

Run: python benchmarks/paper_scale.py [--D 20000] [--N 1000000] [--work DIR] (not in ``make bench``). The prompts are
D random 5-character prompts (seeded), not the prompt search's: the search would add ~2 forward passes per kept prompt
in float32 and is timed by the prompt_search stage. The draws go to shards under --work (~12 bytes per observed entry,
~9 GB here) and are reused by a rerun (time the first run). Y_hat is then read from them streamed: greedy pruning
(Alg. 1 line 6) runs on the observation mask alone (``observed_mask``, 5 bytes per entry), and only the common set's
columns are read with their log-probs, so memory never holds the ~8·10^8 observed entries with their values.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from nv.oracle import Simulator
from nv.phase1.exactness import outcome
from nv.phase1.pipeline import common_set, estimate_both
from nv.phase1.prune import greedy_prune
from nv.phase1.sampling import collect, load_samples, observed_mask
from nv.phase1.search import random_prompts
from nv.params import load_params

from _common import peak_rss, reset_peak_rss

ROOT = Path(__file__).resolve().parent.parent
PEAKS: list[float] = []  # each step's peak RSS (GiB): the run's peak is their maximum


def step(name: str, fn, *args, **kw):
    """Run one step; print its wall time and the process's peak RSS during it."""
    reset_peak_rss()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    PEAKS.append(peak_rss())
    print(f"{name:<28} {time.perf_counter() - t0:8.1f} s   peak RSS {PEAKS[-1]:6.2f} GiB", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--D", type=int, default=20_000)
    ap.add_argument("--N", type=int, default=1_000_000)
    ap.add_argument("--work", default="/tmp/nv-paper-scale")
    args = ap.parse_args()
    start = time.perf_counter()
    params = load_params(ROOT / "params.yaml", ["model", "spectrum"])
    seed, tau = params["seed"], 2.0
    prompts = random_prompts(np.random.default_rng(seed), args.D, 5)
    sim = step("load the model", Simulator.from_params, params["model"])
    folder = step(f"sample {args.D:,} x {args.N:,}", collect, sim, prompts, args.N, tau, seed, Path(args.work) / "samples",
                  sim.vocab_size, checkpoint_root=Path(args.work) / "checkpoints", identity={"bench": "paper_scale"}, chunk=500)
    mask = step("observation mask (streamed)", observed_mask, folder)
    print(f"  observed entries {mask.nnz:,}, distinct tokens per prompt median {int(np.median(np.diff(mask.indptr))):,}",
          flush=True)
    pruned = step("greedy pruning (mask)", greedy_prune, mask)
    del mask
    columns = np.zeros(sim.vocab_size, dtype=bool)
    columns[pruned.cols] = True
    S = step("load Y_hat (common columns)", load_samples, folder, columns)
    print(f"  tokens (§5) {S.tokens():.3g}, calls {S.calls():.3g}", flush=True)
    cs = step("common set Y", common_set, S, pruned)
    print(f"  common set D' x |C| = {cs.Y.shape[0]:,} x {cs.Y.shape[1]:,}", flush=True)
    del S
    estimates = step("both estimators", estimate_both, cs.Y, params["spectrum"])
    d_true = sim.lm.arch.d
    for method, e in estimates.items():
        said = f"d_hat_raw = {e.d_hat_raw}" if e.d_hat_raw is not None else f"{e.reason}" + (
            f", d >= {e.lower_bound}" if e.lower_bound is not None else "")
        print(f"  {method:<7} {said} (true d = {d_true})")
    wall, peak = time.perf_counter() - start, max(PEAKS)
    print(f"total {wall / 60:.1f} min (bound 15), peak RSS {peak:.2f} GiB (bound 8)")
    failed = [why for why, bad in (("the robust estimate is wrong", outcome(estimates["robust"], d_true) == "wrong"),
                                   ("over 15 min", wall > 15 * 60), ("over 8 GiB", peak > 8)) if bad]
    print("FAILED: " + "; ".join(failed) if failed else "within both bounds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
