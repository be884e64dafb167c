"""Where phase 1 becomes exact (nv.phase1.exactness, nv.plots.exactness) on the synthetic toy LM of known rank
(tests/synthetic.py): the grid is nested in D and N, the outcome labels follow the estimates, and the cheapest
exact cell is the cheapest of the exact ones. The stage itself runs in tests/test_pipeline.py."""

from __future__ import annotations

import gc
import math
import tempfile
import weakref

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex

from nv.errors import NVError
from nv.phase1 import exactness, pipeline
from nv.phase1.adaptive import next_budget, stopped
from nv.phase1.exactness import (GRID_COLUMNS, OUTCOMES, adaptive_replay, adaptive_replays, adaptive_stop, cheapest_exact,
                                 edge_ratio, first, grid, noise_edge, outcome, threshold)
from nv.phase1.pipeline import common_set, estimate_all, estimate_on
from nv.phase1.sampling import collect, load_samples, save_samples, thin
from nv.phase1.spectrum import SpectrumEstimate, centred_singular_values, snap
from nv.phase1.sweep import budget_sweep
from nv.plots import save
from nv.plots.exactness import MARKERS, OUTCOME_COLORS
from nv.plots.exactness import grid as grid_figure
from nv.plots.exactness import threshold as threshold_figure
from synthetic import LowRankOracle

SPECTRUM = {"robust": {"g": 8, "z_min": 8.0, "min_ratio": 1.05},
            "paper": {"p": 0.54, "g": 8, "w": None, "w_s": None, "lam_sad": np.pi, "lam_peak": np.pi / 2},
            "incomplete": {"frac": 0.6, "rungs": [0.8, 0.9], "tol": 0.005, "max_iters": 300}}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("toy")
    oracle = LowRankOracle()
    folder = collect(oracle, [f"prompt {q}" for q in range(80)], 16_000, 2.0, 0, tmp / "s", 300, tmp / "ck", {"m": "toy"}, 40,
                     False)
    return oracle, load_samples(folder), folder


def test_outcome_labels():
    def est(method, raw, lb):
        return SpectrumEstimate(method, raw is not None, raw, raw, 8, lb, "ok" if raw else "not saturated")

    assert outcome(est("robust", 576, None), 576) == "exact"
    assert outcome(est("robust", 578, None), 576) == "exact"  # within max(3, 0.5 %)
    assert outcome(est("robust", 600, None), 576) == "wrong"
    assert outcome(est("robust", 1530, None), 1536) == "exact"  # 0.5 % of d above 600
    assert outcome(est("robust", None, 500), 576) == "not saturated"
    assert outcome(est("robust", None, 600), 576) == "wrong"  # a lower bound above the truth is a wrong answer
    assert outcome(est("paper", None, None), 576) == "no estimate"


def test_grid_is_nested_and_finds_the_rank(toy):
    oracle, S, folder = toy
    table = grid(folder, [20, 80, 500], [100, 16_000, 10**6], SPECTRUM, 0, oracle.rank, "toy", progress=False)
    assert set(table.D) == {20, 80} and set(table.N) == {100, 16_000}  # values above the sample's own are left out
    assert len(table) == 2 * 2 * 3 and set(table.method) == {"robust", "paper", "incomplete"}
    big = table[(table.D == 80) & (table.N == 16_000)].set_index("method")
    assert big.loc["robust", "d_hat_raw"] == oracle.rank and big.loc["robust", "outcome"] == "exact"
    assert big.loc["robust", "tokens"] == S.tokens() and big.loc["robust", "calls"] == 80 * 16_000
    # a cell is the first D prompts of the first N calls: the same common set as building it by hand
    cell = table[(table.D == 20) & (table.N == 100)].set_index("method").loc["robust"]
    cs = common_set(first(S.subsample(100, 0), 20))
    assert (cell.D_prime, cell.C) == cs.Y.shape and cell.lower_bound == estimate_on(cs.Y, "robust", SPECTRUM["robust"]).lower_bound
    assert cell.tokens == (5 + 1) * 20 * 100
    # first(S, D) is S's first D rows, as views of S's arrays where they are most of them (no copy of a multi-GB sample)
    head = first(S, 60)
    assert (head.counts != S.counts[:60]).nnz == 0 and (head.logprobs != S.logprobs[:60]).nnz == 0
    assert np.shares_memory(head.counts.data, S.counts.data) and np.shares_memory(head.logprobs.indices, S.logprobs.indices)
    head = first(S, 20)
    assert (head.counts != S.counts[:20]).nnz == 0 and (head.logprobs != S.logprobs[:20]).nnz == 0
    assert set(table.outcome) <= set(OUTCOMES)


