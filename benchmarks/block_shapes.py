"""The shapes of complete block one sample offers (issue 14 item 3: "a submatrix chosen to maximise the detector's
score"): from the same draws, the greedy pruning of Alg. 1 weighed to drop rows w times as readily
(``greedy_prune(row_weight=w)``; w = 1 is the paper's rule) and a path that drops, one at a time, the prompt missing the
most nearly complete tokens (tokens missed by at most 2 % of the prompts left). Prints each block's D' x |C|, its edge
ratio R (``nv.phase1.exactness.edge_ratio``) and the robust estimate; exits 1 if the robust estimator is wrong.

Run: python benchmarks/block_shapes.py [--samples DIR] [--N N] [--d D] (not in ``make bench``: ~5 min, ~3 GB on the
embedded model's adaptive sample, thinned to --N with params.yaml's seed). Measured: see "Where phase 1 becomes
exact" in the README.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from nv.errors import run_main
from nv.params import load_params
from nv.phase1.exactness import edge_ratio, outcome
from nv.phase1.pipeline import common_set, estimate_on
from nv.phase1.prune import Pruned, greedy_prune
from nv.phase1.sampling import SampledMatrix, load_samples

from _common import verdict

ROOT = Path(__file__).resolve().parent.parent


def drop_path(S: SampledMatrix, min_rows: int, near: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """D' and |C| along the path that drops, one prompt at a time, the prompt missing the most of the tokens missed
    by at most ``near`` of the prompts left (over tokens drawn in >= 30 % of the prompts); and the order of the drops."""
    counts = S.counts.tocsc()
    cols = np.flatnonzero(np.diff(counts.indptr) >= 0.3 * S.D)
    missing = ~(S.counts[:, cols] > 0).toarray()  # D x K
    alive, col_miss = np.ones(S.D, dtype=bool), missing.sum(axis=0)
    sizes, order = [], []
    while alive.sum() >= min_rows:
        sizes.append((alive.sum(), int(np.count_nonzero(col_miss == 0))))
        cand = col_miss <= max(1, int(near * alive.sum()))
        score = missing[:, cand].sum(axis=1).astype(float)
        score[~alive] = -1
        r = int(np.argmax(score))
        alive[r] = False
        col_miss -= missing[r]
        order.append(r)
    return np.array(sizes), np.array(order)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default=str(ROOT / "outputs" / "sampling" / "samples"))
    ap.add_argument("--N", type=int, default=160_000, help="thin each prompt's draws to N (default: round 4's budget)")
    ap.add_argument("--d", type=int, default=576, help="the true d, to judge the estimates (default: the embedded model's)")
    ap.add_argument("--weights", default="0.75,0.9,1,1.05,1.1,1.25,1.5,2")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["spectrum"])
    S = load_samples(args.samples)
    S = S.subsample(args.N, params["seed"])  # one line if N is past the sample's own
    print(f"{S.D:,} prompts x N = {S.N:,}; true d = {args.d}")
    print(f"{'block':<34} {'D_prime':>8} {'C':>7} {'R':>7}  robust")
    wrong = []

    def report(name: str, pruned: Pruned) -> None:
        e = estimate_on(common_set(S, pruned).Y, "robust", params["spectrum"]["robust"])
        said = f"d_hat_raw = {e.d_hat_raw}" if e.saturated else f"not saturated, d >= {e.lower_bound}"
        print(f"{name:<34} {pruned.rows.size:>8,} {pruned.cols.size:>7,} {float(edge_ratio(pruned.rows.size, pruned.cols.size)):>7.1f}  {said}",
              flush=True)
        if outcome(e, args.d) == "wrong":
            wrong.append(f"{name}: {said}")

    for w in (float(x) for x in args.weights.split(",")):
        report(f"greedy pruning, row weight {w:g}", greedy_prune(S.counts, row_weight=w))
    sizes, order = drop_path(S, min_rows=min(1000, max(2, S.D // 3)))  # down to 1,000 prompts, a third of a smaller sample
    k = int(np.argmax(edge_ratio(sizes[:, 0], sizes[:, 1])))
    rows = np.setdiff1d(np.arange(S.D), order[:k])
    cols = np.flatnonzero(np.asarray((S.counts[rows] > 0).sum(axis=0)).ravel() == rows.size)
    report("drop path, its largest R", Pruned(rows, cols))
    print(f"  (the drop path down to {sizes[-1, 0]:,} prompts: {sizes[-1, 1]:,} complete tokens)")
    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(run_main(main))
