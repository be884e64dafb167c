"""Adaptive sampling (nv.phase1.adaptive, sampling.N: auto) on a synthetic toy LM whose rank is known
(tests/synthetic.py): the loop stops at the first round where the stop rule holds, with the right d; it reports
not saturated when N_max is too small; a rerun draws nothing twice; on the simulator (the real embedded model) the
rounds share one forward pass per batch. The live-endpoint resume is tested in tests/test_live_endpoint.py."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from nv.errors import NVError
from nv.oracle import Simulator
from nv.oracle.defence import Defence, DefendedOracle
from nv.phase1.adaptive import folder_estimate, merge, next_budget, round_seed, sample_adaptive, schedule, stopped
from nv.phase1.pipeline import common_set
from nv.phase1.sampling import SampledMatrix, collect, iter_shards, load_samples, save_samples, write_samples
from nv.phase1.spectrum import estimate
from synthetic import LogProbOracle, LowRankOracle, incomplete_logprobs

ROBUST = {"g": 8, "z_min": 8.0, "min_ratio": 1.05}
PROMPTS = [f"prompt {q}" for q in range(80)]


def test_schedule_grows_geometrically_to_n_max():
    assert schedule(1000, 10_000) == [1000, 2000, 4000, 8000, 10_000]
    assert schedule(1000, 1000) == [1000]
    assert schedule(100, 1000, 1.5)[:4] == [100, 150, 225, 338]
    for bad in ((0, 10, 2.0), (20, 10, 2.0), (10, 100, 1.0)):
        with pytest.raises(NVError, match="adaptive sampling needs"):
            schedule(*bad)
    # a growth barely above 1: a round per call (10^6 of them, planned by the dry run in a hang), refused in one line
    with pytest.raises(NVError, match=r"sampling.growth = 1.0000001 takes more than 64 rounds .* at least 1.07"):
        schedule(10_000, 10**6, 1.0000001)
    rounds, N = [1], 1  # the rounds counted independently: ceil(1.4 N) from 1, capped at 10^9
    while N < 10**9:
        N = min(10**9, math.ceil(1.4 * N))
        rounds.append(N)
    assert schedule(1, 10**9, 1.4) == rounds and len(rounds) <= 64  # within MAX_ROUNDS: a plan, not refused
    assert next_budget(225, False, sys.maxsize, 1.5) == 338  # the "next round would cost" line past N_max: no limit there


def test_a_saturated_round_that_fails_its_check_is_followed_by_one_sqrt2_larger():
    """Its successor's check (N / sqrt 2, thinned) is then that round's own budget, already found saturated."""
    assert next_budget(1000, False, 10**6) == 2000 and next_budget(1000, True, 10**6) == 1415
    assert int(next_budget(320_000, True, 10**6) / math.sqrt(2)) == 320_000
    assert next_budget(1000, True, 10**6, growth=1.2) == 1200  # a growth below sqrt 2 stays
    assert next_budget(900_000, True, 10**6) == next_budget(900_000, False, 10**6) == 10**6


def test_merged_rounds_are_one_nested_sample(tmp_path):
    oracle = LowRankOracle()
    parts = []
    for r, n in enumerate((300, 700)):
        collect(oracle, PROMPTS[:10], n, 2.0, round_seed(0, r), tmp_path / f"r{r}", 300, tmp_path / "ck", {"m": "toy"}, 5, False)
        parts.append(load_samples(tmp_path / f"r{r}"))
    merged = load_samples(merge(tmp_path / "r0", tmp_path / "r1", tmp_path / "m"))
    assert merged.N == 1000 and np.array_equal(np.asarray(merged.counts.sum(axis=1)).ravel(), np.full(10, 1000))
    assert not list(tmp_path.glob("*.partial"))
    # a token seen in both rounds keeps its (exact) log-prob; the union of the columns is kept
    for q in range(10):
        cols = set(parts[0].counts[q].indices) | set(parts[1].counts[q].indices)
        assert set(merged.counts[q].indices) == cols
    both = parts[0].logprobs.multiply(parts[1].counts > 0)
    np.testing.assert_array_equal(merged.logprobs.multiply(both != 0).data, both.data)
    # shards of 3 rows against 5, either way round (the merged folder takes the second's): the same matrix, bit for bit
    by3 = save_samples(parts[1], tmp_path / "r1-by-3", chunk=3)
    for a, b in ((tmp_path / "r0", by3), (save_samples(parts[0], tmp_path / "r0-by-3", chunk=3), tmp_path / "r1")):
        out = merge(a, b, tmp_path / "blocked")
        assert json.loads((out / "manifest.json").read_text())["chunk"] == json.loads((b / "manifest.json").read_text())["chunk"]
        blocked = load_samples(out)
        for x, y in ((blocked.counts, merged.counts), (blocked.logprobs, merged.logprobs)):
            assert x.dtype == y.dtype and all(np.array_equal(getattr(x, k), getattr(y, k)) for k in ("data", "indices", "indptr"))
        assert np.array_equal(blocked.prompt_tokens, merged.prompt_tokens)
    # a noisy oracle's values: each entry is the count-weighted mean of the rounds' values
    parts[1].logprobs.data += np.linspace(0.0, 1.0, parts[1].logprobs.nnz, dtype=np.float32)
    noisy = load_samples(merge(tmp_path / "r0", save_samples(parts[1], tmp_path / "noisy", chunk=4), tmp_path / "m2"))
    (la, ca), (lb, cb) = ((P.logprobs.toarray().astype(np.float64), P.counts.toarray()) for P in parts)
    seen = (ca + cb) > 0
    mean = (la * ca + lb * cb)[seen] / (ca + cb)[seen]
    np.testing.assert_array_equal(noisy.counts.toarray()[seen], (ca + cb)[seen])
    np.testing.assert_allclose(noisy.logprobs.toarray()[seen], mean, rtol=1e-6)
    short = save_samples(SampledMatrix(parts[0].logprobs[:9], parts[0].counts[:9], parts[0].prompt_tokens[:9], 300, 2.0),
                         tmp_path / "short")
    with pytest.raises(NVError, match="cannot merge"):
        merge(short, tmp_path / "r1", tmp_path / "m3")
    # a log-prob of exactly 0 (a token of probability 1 in float32) is merged like any other
    lp = parts[1].logprobs
    zero = sp.csr_matrix((np.zeros_like(lp.data), lp.indices, lp.indptr), shape=lp.shape)
    certain = save_samples(SampledMatrix(zero, parts[1].counts, parts[1].prompt_tokens, 700, 2.0), tmp_path / "certain")
    sure = load_samples(merge(tmp_path / "r0", certain, tmp_path / "m5"))
    only_second = (cb > 0) & (ca == 0)
    assert (sure.counts != merged.counts).nnz == 0 and only_second.any()
    np.testing.assert_array_equal(sure.logprobs.toarray()[only_second], 0.0)
    np.testing.assert_allclose(sure.logprobs.toarray()[seen], (la * ca)[seen] / (ca + cb)[seen], rtol=1e-6)
    # a write stopped part-way (Ctrl-C, a full disk) or given rows that do not make up the sample leaves no folder that
    # passes for a merged one, nor the part written
    rows = iter_shards(tmp_path / "r1")[1]

    def cut():
        yield next(rows)
        raise KeyboardInterrupt

    meta = {"N": 700, "temperature": 2.0, "chunk": 5, "D": 10, "vocab_size": 300}
    with pytest.raises(KeyboardInterrupt):
        write_samples(tmp_path / "m4", meta, cut())
    with pytest.raises(NVError, match="blocks end at row 5, not at its D = 10"):
        write_samples(tmp_path / "m4", meta, iter([next(iter_shards(tmp_path / "r1")[1])]))
    with pytest.raises(NVError, match="block at row 0 is not 5 rows"):
        write_samples(tmp_path / "m4", meta, iter_shards(tmp_path / "r1", 3)[1])
    assert not (tmp_path / "m4").exists() and not (tmp_path / "m4.partial").exists()
    assert round_seed(0, 0) != round_seed(0, 1) and round_seed(0, 1) == round_seed(0, 1)


def test_the_loop_stops_at_the_first_stable_round_with_the_true_rank(tmp_path):
    oracle = LowRankOracle()
    sampling = {"N0": 250, "N_max": 64_000, "growth": 2.0, "temperature": 2.0, "chunk": 40}
    lines = []
    out, rounds, why = sample_adaptive(oracle, PROMPTS, sampling, ROBUST, 0, tmp_path / "samples", 300, tmp_path / "ck",
                                       {"m": "toy"}, progress=False, report=lines.append)
    assert why == "stable" and rounds[-1].d_hat_raw == oracle.rank and rounds[-1].check_d_hat_raw in (11, 12, 13)
    assert len(rounds) >= 3 and rounds[-1].N < sampling["N_max"]  # it stopped by itself, before N_max
    # each round's size follows from the one before: x2 while unsaturated; here a saturated round failed its check
    # and the next, sqrt(2) larger, was checked at that round's own N
    assert all(b.N == next_budget(a.N, a.saturated, sampling["N_max"]) for a, b in zip(rounds, rounds[1:]))
    assert rounds[-2].saturated and rounds[-1].check_N == rounds[-2].N
    assert len(lines) == len(rounds) and f"round {len(rounds) - 1}: N = {rounds[-1].N:,}" in lines[-1]
    S = load_samples(out)
    assert S.N == rounds[-1].N and S.D == len(PROMPTS) and S.tokens() == rounds[-1].tokens
    # recomputed independently from the round folders: every earlier round fails the rule, the last one meets it
    folders = sorted((tmp_path / "ck" / "adaptive").iterdir(), key=lambda f: int(f.name.split("-")[1]))
    merged = None
    for r in range(len(rounds)):
        merged = folders[r] if merged is None else merge(merged, folders[r], tmp_path / f"merged-{r}")
        merged_S = load_samples(merged)
        est = estimate(common_set(merged_S).Y, "robust", **ROBUST)
        check = estimate(common_set(merged_S.subsample(int(merged_S.N / math.sqrt(2)), 0)).Y, "robust", **ROBUST)
        assert stopped(est, check) == (r == len(rounds) - 1), r
    # the loop's output is the rounds' sum (an exact oracle: a token's log-prob is the same in every round); its work
    # folder (the merged samples, the check's copy) is gone, the round folders stay for a rerun
    total = sum(load_samples(f).counts for f in folders)
    assert (S.counts != total).nnz == 0 and all(np.array_equal(getattr(S.logprobs, k), getattr(merged_S.logprobs, k))
                                                for k in ("data", "indices", "indptr"))
    assert sorted(f.name for f in (tmp_path / "ck").iterdir()) == ["adaptive"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stop"] == "stable" and [r["N"] for r in manifest["adaptive"]] == [r.N for r in rounds]
    # a rerun (after a stop, or the same command again) draws nothing and reaches the same verdict
    before = oracle.sample_calls
    _, again, why2 = sample_adaptive(oracle, PROMPTS, sampling, ROBUST, 0, tmp_path / "samples2", 300, tmp_path / "ck",
                                     {"m": "toy"}, progress=False, report=lines.append)
    assert oracle.sample_calls == before and again == rounds and why2 == why


def test_with_the_missing_data_estimator_the_loop_stops_where_the_robust_one_cannot(tmp_path):
    """Rank 60 under a bf16 floor (tests/synthetic.py), 400 prompts: the robust loop is not stable by N_max = 8,486
    (alone it stops at 12,000 or 16,001, by its N_0); with ``ladder`` (sampling.estimator: incomplete) the rounds the robust estimate leaves
    not saturated are asked of the missing-data estimator, and its loop stops by itself at 8,486 with the true rank,
    its check the same estimator's."""
    oracle = LogProbOracle(incomplete_logprobs())
    prompts = [f"prompt {q}" for q in range(400)]
    sampling = {"N0": 1500, "N_max": 8486, "growth": 2.0, "temperature": 2.0, "chunk": 100}
    robust = {"g": 64, "z_min": 8.0, "min_ratio": 1.05}
    ladder = {"frac": 0.6, "rungs": [0.8, 0.9], "tol": 0.005, "max_iters": 300}
    lines = []
    _, alone, why = sample_adaptive(oracle, prompts, sampling, robust, 0, tmp_path / "r", 3000, tmp_path / "ck",
                                    {"m": "synthetic"}, progress=False, report=lambda line: None)
    assert why == "N_max" and not any(r.saturated for r in alone[:3])
    _, rounds, why = sample_adaptive(oracle, prompts, sampling, robust, 0, tmp_path / "i", 3000, tmp_path / "ck",
                                     {"m": "synthetic"}, progress=False, report=lines.append, ladder=ladder)
    assert why == "stable" and rounds[-1].d_hat_raw == 60 and rounds[-1].check_d_hat_raw in (59, 60, 61)
    assert [r.N for r in rounds] == [r.N for r in alone] == [1500, 3000, 6000, 8486]
    assert "(the missing-data estimator's)" in lines[-1]
    # a round's estimate hands back the sample's cost, not the frequent tokens' entries the ladder read: no round's are
    # held through the next round's estimate or its check (the 0.5B's loop: 12.8 GB with them, README)
    est, _, cost = folder_estimate(tmp_path / "i", robust, ladder, 0)
    assert est.saturated and cost.budget() == load_samples(tmp_path / "i").budget()
    assert cost.logprobs.nnz == cost.counts.nnz == 0