def test_a_grid_reads_the_budget_sweeps_cells_of_all_prompts(toy, tmp_path, monkeypatch):
    """The budget sweep of the same draws is the grid's column of all D prompts (the same thinning and estimators):
    read from its CSV, the table is the one computed, to the byte, whatever the folder's shards (no scratch folder
    left); a sweep of other draws is refused."""
    oracle, S, folder = toy
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # thinned_folder's scratch folders go here
    fresh = grid(folder, [40, 80], [1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False)
    budget_sweep(folder, [1000, 16_000], SPECTRUM, 0, oracle.rank)[0].to_csv(tmp_path / "sweep.csv", index=False)
    swept = pd.read_csv(tmp_path / "sweep.csv")
    read = grid(folder, [40, 80], [1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False, sweep=swept)
    assert read.to_csv(index=False) == fresh.to_csv(index=False)
    resharded = save_samples(S, tmp_path / "samples", chunk=7)  # each N thinned shard by shard: the same cells
    assert grid(resharded, [40, 80], [1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False,
                sweep=swept).to_csv(index=False) == fresh.to_csv(index=False)
    assert not any(scratch.iterdir())
    marked = grid(folder, [40, 80], [1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False,
                  sweep=swept.assign(reason="from the sweep"))
    assert set(marked[marked.D == 80].reason) == {"from the sweep"} and "from the sweep" not in set(marked[marked.D == 40].reason)
    other = budget_sweep(save_samples(first(S, 40), tmp_path / "other"), [1000], SPECTRUM, 0, oracle.rank)[0]
    with pytest.raises(NVError, match="not of these draws: at N = 1,000"):
        grid(folder, [80], [1000], SPECTRUM, 0, oracle.rank, "toy", progress=False, sweep=other)


def test_cheapest_exact_is_the_cheapest_exact_cell(toy, tmp_path):
    oracle, S, folder = toy
    table = grid(folder, [10, 40, 80], [60, 1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False)
    best = cheapest_exact(table).set_index("method")
    # the honesty check: neither the robust nor the missing-data estimator is wrong in any cell (each group counts it)
    assert best.loc[["robust", "incomplete"], "wrong_cells"].tolist() == [0, 0]
    assert best.cells.tolist() == [9, 9, 9] and best.loc["paper", "wrong_cells"] == (table[table.method == "paper"].outcome == "wrong").sum()
    robust = table[table.method == "robust"]
    exact = robust[robust.outcome == "exact"]
    assert not exact.empty and best.loc["robust", "tokens"] == exact.tokens.min()
    assert (robust[robust.N == 60].outcome != "exact").all()  # 60 draws of 300 tokens share no common set of 12
    cheapest = exact[exact.tokens == exact.tokens.min()].iloc[0]
    dearer = robust[(robust.D >= cheapest.D) & (robust.N >= cheapest.N)]
    assert best.loc["robust", "stays_exact"] is bool((dearer.outcome == "exact").all())
    # and a group whose dearer cell is not exact: the cheapest exact point is flagged as a lucky draw
    flipped = table.copy()
    flipped.loc[(flipped.method == "robust") & (flipped.D == 80) & (flipped.N == 16_000), "outcome"] = "not saturated"
    lucky = cheapest_exact(flipped).set_index("method").loc["robust"]
    assert (lucky.D, lucky.N) != (80, 16_000) and lucky.stays_exact is False
    # a group with no exact cell: no cost, its best lower bound instead
    none = cheapest_exact(table[table.N == 60]).set_index("method")
    assert np.isnan(none.loc["robust", "tokens"]) and none.loc["robust", "best_lower_bound"] == robust[robust.N == 60].lower_bound.max()
    # a panel where no cell has an estimate (an all-None column, as a stage's grid at a hopeless temperature)
    hopeless = grid(folder, [10, 40], [60], SPECTRUM, 0, oracle.rank, "toy", progress=False).assign(temperature=1.0)
    fig = grid_figure(pd.concat([table, hopeless]), (20_000, 10**6))
    drawn = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert sorted(drawn) == sorted([f"toy, tau = {S.temperature:g}, true d = {oracle.rank}", f"toy, tau = 1, true d = {oracle.rank}"])
    for title, cells in ((f"toy, tau = {S.temperature:g}, true d = {oracle.rank}", table), (f"toy, tau = 1, true d = {oracle.rank}", hopeless)):
        ax = drawn[title]
        for method in ("robust", "paper", "incomplete"):  # each cell in its outcome's colour, what it said beneath it
            rows = cells[cells.method == method]
            (dots,) = [c for c in ax.collections if len(c.get_offsets()) == len(rows) and c.get_sizes()[0] == 70
                       and np.allclose(c.get_offsets()[:, 1], rows.D)
                       and np.allclose(c.get_offsets()[:, 0], rows.N * MARKERS[method][0])]
            assert [to_hex(c) for c in dots.get_facecolors()] == [to_hex(OUTCOME_COLORS[o]) for o in rows.outcome]
        texts = [t.get_text() for t in ax.texts]
        said = cells[cells.method != "paper"]  # the robust and missing-data estimators' lower bounds
        assert sum(t.count("≥") for t in texts) == said.d_hat_raw.isna().sum()
        lines = sorted("/".join(f"{r.d_hat_raw:.0f}" if pd.notna(r.d_hat_raw) else f"≥{r.lower_bound:.0f}"
                                  if pd.notna(r.lower_bound) else "-" for r in [cell[cell.method == m].iloc[0] for m in
                                                                                 ("robust", "paper", "incomplete")])
                       for _, cell in cells.groupby(["N", "D"]))
        assert sorted(t for t in texts if t.count("/") == 2) == lines  # one line a cell: left to right, as its markers
    # the corner lists each estimator's cheapest exact cell with its cost and raw answer (the paper estimator's also as
    # Alg. 2 snaps it), and none in the hopeless panel; the paper's own budget is the star's label
    corner = [t.get_text() for t in drawn[f"toy, tau = {S.temperature:g}, true d = {oracle.rank}"].texts
              if t.get_text().startswith("cheapest exact")]
    b = best.loc["robust"]
    raw = table[(table.method == "robust") & (table.D == b.D) & (table.N == b.N)].d_hat_raw.iloc[0]
    assert len(corner) == 1 and f"robust: {b.tokens:.2g} tokens at {b.D:,.0f} x {b.N:.3g}, raw {raw:.0f}\n" in corner[0] + "\n"
    assert any(t.get_text().startswith("paper's budget: ") for t in drawn[f"toy, tau = 1, true d = {oracle.rank}"].texts)
    assert [t.get_text() for t in drawn[f"toy, tau = 1, true d = {oracle.rank}"].texts if t.get_text().startswith("cheapest")] \
        == ["cheapest exact (ringed):\nnone on this grid"]
    # the toy's paper estimator is exact nowhere: given the robust one's answers, its line says what Alg. 2 reports
    as_paper = pd.concat([table[table.method == "robust"], table[table.method == "robust"].assign(method="paper")])
    snapped = [t.get_text() for t in grid_figure(as_paper, None, None, paper_g=8).axes[0].texts if t.get_text().startswith("cheapest")]
    raw = table[(table.method == "robust") & (table.D == b.D) & (table.N == b.N)].d_hat_raw.iloc[0]
    assert f"paper: {b.tokens:.2g} tokens at {b.D:,.0f} x {b.N:.3g}, raw {raw:.0f} (Alg. 2 reports {snap(int(raw), 8)})" in snapped[0]
    assert "Alg. 2" not in snapped[0].split("paper: ")[0]  # the robust estimator's line is its raw answer alone
    assert save(fig, tmp_path / "grid.png").stat().st_size > 20_000


def test_threshold_brackets_the_exact_cells_by_their_edge_ratio(toy, tmp_path):
    oracle, S, folder = toy
    assert edge_ratio(100, 100) == 25.0 and np.isclose(edge_ratio(400, 100), 400 * 100 / 30**2)
    table = grid(folder, [10, 20, 40, 80], [60, 300, 1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False)
    assert np.allclose(table.R, edge_ratio(table.D_prime, table.C))
    robust = table[table.method == "robust"]
    exact = robust.outcome == "exact"
    limits = threshold(table).set_index("model").loc["toy"]
    assert limits.cells == len(robust) and limits.exact_cells == exact.sum() >= 2 and (~exact).any()
    assert (limits.R_max_not_exact, limits.R_min_exact) == (robust.R[~exact].max(), robust.R[exact].min())
    assert limits.separates == (robust.R[~exact].max() < robust.R[exact].min())
    # an exact cell of the largest R relabelled: the outcome is no longer a function of R, and the table says so
    overlap = table.copy()
    overlap.loc[robust.R[exact].idxmax(), "outcome"] = "not saturated"
    assert threshold(overlap).separates.tolist() == [False]
    for t in (table, overlap):
        assert save(threshold_figure(t, threshold(t)), tmp_path / "threshold.png").stat().st_size > 20_000


def test_noise_edge_tops_the_noise_outside_the_signal_directions():
    """Rank-d signal with per-row offsets plus i.i.d. noise of scale sigma_e: the row-centred spectrum's noise part
    tops out at noise_edge (d and the offset's direction removed), not at the full block's edge."""
    rng = np.random.default_rng(0)
    D_prime, C, d, sigma_e = 500, 300, 150, 0.05
    Y = (10 * rng.standard_normal((D_prime, d)) @ rng.standard_normal((d, C)) / np.sqrt(d)
         + 5 * rng.standard_normal((D_prime, 1)) + sigma_e * rng.standard_normal((D_prime, C)))
    sigma, _ = centred_singular_values(Y)
    edge = noise_edge(sigma_e, D_prime, C, d)
    assert sigma[d - 1] > 10 * edge and 0.95 < sigma[d] / edge < 1.02
    assert sigma[d] < 0.8 * sigma_e * (np.sqrt(D_prime) + np.sqrt(C))


def test_adaptive_replay_stops_at_the_first_stable_round(toy, tmp_path):
    """The adaptive loop's rounds and stop rule on the stored nested draws: the first round that meets the rule, with
    the true rank, found searching down from the stored N; every round below it fails the rule (checked here on all
    of them, not only those the search assessed); the schedule's rounds up to the stored N, which is no round where
    it is off the loop's grid."""
    oracle, S, folder = toy
    sampling = {"N0": 250, "N_max": 10**6, "growth": 2.0}
    rounds, why = adaptive_replay(folder, sampling, SPECTRUM["robust"], 0)
    assert why == "stable" and rounds[-1].d_hat_raw == oracle.rank and rounds[-1].N < S.N
    assert [r.round for r in rounds] == list(range(rounds[0].round, rounds[-1].round + 1)) and len(rounds) >= 3
    # the loop's path: x2 up to the first saturated round (which here fails its check), then sqrt(2) larger
    assert rounds[0].N == 250 * 2**rounds[0].round and not rounds[0].saturated
    assert all(b.N == next_budget(a.N, a.saturated, sampling["N_max"]) for a, b in zip(rounds, rounds[1:]))
    assert rounds[-2].saturated and rounds[-1].check_N == rounds[-2].N
    assert rounds[-1].tokens == S.subsample(rounds[-1].N, 0).tokens() and rounds[-1].calls == S.D * rounds[-1].N
    for N in [250 * 2**k for k in range(rounds[0].round + 1)] + [r.N for r in rounds]:
        est = estimate_on(common_set(S.subsample(N, 0)).Y, "robust", SPECTRUM["robust"])
        check = estimate_on(common_set(S.subsample(N, 0).subsample(int(N / math.sqrt(2)), 0)).Y, "robust", SPECTRUM["robust"])
        assert stopped(est, check) == (N == rounds[-1].N), N
        assert est.saturated == (N > rounds[0].N), N  # the first saturated round is the path's second
        assessed = next((r for r in rounds if r.N == N), None)
        if assessed:
            assert (assessed.saturated, assessed.d_hat_raw) == (est.saturated, est.d_hat_raw)
            assert assessed.check_d_hat_raw == (check.d_hat_raw if est.saturated else None)  # the round's own thinning
    # the search ends at an unsaturated round; draws that run out first: the last round is the stored N (here
    # unsaturated); none at all below N_0
    assert not rounds[0].saturated
    capped, why = adaptive_replay(thin(folder, tmp_path / "capped", rounds[0].N, 0), sampling, SPECTRUM["robust"], 0)
    assert why == "stored draws" and capped == rounds[:1]
    # stored draws between two of the loop's rounds: the loop's next round is beyond them, whatever they would say
    off_grid, why = adaptive_replay(thin(folder, tmp_path / "off", int(1.9 * rounds[0].N), 0), sampling, SPECTRUM["robust"], 0)
    assert why == "stored draws" and [r.N for r in off_grid] == [rounds[0].N]
    assert adaptive_replay(thin(folder, tmp_path / "few", 100, 0), sampling, SPECTRUM["robust"], 0) == ([], "stored draws")
    assert adaptive_replays(folder, sampling, SPECTRUM["robust"], 0, {}) == {}  # no view to replay (the defences stage's
    # when no setting saturates at the stored N)
    # the figure marks the stop (and draws a model without one)
    last = rounds[-1]
    stops = pd.DataFrame([{"model": "toy", "temperature": S.temperature, "stop": "stable", "N": last.N, "d_hat_raw": last.d_hat_raw,
                           "lower_bound": last.lower_bound}, {"model": "other", "temperature": 1.0, "stop": "stored draws",
                           "N": None, "d_hat_raw": None, "lower_bound": None}])
    table = grid(folder, [40, 80], [1000, 16_000], SPECTRUM, 0, oracle.rank, "toy", progress=False)
    assert save(grid_figure(table, None, stops), tmp_path / "grid.png").stat().st_size > 20_000


def test_adaptive_stop_reads_the_loops_own_record(toy, tmp_path):
    """Draws the adaptive loop sampled carry its rounds in their manifest: those are the stop, not a replay (a replay
    of these draws would stop stable at a smaller N); draws of a fixed N are replayed."""
    oracle, S, folder = toy
    sampling = {"N0": 250, "N_max": 10**6, "growth": 2.0}
    replayed, why = adaptive_replay(folder, sampling, SPECTRUM["robust"], 0)
    assert adaptive_stop(folder, sampling, SPECTRUM["robust"], 0) == ([vars(r) for r in replayed], why)
    record = [{"round": 0, "N": S.N, "d_hat_raw": oracle.rank, "lower_bound": None}]
    looped = save_samples(S, tmp_path / "looped", {"adaptive": record, "stop": "N_max"})
    assert adaptive_stop(looped, sampling, SPECTRUM["robust"], 0) == (record, "N_max")


def test_budget_sweep_leaves_out_budgets_above_the_sample(toy, capsys):
    """An adaptive sample that stopped below a sweep budget: the sweep keeps the budgets it has and names those it left
    out (silently, until a review), and says so when none."""
    oracle, S, folder = toy
    table, _ = budget_sweep(folder, [1000, 16_000, 10**6], SPECTRUM, 0, oracle.rank)
    assert sorted(set(table.N)) == [1000, 16_000]
    assert "budget sweep: 1,000,000 left out, above the sample's N = 16,000" in capsys.readouterr().err
    with pytest.raises(NVError, match="above the sample's N = 16,000"):
        budget_sweep(folder, [10**6], SPECTRUM, 0, oracle.rank)


def test_sweep_and_replay_thin_from_disk_and_read_columns_only(toy, tmp_path, monkeypatch):
    """Every budget of the sweep and every round of the adaptive replay (and its check) is thinned shard by shard from
    disk (the rng carried across shards of 7 prompts) and only the columns the estimators read are loaded, the full N
    included (a whole read held 11.6 GB on the 1.5B): the same rows as each thinning estimated in memory by hand, no
    whole read, no scratch folder left."""
    oracle, S, _ = toy
    folder = save_samples(S, tmp_path / "samples", chunk=7)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # thinned_folder's scratch folders go here
    budgets = [1000, 4000, S.N]
    columns_read = []

    def spy(f, columns=None):
        columns_read.append(columns)
        return load_samples(f, columns)

    monkeypatch.setattr(pipeline, "load_samples", spy)
    monkeypatch.setattr(exactness, "load_samples", spy)
    table = budget_sweep(folder, budgets, SPECTRUM, 0, oracle.rank)[0]
    for N in budgets:
        sub = S.subsample(N, 0)
        cs = common_set(sub)
        by_hand = estimate_all(sub, cs.Y, SPECTRUM, 0)
        rows = table[table.N == N].set_index("method")
        assert set(rows.index) == set(by_hand) and (rows.D_prime.iloc[0], rows.C.iloc[0]) == cs.Y.shape
        assert (rows.tokens == sub.tokens()).all() and (rows.calls == sub.calls()).all()
        for method, e in by_hand.items():
            said = [None if pd.isna(rows.loc[method, k]) else int(rows.loc[method, k]) for k in ("d_hat_raw", "lower_bound")]
            assert said == [e.d_hat_raw, e.lower_bound], (N, method)
    assert len(columns_read) == len(budgets) and all(c is not None for c in columns_read)  # never a whole read
    columns_read.clear()
    rounds, why = adaptive_replay(folder, {"N0": 250, "N_max": 10**6, "growth": 2.0}, SPECTRUM["robust"], 0)
    assert why == "stable" and rounds[-1].d_hat_raw == oracle.rank
    assert len(columns_read) >= len(rounds) + 1 and all(c is not None for c in columns_read)  # rounds and checks
    assert not any(scratch.iterdir())
    with pytest.raises(NVError, match="above the sample's N = 16,000"):
        budget_sweep(folder, [10**6], SPECTRUM, 0, oracle.rank)


def test_the_report_drops_its_sample_with_its_return(toy, tmp_path, monkeypatch):
    """``estimate_and_report`` draws the spectrum figure, whose log axes leave matplotlib reference cycles through the
    frames up to the report's own: the sample it read back outlived the report until a full collection (the 1.5B's
    phase-1 stage held its 4.8 GB through the budget sweep: 16.2 GB). With the automatic collector off, the sample
    must be gone when the report returns."""
    oracle, S, _ = toy
    folder = save_samples(S, tmp_path / "samples", chunk=7)
    loaded = []

    def spy(f, columns=None):
        sample = load_samples(f, columns)
        loaded.append(weakref.ref(sample.logprobs))
        return sample

    monkeypatch.setattr(pipeline, "load_samples", spy)
    spectrum = {**SPECTRUM, "method": "robust"}
    enabled = gc.isenabled()
    gc.disable()
    try:
        record = pipeline.estimate_and_report(folder, spectrum, "toy", oracle.rank, {"tokens": 0, "calls": 0}, {},
                                              tmp_path, 0, progress=False)
        assert record["d_hat_raw"] == oracle.rank and len(loaded) == 1 and loaded[0]() is None
    finally:
        if enabled:
            gc.enable()


def test_a_grid_above_the_sample_is_empty_and_the_stage_says_so(toy):
    """D or N values all above a sample's own: no cell for that model (an empty table with the grid's columns, not a
    crash), and no cell for any model is a one-line error naming the params to lower (a KeyError before)."""
    _, S, folder = toy
    for D_values, N_values in (([S.D + 1], [300]), ([10], [S.N + 1])):
        empty = grid(folder, D_values, N_values, SPECTRUM, 0, 8, "toy", progress=False)
        assert empty.empty and list(empty.columns) == GRID_COLUMNS
    with pytest.raises(NVError, match="no cell of the .D, N. grid fits a sample.*exactness.D_values or N_values"):
        cheapest_exact(pd.concat([empty, empty], ignore_index=True))
