"""Budget sweep (§5.2, Fig. val_plot): d_hat at growing budgets of the same prompts (each an exact N-call sample
thinned from the stored draws, independently of the others: nested in distribution, not draw by draw).

N of the N_max calls of every prompt (hypergeometric thinning of the shards on disk, ``thinned_folder``),
pruned to the common set and given to every estimator (``estimate_all``: robust and paper on the common set, the
missing-data one on the frequent tokens' observed entries). Only the columns the estimators read are loaded
(``common_set_of``), so no budget, the largest included, holds a whole sample (peak memory: README, validation
profile). Each row carries the detector's interval (``nv.phase1.spectrum.d_interval``):
``[d_hat_raw - tol, d_hat_raw + tol]`` with ``tol = max(3, 0.5 % of d_hat_raw)`` when saturated, ``[lower bound, inf)``
when not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from nv.errors import NVError
from nv.phase1.pipeline import common_set_of, estimate_all
from nv.phase1.sampling import manifest, thinned_folder
from nv.phase1.spectrum import SpectrumEstimate, d_interval, snap


def budget_sweep(folder: str | Path, budgets: list[int], spectrum: dict, seed: int, d_true: int | None,
                 ) -> tuple[pd.DataFrame, dict[str, SpectrumEstimate]]:
    """One row per (budget N, estimator) of the sample in the sampling folder ``folder``, one budget in memory at a
    time; also the estimates at the smallest budget (for its figure). Budgets above the sample's own N (an adaptive
    run that stopped early) are left out, as in the exactness grid. ``d_true`` (white-box knowledge) is used for
    ``rel_error`` and ``covered`` only."""
    N_all = manifest(folder)["N"]
    kept = sorted(N for N in budgets if N <= N_all)
    if not kept:
        raise NVError(f"every sweep budget {sorted(budgets)} is above the sample's N = {N_all:,}: lower sweep.budgets")
    if len(kept) < len(budgets):  # said, not silent: a reader of the table would take them for missing rows
        print(f"budget sweep: {', '.join(f'{N:,}' for N in sorted(set(budgets) - set(kept)))} left out, above the sample's "
              f"N = {N_all:,}", file=sys.stderr)
    rows, smallest = [], None
    for N in kept:
        with thinned_folder(folder, N, seed) as at:
            cs, sub = common_set_of(at, spectrum["incomplete"]["frac"])
        estimates = estimate_all(sub, cs.Y, spectrum, seed)
        smallest = smallest or estimates
        for method, e in estimates.items():
            raw = e.d_hat_raw
            lo, hi = d_interval(raw, e.lower_bound)
            rows.append({"N": N, "tokens": sub.tokens(), "calls": sub.calls(), "D_prime": cs.Y.shape[0], "C": cs.Y.shape[1],
                         "method": method, "reason": e.reason, "d_hat_raw": raw, "d_hat": e.d_hat, "g": e.g,
                         "d_hat_g64": raw and snap(raw, 64), "d_hat_g128": raw and snap(raw, 128),
                         "lower_bound": e.lower_bound, "d_lo": lo, "d_hi": hi,
                         "rel_error": None if raw is None or not d_true else abs(raw - d_true) / d_true,
                         "covered": None if not d_true else bool(lo <= d_true <= hi)})
        del sub  # freed before the next budget's thinning
    return pd.DataFrame(rows), smallest