def test_too_small_n_max_reports_not_saturated_with_a_lower_bound(tmp_path):
    sampling = {"N0": 100, "N_max": 200, "growth": 2.0, "temperature": 2.0, "chunk": 40}
    _, rounds, why = sample_adaptive(LowRankOracle(), PROMPTS, sampling, ROBUST, 0, tmp_path / "s", 300, tmp_path / "ck",
                                     {"m": "toy"}, progress=False, report=lambda line: None)
    assert why == "N_max" and [r.N for r in rounds] == [100, 200]
    assert not rounds[-1].saturated and rounds[-1].d_hat_raw is None and 0 <= rounds[-1].lower_bound <= 12


def test_bad_rounds_are_refused_before_the_prompt_search_pays(tmp_path):
    """N0 above N_max, or a growth that needs more than 64 rounds: refused before any call (the prompt search, 4,096
    calls with the default params, was paid first; a review)."""
    from nv.phase1.pipeline import search_and_sample

    for sampling, message in (({"N0": 2000, "N_max": 1000}, "needs 1 <= N <= N_max"), ({"growth": 1.01}, "more than 64 rounds")):
        oracle = LowRankOracle()
        params = {"seed": 0, "model": {"m": "toy"}, "spectrum": {"robust": ROBUST},
                  "search": {"D": 8, "rounds": 1, "batch_size": 8, "explore_rounds": 1, "threshold": 0.5, "length": 4, "mode": "diverse"},
                  "sampling": {"N": "auto", "N0": 100, "N_max": 1000, "growth": 2.0, "temperature": 2.0, "chunk": 4} | sampling}
        with pytest.raises(NVError, match=message):
            search_and_sample(oracle, params, tmp_path, tmp_path / "ck", progress=False)
        assert oracle.cost.calls == 0


