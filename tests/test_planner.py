"""The phase-1 budget planner (nv.phase1.planner) on the synthetic toy LM (tests/synthetic.py): its miss probability
is the Monte-Carlo one, and a pilot of 40 prompts x 500 calls predicts the N at which 400 prompts share a given
common set within the issue's factor 2. On the real models: the planner stage (tests/test_pipeline.py) and
README: planner."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

from nv.errors import NVError
from nv.phase1 import sampling
from nv.phase1.adaptive import sample_adaptive, schedule
from nv.phase1.exactness import first
from nv.phase1.planner import check, disk_bytes, fit, miss_probability, pilot_of, summarise
from nv.phase1.sampling import collect, load_samples, sample_budget
from synthetic import LowRankOracle


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner")
    folder = collect(LowRankOracle(scale=0.5), [f"prompt {q}" for q in range(400)], 20_000, 2.0, 0, tmp / "s", 300, tmp / "ck",
                     {"m": "toy"}, 100, False)
    return load_samples(folder), folder


def strict_common(S) -> int:
    """Tokens drawn under every prompt."""
    return int(np.count_nonzero(np.diff(S.counts.tocsc().indptr) == S.D))


def test_miss_probability_is_the_expected_chance_of_never_drawing_the_token():
    rng = np.random.default_rng(0)
    for m, s, N in ((-6.0, 1.0, 300), (-9.0, 2.0, 10_000), (-3.0, 0.3, 20)):
        x = np.minimum(rng.normal(m, s, 400_000), 0)
        assert miss_probability(np.array([m]), np.array([s]), N)[0] == pytest.approx(np.mean((1 - np.exp(x)) ** N), abs=2e-3)


def test_a_small_pilot_predicts_the_budget_of_the_full_attack(toy, tmp_path, monkeypatch):
    """A pilot of 0.25 % of the sample's calls predicts the N at which all 400 prompts share the measured common set
    within a factor 2. The stage's pilot and checks come from the stored sample: the pilot read from the shards holding
    its prompts (``head``; the first prompts of a thinning are the thinning of the first prompts), the checks thinned
    from disk, only their observation masks read (the same draws as thinning in memory), no scratch folder left."""
    S, folder = toy
    model = fit(first(S, 40).subsample(500, 1))  # 0.25 % of the full sample's calls
    assert model.D0 == 40 and model.N0 == 500 and model.m.size > 250
    for N in (10_000, 20_000):
        measured = strict_common(S.subsample(N, 0))
        predicted_N = model.samples_for(measured, S.D)
        assert N / 2 < predicted_N < 2 * N, (N, measured, predicted_N)
        assert model.expected_common(predicted_N, S.D) == pytest.approx(measured, rel=1e-3)
    assert model.expected_common(5_000, 4) > model.expected_common(5_000, 400)  # more prompts share fewer tokens
    assert model.samples_for(301, S.D) is None  # more than the vocabulary: unreachable
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # thinned_folder's scratch folders go here
    pilot = pilot_of(folder, 40, 500, 1)
    by_hand = first(S, 40).subsample(500, 1)
    assert (pilot.D, pilot.N) == (40, 500) and (pilot.counts != by_hand.counts).nnz == 0
    assert (pilot.logprobs != by_hand.logprobs).nnz == 0
    rows = check(model, folder, [10_000, 20_000, 10**6], 0)
    assert [r["N"] for r in rows] == [10_000, 20_000]  # budgets above the sample's own N are left out
    for r in rows:
        assert r["measured_C"] == strict_common(S.subsample(r["N"], 0)) and r["D"] == S.D
        assert r["predicted_C"] == model.expected_common(r["N"], S.D)
    assert not any(scratch.iterdir())
    assert sample_budget(folder) == S.budget()


def test_the_pilot_predicts_the_size_of_the_sample(toy):
    """The distinct tokens a prompt draws (its row's entries of Y_hat) and the stored sample's bytes on disk, from the
    same pilot of 0.25 % of the calls: within 2 % of the measured ones at 2x and 4x its N (~250 and ~280 of the toy's
    300 tokens; by 2·10^4 calls a prompt draws nearly all), within 5 % on disk (the check's rows too)."""
    S, folder = toy
    model = fit(first(S, 40).subsample(500, 1))
    for N in (1_000, 2_000):
        measured = S.subsample(N, 0).counts.nnz / S.D
        assert measured < 290 and model.expected_distinct(N) == pytest.approx(measured, rel=0.02), N
    row = check(model, folder, [2_000], 0)[0]
    assert row["measured_distinct"] == S.subsample(2_000, 0).counts.nnz / S.D
    assert row["predicted_distinct"] == model.expected_distinct(2_000)
    stored = sum(f.stat().st_size for f in folder.iterdir())
    assert disk_bytes(model, S.D, [S.N])["sample"] == pytest.approx(stored, rel=0.05)
    # the adaptive loop keeps every round's draws beside the merged sample, and a check's copy while it runs
    loop = disk_bytes(model, S.D, [5_000, 10_000, 20_000], adaptive=True)
    assert loop["sample"] == disk_bytes(model, S.D, [S.N])["sample"] and loop["peak"] > 2.5 * loop["sample"]


class Measured:
    """``TokenModel.expected_distinct`` read off a real sample: the distinct tokens a prompt drew in its first N calls
    (the sample thinned to N), so that ``disk_bytes``' accounting is checked apart from the fit's."""

    def __init__(self, S):
        self.S = S

    def expected_distinct(self, N: float) -> float:
        return self.S.subsample(int(N), 0).counts.nnz / self.S.D


@pytest.mark.parametrize("N_max", [2_000, 2_100])
def test_the_adaptive_loop_on_disk_at_its_peak_is_the_planned_peak(tmp_path, monkeypatch, N_max):
    """``disk_bytes``' peak against the bytes the loop holds at its worst moment, read after every shard it writes and
    before every folder it removes or after it copies one (the functions wrapped to look, not replaced): one round of
    2,000 (its output copied beside its own folder: twice the sample) and rounds of 1,000, 2,000, 2,100 (the second
    merge written beside the first, which outweighs the check's copy at 2,100 / sqrt 2 by ~8 % of the peak). Next
    tokens nearly flat over 20,000, so a prompt's distinct tokens grow nearly as N; never saturated, so no check."""
    root = tmp_path / "run"
    peak = [0]

    def look():
        peak[0] = max(peak[0], sum(f.stat().st_size for f in root.rglob("*") if f.is_file()))

    save, rmtree, copytree = sampling._save_rows, shutil.rmtree, shutil.copytree

    def saved(*args, **kwargs):
        save(*args, **kwargs)
        look()

    def removed(*args, **kwargs):
        look()
        rmtree(*args, **kwargs)

    def copied(*args, **kwargs):
        out = copytree(*args, **kwargs)
        look()
        return out

    monkeypatch.setattr(sampling, "_save_rows", saved)
    monkeypatch.setattr(shutil, "rmtree", removed)
    monkeypatch.setattr(shutil, "copytree", copied)
    plan = {"N0": min(1_000 if N_max > 2_000 else N_max, N_max), "N_max": N_max, "growth": 2.0, "temperature": 1.0,
            "chunk": 10}
    never = {"g": 8, "z_min": 1e9, "min_ratio": 1e9}
    folder, rounds, why = sample_adaptive(LowRankOracle(vocab=20_000, scale=0.1), [f"prompt {q}" for q in range(30)], plan,
                                          never, 0, root / "out", 20_000, root / "ck", {"m": "toy"}, progress=False)
    monkeypatch.undo()
    planned_rounds = schedule(plan["N0"], N_max, 2.0)
    assert [r.N for r in rounds] == planned_rounds == ([2_000] if N_max == 2_000 else [1_000, 2_000, 2_100])
    assert why == "N_max" and not any(r.saturated for r in rounds)
    S = load_samples(folder)
    planned = disk_bytes(Measured(S), S.D, planned_rounds, adaptive=True)
    assert planned["sample"] == pytest.approx(sum(f.stat().st_size for f in folder.iterdir()), rel=0.03)
    assert planned["peak"] == pytest.approx(peak[0], rel=0.03), (planned, peak[0])


def test_a_pilot_too_small_to_fit_is_refused(toy):
    S, _ = toy
    with pytest.raises(NVError, match="too small to fit the tail"):
        fit(first(S, 4))
    with pytest.raises(NVError, match="raise the pilot's N"):
        fit(first(S, 40).subsample(1, 0), min_seen=20)


def test_the_summary_row_sets_each_stop_against_the_planned_N(toy):
    """``summarise`` (the planner stage's row per model): the pilot's share of the sample, the planned N for |C| >= d
    and tokens at the sample's rate, each measured stop over it; a stop that did not happen stays NaN."""
    S, _ = toy
    pilot = first(S, 40).subsample(500, 1)
    tail = fit(pilot)
    row = summarise("toy", 100, S.budget(), pilot, tail, stop_N=20_000, adaptive_stop_N=np.nan)
    N_for_d = tail.samples_for(100, S.D)
    assert row["N_for_d"] == N_for_d and row["stop_over_N_for_d"] == 20_000 / N_for_d
    assert row["tokens_for_d"] == pytest.approx(S.tokens() / S.N * N_for_d)
    assert row["pilot_share"] == pytest.approx(40 * 500 / (400 * 20_000))
    assert np.isnan(row["adaptive_stop_over_N_for_d"])
    unreachable = summarise("toy", 301, S.budget(), pilot, tail, stop_N=20_000, adaptive_stop_N=20_000)  # > |V|
    assert np.isnan(unreachable["N_for_d"]) and np.isnan(unreachable["tokens_for_d"]) and np.isnan(unreachable["stop_over_N_for_d"])


def test_a_pilot_of_raw_log_probs_is_converted_and_one_of_reveals_refused(lm32, root, tmp_path):
    """The planner's model reads a drawn token's log-prob as its sampling probability. Raw log-probs at tau = 2
    (log_softmax(z): llama.cpp, vLLM's default) break that: the real model's pilot, simulated in both modes (the same
    draws), is fitted as it is where the log-probs are processed (its frequent entries drawn ~1x as often as e^y
    says, ~0.17x where raw), and where raw is turned into log_softmax(z / tau) by each prompt's counts, within 0.03 of
    the processed values, the plan within 1 % of theirs. Counts that are not draws (here doubled, as top-k reveals
    would add) fit neither and are refused; a live pilot drawn with live.top_logprobs > 0 is refused by its
    manifest."""
    import json
    import shutil

    from nv.live import plan
    from nv.oracle import Simulator
    from nv.oracle.http import Budget
    from nv.params import load_params
    from nv.phase1.planner import AGREEMENT, as_processed, draws_over_expected
    from nv.phase1.sampling import MANIFEST, SampledMatrix
    from nv.phase1.search import random_prompts

    prompts = random_prompts(np.random.default_rng(0), 60)
    live = {"endpoint": "http://127.0.0.1:9/v1", "model": "m", "chat": True, "top_logprobs": 0}
    folders, pilots = {}, {}
    for mode in ("processed", "raw"):
        folders[mode] = collect(Simulator(lm32, logprobs=mode, batch_size=60), prompts, 10_000, 2.0, 0, tmp_path / mode,
                                49152, tmp_path / f"ck-{mode}", {"model": live | {"mode": mode}}, 60, False)
        pilots[mode] = load_samples(folders[mode])
    processed, raw = pilots["processed"], pilots["raw"]
    assert (processed.counts != raw.counts).nnz == 0  # the same draws
    ratio, n = draws_over_expected(processed)
    assert n >= 20 and 0.95 < ratio < 1.05
    ratio, n = draws_over_expected(raw)
    assert n >= 20 and ratio < 0.5 * AGREEMENT[0], ratio
    from nv.phase1.planner import log_normaliser

    assert log_normaliser(np.array([-0.5]), np.array([10_000]), 10_000) == -0.5  # one token drawn by every call: p = 1
    converted = as_processed(raw)
    assert converted.D == 60 and np.abs((converted.logprobs - processed.logprobs).tocsr().data).max() < 0.03
    as_is, from_raw = fit(processed), fit(raw)
    assert (as_is.logprobs, from_raw.logprobs) == ("processed", "raw")
    for size in (64, 256, 576):
        assert from_raw.samples_for(size, 3000) == pytest.approx(as_is.samples_for(size, 3000), rel=0.01)
    doubled = SampledMatrix(processed.logprobs, processed.counts * 2, processed.prompt_tokens, processed.N, 2.0)
    with pytest.raises(NVError, match=r"^the pilot's draws follow neither its log-probs \(2\.0\dx the draws e\^y predicts"):
        fit(doubled)
    params = load_params(root / "params.yaml", ["model", "search", "sampling", "spectrum", "live", "planner"])
    params["sampling"] |= {"N": 10_000, "temperature": 2.0}
    assert plan(params, Budget(), folders["raw"])["pilot"]["logprobs"] == "raw"
    reveals = tmp_path / "reveals"
    shutil.copytree(folders["raw"], reveals)
    manifest = json.loads((reveals / MANIFEST).read_text())
    (reveals / MANIFEST).write_text(json.dumps(manifest | {"model": manifest["model"] | {"top_logprobs": 2}}))
    with pytest.raises(NVError, match=r"drawn with live.top_logprobs = 2: its counts are top-k reveals, not draws"):
        plan(params, Budget(), reveals)
