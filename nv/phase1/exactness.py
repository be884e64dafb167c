"""Where phase 1 becomes exact (issue 14): each estimator's outcome over a grid of prompts D, samples per prompt N
and sampling temperature tau, and the cheapest exact cell, in §5's token cost.

Every cell of one (model, tau) sample takes the first D prompts (nested in D) and, of each, N of its stored calls
(hypergeometric thinning of the shards on disk, ``thinned_folder``: distributed as the first N calls, each N thinned
independently, so nested in distribution, not draw by draw), as the budget sweep (§5.1) does.
The true d (white-box) only labels the outcome; the estimators never see it. ``adaptive_stop``: where the adaptive loop
(``nv.phase1.adaptive``) stops on a model's draws, from the loop's own record when they were sampled adaptively, else
replayed on the stored draws (``adaptive_replay``): its stopping point without new calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
from tqdm.auto import tqdm

from nv.errors import NVError
from nv.models.loading import release_memory
from nv.oracle import Simulator
from nv.phase1.adaptive import Round, after, assess, folder_estimate, round_estimate, schedule
from nv.phase1.pipeline import common_set, estimate_all
from nv.phase1.sampling import SampledMatrix, collect, load_samples, manifest, thinned_folder
from nv.phase1.spectrum import SpectrumEstimate, d_interval

OUTCOMES = ("exact", "not saturated", "no estimate", "wrong")


def outcome(e: SpectrumEstimate, d_true: int) -> str:
    """exact: d_hat_raw within the budget sweep's tolerance of d (``d_interval``); not saturated: the robust (or
    ``nv.phase1.incomplete``'s) estimator's lower bound, at most d; no estimate: the paper estimator found no saddle or
    peak; wrong: any other."""
    lo, hi = d_interval(e.d_hat_raw, e.lower_bound)
    if e.d_hat_raw is not None:
        return "exact" if lo <= d_true <= hi else "wrong"
    if e.method in ("robust", "incomplete"):
        return "not saturated" if lo <= d_true else "wrong"
    return "no estimate"


def edge_ratio(D_prime, C):
    """R = D' |C| / (sqrt(D') + sqrt(|C|))^2 of a D' x |C| common-set matrix Y.

    A signal direction of per-entry strength s has singular value ~ s sqrt(D' |C|) in Y; i.i.d. noise of scale sigma
    (the bf16 floor) has its top singular value at the Marchenko-Pastur edge sigma (sqrt(D') + sqrt(|C|)). R is their
    squared ratio in units of (s / sigma)^2: the tail near i = d clears the floor once R exceeds a constant of the
    model, (sigma / s_d)^2 times the detector's margin, whatever D, N and tau gave the shape (``threshold``)."""
    D_prime, C = np.asarray(D_prime, dtype=np.float64), np.asarray(C, dtype=np.float64)
    return D_prime * C / (np.sqrt(D_prime) + np.sqrt(C)) ** 2


def noise_edge(sigma_e, D_prime, C, d):
    """sigma_e (sqrt(D' - d) + sqrt(|C| - 1 - d)): the Marchenko-Pastur edge, the top singular value of i.i.d. noise of
    scale sigma_e in the row-centred D' x |C| Y outside its d signal directions (row-centring takes one more away)."""
    return sigma_e * (np.sqrt(D_prime - d) + np.sqrt(C - 1 - d))


def first(S: SampledMatrix, D: int) -> SampledMatrix:
    """The first D prompts of S (nested in D, as ``SampledMatrix.subsample`` is in N): a prefix of S's CSR arrays,
    kept as views (a 3,000 x 3·10^5 sample holds several GB) unless it is under half of them, where scipy copies it."""
    end = S.counts.indptr[D]

    def rows(m):
        return sp.csr_matrix((m.data[:end], m.indices[:end], m.indptr[: D + 1]), shape=(D, m.shape[1]), copy=False)

    return SampledMatrix(rows(S.logprobs), rows(S.counts), S.prompt_tokens[:D], S.N, S.temperature)


GRID_COLUMNS = ["model", "temperature", "D", "N", "tokens", "calls", "D_prime", "C", "R", "method", "d_hat_raw",
                "lower_bound", "reason", "outcome", "d_true"]


def grid(folder: str | Path, D_values: Iterable[int], N_values: Iterable[int], spectrum: dict, seed: int, d_true: int,
         model: str, progress: bool = True, sweep: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (N, D, estimator) of the sample in the sampling folder ``folder`` (at its temperature): the common
    set, the estimate, its outcome and the cell's cost. Values above the sample's own D or N are left out. Each N is
    thinned from the shards on disk (``thinned_folder``): only that N's sample in memory, never beside the whole one.
    ``sweep``: the budget sweep of these draws (``nv.phase1.sweep.budget_sweep``, the same spectrum and seed), whose
    rows are the cells of all D prompts at its budgets, the same thinning and estimators: read, not computed again
    (their tokens and calls checked)."""
    meta = manifest(folder)
    D_values = sorted(v for v in D_values if v <= meta["D"])
    N_values = sorted(v for v in N_values if v <= meta["N"])
    known = {} if sweep is None or meta["D"] not in D_values else dict(iter(sweep.groupby("N", sort=False)))
    rows = []
    bar = tqdm(total=len(D_values) * len(N_values), desc=f"(D, N) grid of {model} at tau = {meta['temperature']:g}",
               unit="cell", disable=not progress)
    for N in N_values:
        with thinned_folder(folder, N, seed) as at:
            thinned = load_samples(at)
        for D in D_values:
            cell = first(thinned, D)
            if D == meta["D"] and N in known:
                rows += _swept(known[N], cell, d_true, model)
                bar.update()
                continue
            cs = common_set(cell)
            rows += [_row(model, cell, cs.Y.shape, e, d_true) for e in estimate_all(cell, cs.Y, spectrum, seed).values()]
            bar.update()
        thinned = cell = None  # freed before the next N's thinning (the cells are views of it)
    bar.close()
    return pd.DataFrame(rows, columns=GRID_COLUMNS)


def _row(model: str, cell: SampledMatrix, shape: tuple[int, int], e: SpectrumEstimate, d_true: int) -> dict:
    """One grid row: the cell's cost, its common set's shape and one estimator's answer on it."""
    return {"model": model, "temperature": cell.temperature, "D": cell.D, "N": cell.N, "tokens": cell.tokens(),
            "calls": cell.calls(), "D_prime": int(shape[0]), "C": int(shape[1]), "R": float(edge_ratio(*shape)),
            "method": e.method, "d_hat_raw": e.d_hat_raw, "lower_bound": e.lower_bound, "reason": e.reason,
            "outcome": outcome(e, d_true), "d_true": d_true}


def _swept(at_N: pd.DataFrame, cell: SampledMatrix, d_true: int, model: str) -> list[dict]:
    """The budget sweep's rows at one N as the grid's rows of ``cell`` (all of the sample's prompts thinned to N)."""
    if (at_N.tokens != cell.tokens()).any() or (at_N.calls != cell.calls()).any():
        raise NVError(f"the budget sweep given to the exactness grid is not of these draws: at N = {cell.N:,} it has "
                      f"{at_N.tokens.iloc[0]:,} tokens, the draws {cell.tokens():,}")
    rows = []
    for r in at_N.to_dict("records"):
        raw, bound = (None if pd.isna(r[key]) else int(r[key]) for key in ("d_hat_raw", "lower_bound"))
        e = SpectrumEstimate(r["method"], raw is not None, raw, None, None, bound, r["reason"])
        rows.append(_row(model, cell, (r["D_prime"], r["C"]), e, d_true))
    return rows


def cheapest_exact(table: pd.DataFrame, by: tuple[str, ...] = ("model", "method", "temperature")) -> pd.DataFrame:
    """Tokens to exact: per group the cheapest exact cell, and whether every dearer cell of the group at or above
    both its D and N is exact too (``stays_exact``: the cheapest point is not a lucky draw). A group with no exact
    cell has NaN cost and its best lower bound. ``wrong_cells``: the group's cells whose answer is wrong (issue 14's
    honesty check: a saturated d_hat_raw off by more than max(3, 0.5 % of d), or a lower bound above d)."""
    if table.empty:
        raise NVError("no cell of the (D, N) grid fits a sample: every exactness.D_values or N_values is above the "
                      "samples' own D or N; lower them")
    rows = []
    for key, g in table.groupby(list(by), sort=True):
        exact = g[g.outcome == "exact"].sort_values(["tokens", "N"])
        row = dict(zip(by, key)) | {"d_true": int(g.d_true.iloc[0]), "cells": len(g),
                                    "wrong_cells": int((g.outcome == "wrong").sum())}
        if exact.empty:
            row |= {"tokens": np.nan, "calls": np.nan, "D": np.nan, "N": np.nan, "stays_exact": None,
                    "best_lower_bound": g.lower_bound.max(), "max_tokens_tried": g.tokens.max()}
        else:
            best = exact.iloc[0]
            above = g[(g.D >= best.D) & (g.N >= best.N)]
            row |= {"tokens": best.tokens, "calls": best.calls, "D": best.D, "N": best.N,
                    "stays_exact": bool((above.outcome == "exact").all()), "best_lower_bound": None,
                    "max_tokens_tried": g.tokens.max()}
        rows.append(row)
    return pd.DataFrame(rows)


def threshold(table: pd.DataFrame) -> pd.DataFrame:
    """Per model, the robust estimator's cells of every (D, N, tau) ordered by ``edge_ratio`` R: the largest R of a
    cell that is not exact and the smallest R of an exact one. ``separates``: every exact cell has the larger R, so
    the outcome is a function of R alone and the model's threshold R* lies between the two (None without both)."""
    rows = []
    for model, g in table[table.method == "robust"].groupby("model", sort=False):
        exact = g.outcome == "exact"
        below = g.R[~exact].max() if (~exact).any() else np.nan
        above = g.R[exact].min() if exact.any() else np.nan
        rows.append({"model": model, "d_true": int(g.d_true.iloc[0]), "cells": len(g), "exact_cells": int(exact.sum()),
                     "R_max_not_exact": below, "R_min_exact": above,
                     "separates": bool(below < above) if np.isfinite(below) and np.isfinite(above) else None})
    return pd.DataFrame(rows)


def adaptive_replays(folder: str | Path, sampling: dict, robust: dict, seed: int,
                     views: dict[Hashable, Callable[[SampledMatrix], np.ndarray] | None]) -> dict[Hashable, tuple[list[Round], str]]:
    """The adaptive loop (``sampling.N: auto``) replayed on the draws stored in ``folder``, once per view of them
    (draws -> the matrix Y the estimator sees; None: the common set itself; e.g. through a defence: ``nv.defences``).
    The loop replayed is the robust estimator's (``sampling.estimator: robust``; draws the loop itself sampled carry
    its own record, ``adaptive_stop``).
    Round r assesses the view of N_r calls of each prompt as the live loop does (``assess``; each round's thinning is
    an exact N_r-call sample, but drawn independently of the other rounds', where the live loop's rounds are nested:
    each round's outcome is distributed as the loop's, their joint law is not), its check the view of those calls
    thinned to N_r / sqrt(2); both are thinned from disk (``_assess_at``), and views at the same N share the
    thinning. The rounds are the loop's: growth x up to the first saturated one (``schedule`` to N_max, those up to
    the stored N: a stored N off that grid is no round of the loop's), then as the loop picks them (``after``).

    Searched down from the stored N for the first saturated round: the growth rounds are assessed from the top while
    saturated; taking every round below an unsaturated one as unsaturated too (more calls per prompt only grow the
    common set: in expectation, not draw by draw between independent thinnings), the lowest of that saturated run is
    where the loop first saturates, found without thinning the rounds below it. From there the loop is followed
    forward, round by round, until its rule holds. Per view: the rounds on the loop's path from the last unsaturated
    one (ascending) and why it stopped, "stable", "N_max", or "stored draws" when its next round is beyond the stored
    N (the live loop would go on; no round at all when that N < N_0)."""
    N0, N_max, growth = sampling["N0"], sampling["N_max"], sampling["growth"]
    N_all = manifest(folder)["N"]
    plan = [n for n in schedule(N0, N_max, growth) if n <= N_all]
    down = {key: [] for key in views}  # the growth rounds assessed and whether each met the rule, top down
    path, ahead, why = {}, {}, {}

    def step(key: Hashable, done: Round, stable: bool) -> None:
        """A round on the loop's path: stop there, or note the next round to assess."""
        path[key].append(done)
        nxt = after(done, stable, N_max, growth)
        if nxt is None or nxt > N_all:
            why[key] = "stable" if stable else "N_max" if nxt is None else "stored draws"
        else:
            ahead[key] = (done.round + 1, nxt)

    with tqdm(desc="adaptive replay", unit="round", disable=len(views) == 1) as bar:
        active = list(views)
        for r in range(len(plan) - 1, -1, -1):
            if not active:
                break
            for key, (done, stable) in _assess_at(folder, plan[r], {key: views[key] for key in active},
                                                  dict.fromkeys(active, r), robust, seed).items():
                down[key].insert(0, (done, stable))
                if not done.saturated:
                    active.remove(key)
            bar.update()
        for key, assessed in down.items():
            path[key] = [done for done, _ in assessed if not done.saturated][-1:]  # the last unsaturated round, if any
            first = next(((done, stable) for done, stable in assessed if done.saturated), None)
            if first is None:
                why[key] = "N_max" if plan and plan[-1] == N_max else "stored draws"
            else:
                step(key, *first)
        while ahead:  # the loop forward from its first saturated round, views at the same N together
            N = min(n for _, n in ahead.values())
            at_N = {key: r for key, (r, n) in ahead.items() if n == N}
            for key in at_N:
                del ahead[key]
            for key, (done, stable) in _assess_at(folder, N, {key: views[key] for key in at_N}, at_N, robust, seed).items():
                step(key, done, stable)
            bar.update()
    return {key: (path[key], why[key]) for key in views}


def _assess_at(folder: str | Path, N: int, views: dict[Hashable, Callable[[SampledMatrix], np.ndarray] | None],
               rounds: dict[Hashable, int], robust: dict, seed: int) -> dict[Hashable, tuple[Round, bool]]:
    """``assess`` of every view at the first N calls of the draws in ``folder`` (as round ``rounds[key]``): the round
    thinned from disk (``thinned_folder``), its check thinned from that, so that no sample is held beside its thinning."""
    with thinned_folder(folder, N, seed) as at:
        found, budget = _estimated(at, views, robust, seed)
        saturated = {key: views[key] for key, (est, _) in found.items() if est.saturated}
        checks = {}

        def check(key: Hashable, n: int) -> SpectrumEstimate:
            if n not in checks:
                with thinned_folder(at, n, seed) as sub:
                    checks[n] = _estimated(sub, saturated, robust, seed)[0]
            return checks[n][key][0]

        return {key: assess(rounds[key], *found[key], budget, partial(check, key)) for key in views}


def _estimated(folder: Path, views: dict[Hashable, Callable[[SampledMatrix], np.ndarray] | None], robust: dict,
               seed: int) -> tuple[dict[Hashable, tuple[SpectrumEstimate, tuple[int, int]]], dict]:
    """``round_estimate`` of each view of the draws in ``folder``, and their cost: the view None is the robust loop's
    own round (``folder_estimate``: the common set's columns only), the others share the whole sample, read once."""
    found, whole, read = {}, None, None
    for key, view in views.items():
        if view is None:
            est, shape, read = folder_estimate(folder, robust, None, seed)
            found[key] = est, shape
        else:
            if whole is None:
                whole = read = load_samples(folder)
            found[key] = round_estimate(view(whole), robust)
    return found, read.budget()


def adaptive_replay(folder: str | Path, sampling: dict, robust: dict, seed: int) -> tuple[list[Round], str]:
    """``adaptive_replays`` of the draws as they are: the rounds and why they stopped."""
    return adaptive_replays(folder, sampling, robust, seed, {None: None})[None]


def adaptive_stop(folder: str | Path, sampling: dict, robust: dict, seed: int) -> tuple[list[dict], str]:
    """Where ``sampling.N: auto`` stops on the draws in ``folder``: the rounds and stop its manifest records when the
    loop itself sampled them (the sampling stage at N: auto, same params), else ``adaptive_replay``."""
    meta = manifest(folder)
    if "adaptive" in meta:
        return meta["adaptive"], meta["stop"]
    rounds, why = adaptive_replay(folder, sampling, robust, seed)
    return [asdict(r) for r in rounds], why


def run_grids(runs: list, model: dict, sampling: dict, spectrum: dict, exactness: dict, seed: int,
              root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The exactness stage over every real model's phase-1 run (``nv.outputs.phase1_runs``): ``grid`` at each
    temperature (each N thinned from disk, never beside the whole sample; at sampling.temperature the run's own draws
    and its budget sweep's cells), and where ``sampling.N: auto`` stops on those draws (``adaptive_stop``). Draws at
    another temperature are collected first under ``root``/.cache, with the model loaded once, and it is freed before
    any grid (peak memory). Returns the grid table and the stops (one row per run; ints kept beside a null)."""
    tables, stops = [], []
    for run in runs:
        spec, d_true = run.spec, run.d_true
        folders, oracle = {}, None
        for tau in exactness["temperatures" if run.item is None else "validation_temperatures"]:
            if tau == sampling["temperature"]:
                folders[tau] = run.samples
                continue
            oracle = oracle or Simulator.from_params({**model, "spec": spec})
            prompts = json.loads(run.prompts.read_text())[: max(exactness["D_values"])]
            folders[tau] = collect(oracle, prompts, max(exactness["N_values"]), tau, seed,
                                   root / ".cache" / "exactness" / f"{spec}-tau-{tau:g}", oracle.vocab_size,
                                   checkpoint_root=root / ".cache" / "checkpoints", identity={"model": {**model, "spec": spec}},
                                   chunk=sampling["chunk"])
        del oracle
        release_memory()
        for tau, folder in folders.items():
            swept = pd.read_csv(run.sweep) if tau == sampling["temperature"] else None  # its cells of all the prompts
            tables.append(grid(folder, exactness["D_values"], exactness["N_values"], spectrum, seed, d_true, spec, sweep=swept))
            if tau == sampling["temperature"]:
                rounds, why = adaptive_stop(folder, sampling, spectrum["robust"], seed)
                last = {k: rounds[-1][k] if rounds else None for k in ("N", "tokens", "calls", "d_hat_raw", "lower_bound")}
                stops.append({"model": spec, "temperature": tau, "d_true": d_true, "stop": why,
                              "rounds": rounds[-1]["round"] + 1 if rounds else 0} | last)
    return pd.concat(tables, ignore_index=True), pd.DataFrame(stops, dtype=object)