def test_n_max_raised_after_a_capped_round_draws_that_round_again_at_its_size(tmp_path):
    """N_max = 300 cuts round 2 (200 -> 400) short: the stop line names the round a rerun runs (N = 400, the capped
    round drawn again; it named 600), and the rerun with N_max = 400 keeps rounds 0-1, draws round 2 once at its own
    size and removes the capped one's folder (it stayed, unused); another target's round 2 is left alone."""
    lines, ck = [], tmp_path / "ck"
    run = lambda oracle, N_max, identity: sample_adaptive(  # noqa: E731
        oracle, PROMPTS, {"N0": 100, "N_max": N_max, "growth": 2.0, "temperature": 2.0, "chunk": 40}, ROBUST, 0,
        tmp_path / "s", 300, ck, identity, progress=False, report=lines.append)
    _, rounds, why = run(LowRankOracle(rank=70), 300, {"m": "toy"})
    assert why == "N_max" and [r.N for r in rounds] == [100, 200, 300] and not rounds[-1].saturated
    assert "the next round (N = 400)" in lines[-1] and "round 2 is drawn again" in lines[-1] and "at least 400" in lines[-1]
    run(LowRankOracle(rank=70), 300, {"m": "other"})
    oracle = LowRankOracle(rank=70)
    _, rounds, _ = run(oracle, 400, {"m": "toy"})
    assert [r.N for r in rounds] == [100, 200, 400] and oracle.sample_calls == len(PROMPTS)  # round 2 alone
    sizes = sorted((f.name.split("-")[1], f.name.split("-")[3]) for f in (ck / "adaptive").iterdir())
    assert sizes == [("0", "100"), ("0", "100"), ("1", "100"), ("1", "100"), ("2", "100"), ("2", "200")]
    lines.clear()
    run(LowRankOracle(rank=70), 400, {"m": "toy"})  # N_max on the grid: the next round is the loop's own
    assert "the next round (N = 800)" in lines[-1] and "drawn again" not in lines[-1]
    run(LowRankOracle(rank=70), 300, {"m": "toy"})  # back to N_max = 300: its capped round 2 drawn again, the full one kept
    sizes = sorted((f.name.split("-")[1], f.name.split("-")[3]) for f in (ck / "adaptive").iterdir())
    assert sizes == [("0", "100"), ("0", "100"), ("1", "100"), ("1", "100"), ("2", "100"), ("2", "100"), ("2", "200")]


