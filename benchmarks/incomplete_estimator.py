"""The missing-data estimator against the robust one on the same draws (issue 14, item 3 and the 3x token target):
per budget N (the sample thinned with params.yaml's seed, nested as the budget sweep) and number of prompts D (the
first D, nested as the exactness grid), the common block and the robust estimate on it, then ``nv.phase1.incomplete`` on every observed entry of the tokens >= 60 % of the prompts
drew, anchored at the common block's Gavish-Donoho count; with its rungs (k, d_hat_raw, drop z and ratio, EM sweeps),
the §5 tokens, the missing-data estimate's time and the budget's peak memory. Exits 1 if either estimator is
saturated with a value more than max(3, 0.5 % of d) off, or gives a lower bound above d (issue 14's honesty bound).

Run: python benchmarks/incomplete_estimator.py [--samples DIR] [--d D] [--N N ...] [--D D ...] [--anchor A] [--out DIR] (not in ``make bench``:
a measurement; ~9 min a budget alone and ~4 GiB at N = 10^5 on the embedded model's 3,000 prompts, measured while
the EM still ran in float64: its ladder there took 26 s against 57 s since, README). ``--samples``: any
sampling folder, e.g. ``nv attack --simulate embedded``'s OUT/samples, or the sampling stage's (the default).
Measured: see "Where phase 1 becomes exact" in the README.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from nv.errors import run_main
from nv.params import load_params
from nv.phase1 import incomplete
from nv.phase1.exactness import edge_ratio, first, outcome
from nv.phase1.pipeline import common_set, estimate_on
from nv.phase1.sampling import load_samples

from _common import peak_rss, reset_peak_rss, verdict

ROOT = Path(__file__).resolve().parent.parent


def said(e) -> str:
    return f"{e.d_hat_raw}" if e.saturated else f"not saturated, d >= {e.lower_bound}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default=str(ROOT / "outputs" / "sampling" / "samples"))
    ap.add_argument("--d", type=int, default=576,
                    help="the true d, to judge the estimates (default: the embedded model's)")
    ap.add_argument("--N", type=int, nargs="+", default=[50_000, 70_000, 100_000, 141_421],
                    help="budgets to thin to (each at most the sample's N)")
    ap.add_argument("--D", type=int, nargs="+", help="numbers of prompts, the first D (default: all of them)")
    ap.add_argument("--anchor", type=int,
                    help="probe: anchor the ladder at this count instead of the common block's Gavish-Donoho count (the "
                         "estimator never does; README: 'The anchor is what keeps it honest')")
    ap.add_argument("--out", help="folder for incomplete_estimator.json")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["spectrum"])
    spectrum = params["spectrum"]
    S = load_samples(args.samples)
    print(f"{S.D:,} prompts, N = {S.N:,}, tau = {S.temperature:g}; true d = {args.d}; spectrum.incomplete "
          f"{spectrum['incomplete']}")
    rows, wrong = [], []
    for N in args.N:
        thinned = S.subsample(N, params["seed"])  # one line if N is past the sample's own
        for D in sorted(args.D or [S.D], reverse=True):
            reset_peak_rss()
            start = time.perf_counter()
            T = first(thinned, min(D, S.D))
            Y = common_set(T).Y
            robust = estimate_on(Y, "robust", spectrum["robust"])
            t_common = time.perf_counter() - start
            anchor = incomplete.anchor(robust, Y.shape) if args.anchor is None else args.anchor
            inc = incomplete.estimate(T, anchor, **spectrum["incomplete"], **spectrum["robust"], seed=params["seed"],
                                      progress=True)
            seconds = time.perf_counter() - start - t_common
            shape = inc.diagnostics["shape"]
            row = {"N": N, "D": T.D, "tokens": T.tokens(), "common": list(Y.shape), "R_common": float(edge_ratio(*Y.shape)),
                   "robust": said(robust), "anchor": anchor, "block": list(shape),
                   "observed": inc.diagnostics["observed"],
                   "incomplete": said(inc), "rungs": [asdict(r) for r in inc.diagnostics["rungs"]],
                   "seconds": seconds, "peak_gib": peak_rss()}
            rows.append(row)
            rungs = "; ".join(f"k = {r.k}: {r.d_hat_raw if r.d_hat_raw is not None else '-'} (z {r.z:.1f}, "
                              f"ratio {r.ratio:.3f}, {r.far_drops} far drops, {r.sweeps} sweeps)" for r in inc.diagnostics["rungs"])
            print(f"N = {N:,}, D = {T.D:,} ({row['tokens']:.2e} tokens): common {Y.shape[0]:,} x {Y.shape[1]:,} "
                  f"(R = {row['R_common']:.0f}) "
                  f"robust {row['robust']}; block {shape[0]:,} x {shape[1]:,} ({row['observed']:.0%} observed) incomplete "
                  f"{row['incomplete']} [{rungs}] in {seconds:.0f} s; peak {row['peak_gib']:.2f} GiB", flush=True)
            for e in (robust, inc):
                if outcome(e, args.d) == "wrong":
                    wrong.append(f"N = {N}, D = {T.D}: {e.method} {said(e)}")
            del T, Y
        del thinned
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "incomplete_estimator.json").write_text(json.dumps(rows, indent=1) + "\n")
    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(run_main(main))
