"""The rounding floor as the attacker sees it (issue 14: could a detector that knows the floor stop earlier?): the
bf16 grid the served log-probs lie on, read from the common set's own entries, gives the rounding error's sigma_e and
the Marchenko-Pastur edge of i.i.d. noise of that scale in the complement of the d signal directions
(``nv.phase1.exactness.noise_edge``, the true d, evaluation only; an estimator would solve for it). Prints, per
budget N, sigma_e, the singular values sigma_i of the row-centred Y near i = d over that edge, the top of the noise
bulk (beyond d + 24) over it, and the robust estimate; exits 1 if the robust estimator is wrong. The white-box view of
the same floor is ``noise_floor.py``.

The grid: a logit rounded to a floating format lies on a grid whose spacing depends on its binade, and within one
prompt y_i - y_top lies on entry i's own grid (the top token's is the coarsest where logits are positive), scaled by
1 / tau for processed log-probs. With p_k the share of those differences within 1 % of the grid 2^-k / tau (chance
hits removed) and w_j the share of entries whose own grid is 2^-j / tau, p_k = sum_{j <= k} w_j + sum_{j > k} w_j
2^(k - j), so 2 p_k - p_{k+1} = sum_{j <= k} w_j, and the uniform rounding error has sigma_e^2 = sum_j w_j
(2^-j / tau)^2 / 12.

Run: python benchmarks/rounding_floor.py [--samples DIR] [--d D] [--N N ...] (not in ``make bench``: a measurement,
~1.5 min and ~3 GB on the embedded model's adaptive sample, thinned with params.yaml's seed). Measured: see "Where phase
1 becomes exact" in the README.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from nv.errors import run_main
from nv.params import load_params
from nv.phase1.exactness import edge_ratio, noise_edge, outcome
from nv.phase1.pipeline import common_set, estimate_on
from nv.phase1.prune import greedy_prune
from nv.phase1.sampling import load_samples
from nv.phase1.spectrum import centred_singular_values

from _common import verdict

ROOT = Path(__file__).resolve().parent.parent


def grid_sigma(Y: np.ndarray, tau: float, k_max: int = 12, tol: float = 0.01) -> tuple[float, dict[float, float]]:
    """sigma_e of the rounding error of Y's entries and the share of entries on each grid (module docstring)."""
    x = (Y - Y.max(axis=1, keepdims=True)).ravel()
    x = x[x != 0]
    spacing = 2.0 ** -np.arange(k_max + 2) / tau
    p = np.empty(spacing.size)
    for i, h in enumerate(spacing):  # one grid at a time: a (entries x grids) array would hold GBs
        r = x / h
        p[i] = np.mean(np.abs(r - np.round(r)) < tol)
    p = np.clip((p - 2 * tol) / (1 - 2 * tol), 0.0, 1.0)
    share = np.diff(np.maximum.accumulate(np.clip(2 * p[:-1] - p[1:], 0.0, 1.0)), prepend=0.0)
    sigma_e = float(np.sqrt(np.sum(share * spacing[:-1] ** 2) / 12))
    return sigma_e, {float(h): float(w) for h, w in zip(spacing[:-1], share) if w >= 0.01}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default=str(ROOT / "outputs" / "sampling" / "samples"))
    ap.add_argument("--d", type=int, default=576, help="the true d, to judge the estimates (default: the embedded model's)")
    ap.add_argument("--N", type=int, nargs="+", default=[100_000, 160_000, 226_274, 320_000],
                    help="budgets to thin to (default: the adaptive rounds and checks around SmolLM2's stop)")
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", ["spectrum"])
    S = load_samples(args.samples)
    d, wrong = args.d, []
    print(f"{S.D:,} prompts, tau = {S.temperature:g}; true d = {d}; sigma_i / edge at i = {d - 4} .. {d + 2}")
    for N in args.N:
        T = S.subsample(N, params["seed"])  # one line if N is past the sample's own
        Y = common_set(T, greedy_prune(T.counts)).Y
        del T
        sigma_e, shares = grid_sigma(Y, S.temperature)
        Dp, C = Y.shape
        e = estimate_on(Y, "robust", params["spectrum"]["robust"])
        said = f"d_hat_raw = {e.d_hat_raw}" if e.saturated else f"not saturated, d >= {e.lower_bound}"
        grids = ", ".join(f"{h:g}: {w:.0%}" for h, w in shares.items())
        if min(Dp, C - 1) > d + 2:
            sigma, _ = centred_singular_values(Y)
            ratio = sigma / noise_edge(sigma_e, Dp, C, d)
            bulk = f"{ratio[d + 24:].max():.3f}" if ratio.size > d + 24 else "-"
            near = f"{' '.join(f'{v:.3f}' for v in ratio[d - 5:d + 2])}; bulk top {bulk}"
        else:
            near = "the block is not larger than d"
        print(f"N = {N:,}: {Dp:,} x {C:,}, R = {float(edge_ratio(Dp, C)):.0f}, sigma_e = {sigma_e:.5f} (grids {grids}); "
              f"{near}; robust {said}", flush=True)
        if outcome(e, d) == "wrong":
            wrong.append(f"N = {N}: {said}")
    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(run_main(main))