def test_a_stopped_loop_leaves_its_rounds_and_no_merged_sample(tmp_path):
    """Ctrl-C in round 2: the finished rounds stay for the rerun, the merged sample on disk does not (it is rebuilt
    from them), and the rerun samples only round 2 onwards."""

    class Stopped(LowRankOracle):
        def sample(self, prompts, n, temperature, seeds):
            if n == 200:  # round 2's draws (N 200 -> 400)
                raise KeyboardInterrupt
            return super().sample(prompts, n, temperature, seeds)

    sampling = {"N0": 100, "N_max": 400, "growth": 2.0, "temperature": 2.0, "chunk": 40}
    with pytest.raises(KeyboardInterrupt):
        sample_adaptive(Stopped(), PROMPTS, sampling, ROBUST, 0, tmp_path / "s", 300, tmp_path / "ck", {"m": "toy"},
                        progress=False, report=lambda line: None)
    assert sorted(f.name.split("-")[1] for f in (tmp_path / "ck" / "adaptive").iterdir()) == ["0", "1"]
    assert not (tmp_path / "ck" / "adaptive-merged").exists() and not (tmp_path / "s").exists()
    oracle = LowRankOracle()
    _, rounds, _ = sample_adaptive(oracle, PROMPTS, sampling, ROBUST, 0, tmp_path / "s", 300, tmp_path / "ck", {"m": "toy"},
                                   progress=False, report=lambda line: None)
    assert [r.N for r in rounds] == [100, 200, 400] and oracle.sample_calls == len(PROMPTS)  # round 2 alone
    # the same checkpoint root for another target, temperature or width: no finished round of this one is taken for
    # it (the round folders' names hold only the round, seed and size; they used to be reused, another model's d)
    for identity, tau, width in (({"m": "another toy"}, 2.0, 300), ({"m": "toy"}, 1.0, 300), ({"m": "toy"}, 2.0, 400)):
        other = LowRankOracle(rank=5)
        _, rounds, _ = sample_adaptive(other, PROMPTS, sampling | {"temperature": tau}, ROBUST, 0, tmp_path / "s", width,
                                       tmp_path / "ck", identity, progress=False, report=lambda line: None)
        assert other.sample_calls == 3 * len(PROMPTS), (identity, tau, width)  # every round drawn again
    # ... and the run's own are still its own (a storage change, sampling.chunk, keeps them)
    same = LowRankOracle()
    sample_adaptive(same, PROMPTS, sampling | {"chunk": 20}, ROBUST, 0, tmp_path / "s", 300, tmp_path / "ck", {"m": "toy"},
                    progress=False, report=lambda line: None)
    assert same.sample_calls == 0


def test_on_the_simulator_the_rounds_share_one_forward_pass_per_batch(lm32, tmp_path):
    """The loop runs inside ``oracle.repeats()``: the simulator keeps each sampled batch's logits, so rounds after the
    first run no forward pass, and every round's draws are bit for bit those of a fresh simulator (the same batches,
    the same logits); nothing is kept after the loop. A defence wrapper opens its backend's span."""
    sim, fresh = Simulator(lm32, batch_size=4), Simulator(lm32, batch_size=4)
    passes, forward = [], sim._logit_tensor
    sim._logit_tensor = lambda batch: passes.append(len(batch)) or forward(batch)
    prompts = PROMPTS[:10]
    sampling = {"N0": 100, "N_max": 400, "growth": 2.0, "temperature": 2.0, "chunk": 5}
    _, rounds, _ = sample_adaptive(sim, prompts, sampling, ROBUST, 0, tmp_path / "s", sim.vocab_size, tmp_path / "ck",
                                   {"m": "smol"}, progress=False, report=lambda line: None)
    assert [r.N for r in rounds] == [100, 200, 400] and sum(passes) == len(prompts) and sim._kept is None
    for r, folder in enumerate(sorted((tmp_path / "ck" / "adaptive").iterdir(), key=lambda f: int(f.name.split("-")[1]))):
        delta = rounds[r].N - (rounds[r - 1].N if r else 0)
        collect(fresh, prompts, delta, 2.0, round_seed(0, r), tmp_path / f"fresh{r}", sim.vocab_size, tmp_path / "ck2",
                {"m": "smol"}, 5, False)
        a, b = load_samples(folder), load_samples(tmp_path / f"fresh{r}")
        for x, y in ((a.counts, b.counts), (a.logprobs, b.logprobs)):
            assert all(np.array_equal(getattr(x, k), getattr(y, k)) for k in ("data", "indices", "indptr")), r
    assert sim.cost.as_dict() == fresh.cost.as_dict()  # charged as if every round had run its own forward passes
    # behind a defence that truncates sampling (its draws from the simulator's white-box logits): the same sharing
    passes.clear()
    sample_adaptive(DefendedOracle(sim, Defence(top_k=50), 0), prompts, sampling, ROBUST, 0, tmp_path / "t", sim.vocab_size,
                    tmp_path / "ck3", {"m": "smol", "top_k": 50}, progress=False, report=lambda line: None)
    assert sum(passes) == len(prompts) and sim._kept is None
