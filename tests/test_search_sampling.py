"""Prompt search and checkpointed sampling on the real embedded model (tiny sizes)."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import scipy.sparse as sp
import pytest

from nv.errors import NVError
from nv.oracle import Simulator
from nv.phase1.pipeline import common_set, common_set_of
from nv.phase1.prune import greedy_prune
from nv.phase1.sampling import (SampledMatrix, collect, head, iter_shards, load_samples, observed_mask, sample_budget,
                               save_samples, thin)
from nv.phase1.search import ALPHABETS, GROUPS, search_prompts
from synthetic import LowRankOracle


@pytest.fixture(scope="module")
def sim(lm32):
    return Simulator(lm32, batch_size=64)


def test_search_keeps_the_lowest_argmax_prompts_and_charges_every_call(sim):
    before = sim.cost.calls
    res = search_prompts(sim, D=50, rounds=3, batch_size=40, explore_rounds=2, threshold=1e-9, seed=3, progress=False)
    assert len(res.prompts) == len(set(res.prompts)) == 120  # each string evaluated once
    assert sim.cost.calls - before == 120  # one temperature-0 call per candidate
    assert all(len(p) == 5 for p in res.prompts)
    kept = np.array([res.argmax_prob[res.prompts.index(p)] for p in res.kept])
    assert len(res.kept) == 50 and np.all(np.diff(kept) >= 0)
    assert kept[-1] <= np.sort(res.argmax_prob)[50]
    assert res.rounds_explored == 2  # threshold never reached: all exploration rounds ran
    # the refinement round: one-character variants of the best prompt after round 2
    best = res.prompts[int(np.argmin(res.argmax_prob[:80]))]
    assert all(sum(a != b for a, b in zip(p, best)) <= 1 for p in res.prompts[80:])


def test_search_stops_exploring_below_the_threshold(sim):
    res = search_prompts(sim, D=10, rounds=3, batch_size=20, explore_rounds=3, threshold=0.99, seed=1, progress=False)
    assert res.rounds_explored == 1


def test_refinement_passes_a_spent_character_group_on_to_the_next():
    """One-character prompts (on the toy LM: the search's bookkeeping, not the model, is under test): a refinement
    round of 480 asks 30 variants of each of the 16 groups, more than Hebrew's 27 letters; the search moves on to the
    other groups and fills the round (it stalled on Hebrew's turn until its tries ran out: 99 of the 480)."""
    res = search_prompts(LowRankOracle(), D=10, rounds=2, batch_size=480, explore_rounds=1, threshold=1e-9, seed=0, length=1,
                         progress=False)
    refined = res.prompts[480:]
    assert len(refined) == 480 and len(set(res.prompts)) == 960
    groups = [set(map(chr, a)) for a in ALPHABETS]
    assert all(any(p in g for p in refined) for g in groups)  # every group has its turns
    assert groups[list(GROUPS).index("hebrew")] <= set(res.prompts)  # Hebrew spent: every letter evaluated once


def test_search_refuses_impossible_sizes(sim):
    with pytest.raises(NVError, match="< D"):
        search_prompts(sim, D=100, rounds=1, batch_size=10, explore_rounds=1, threshold=0.1, seed=0)
    assert len(ALPHABETS) >= 7


class Interrupting(Simulator):
    """The real simulator, interrupted (as by Ctrl-C) after ``after`` sample() calls."""

    def __init__(self, lm, after):
        super().__init__(lm, batch_size=64)
        self.after = after

    def sample(self, *args, **kwargs):
        if self.after == 0:
            raise KeyboardInterrupt
        self.after -= 1
        return super().sample(*args, **kwargs)


def test_interrupted_sampling_resumes_without_losing_finished_prompts(lm32, tmp_path):
    prompts = [f"{a}{b}xyz" for a in "ab" for b in "cdefghijklmnopq"][:25]
    args = dict(N=3000, temperature=2.0, seed=5, vocab_size=49152, identity={"model": "embedded"}, chunk=10)
    broken = Interrupting(lm32, after=2)
    with pytest.raises(KeyboardInterrupt):
        collect(broken, prompts, out_dir=tmp_path / "out", checkpoint_root=tmp_path / "ck", progress=False, **args)
    resumed = Simulator(lm32, batch_size=64)
    collect(resumed, prompts, out_dir=tmp_path / "out", checkpoint_root=tmp_path / "ck", progress=False, **args)
    assert resumed.cost.calls == 5 * 3000  # only the 5 prompts of the unfinished shard were sampled again
    fresh = Simulator(lm32, batch_size=64)
    collect(fresh, prompts, out_dir=tmp_path / "ref", checkpoint_root=tmp_path / "ck2", progress=False, **args)
    a, b = load_samples(tmp_path / "out"), load_samples(tmp_path / "ref")
    assert (a.counts != b.counts).nnz == 0 and np.array_equal(a.logprobs.data, b.logprobs.data)
    assert a.D == 25 and np.all(np.asarray(a.counts.sum(axis=1)).ravel() == 3000)


def _damage_logprobs(shard: bytes) -> bytes:
    """A shard with bytes inside its log-probs' data zeroed: same size, its CRC no longer matches."""
    with zipfile.ZipFile(io.BytesIO(shard)) as z:
        info = z.getinfo("logprobs.npy")
    damaged = bytearray(shard)
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    damaged[start : start + 16] = bytes(16)
    return bytes(damaged)


def _edit(shard: bytes, **values) -> bytes:
    """A shard with arrays set to constant ``values``: whole, readable, and wrong."""
    with np.load(io.BytesIO(shard)) as z:
        arrays = {k: z[k] for k in z.files}
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.full_like(v, values[k]) if k in values else v for k, v in arrays.items()})
    return buffer.getvalue()


def test_corrupt_shard_is_resampled_and_missing_data_is_an_error(lm32, tmp_path):
    """A shard torn in the checkpoint folder of an interrupted run is sampled again on resume (with the
    unfinished one), the finished intact shard is not, and the result equals an uninterrupted run's."""
    prompts = ["abcde", "fghij", "klmno", "pqrst", "uvwxy"]
    kw = dict(N=2000, temperature=2.0, seed=0, vocab_size=49152, identity={}, chunk=2, progress=False)
    with pytest.raises(KeyboardInterrupt):
        collect(Interrupting(lm32, after=2), prompts, out_dir=tmp_path / "o", checkpoint_root=tmp_path / "c", **kw)
    (work,) = (tmp_path / "c").glob("sampling-*")
    assert sorted(f.name for f in work.glob("shard-*")) == ["shard-0000000.npz", "shard-0000002.npz"]
    intact = (work / "shard-0000000.npz").read_bytes()
    (work / "shard-0000002.npz").write_bytes(b"torn")
    resumed = Simulator(lm32)
    out = collect(resumed, prompts, out_dir=tmp_path / "o", checkpoint_root=tmp_path / "c", **kw)
    assert resumed.cost.calls == 3 * 2000  # the torn shard's 2 prompts + the unfinished shard's 1, nothing else
    assert (out / "shard-0000000.npz").read_bytes() == intact
    # whole in its structure but damaged in its values (a bad CRC inside the log-probs, counts no draw gives, prompts
    # of no tokens): a checkpoint is read through at resume and sampled again, not handed on to fail at every load after
    for damage in (_damage_logprobs, lambda b: _edit(b, counts=0), lambda b: _edit(b, prompt_tokens=0)):
        work.mkdir()
        (work / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
        (work / "shard-0000000.npz").write_bytes(intact)
        (work / "shard-0000002.npz").write_bytes(damage((out / "shard-0000002.npz").read_bytes()))
        again = Simulator(lm32)
        collect(again, prompts, out_dir=tmp_path / "o2", checkpoint_root=tmp_path / "c", **kw)
        assert again.cost.calls == 3 * 2000  # the damaged shard and the missing last one
        assert np.array_equal(load_samples(tmp_path / "o2").logprobs.data, load_samples(out).logprobs.data)
    fresh = collect(Simulator(lm32), prompts, out_dir=tmp_path / "ref", checkpoint_root=tmp_path / "c2", **kw)
    a, b = load_samples(out), load_samples(fresh)
    assert (a.counts != b.counts).nnz == 0 and np.array_equal(a.logprobs.data, b.logprobs.data)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and a.counts[2:4].nnz > 0
    # a shard corrupted after the run finished is not silently used: the data are an error until resampled
    (out / "shard-0000002.npz").write_bytes(b"torn")
    for read in (load_samples, sample_budget):  # one line, one remedy, from the full reader and the budget's
        with pytest.raises(NVError, match="shard-0000002.npz is missing or corrupt: rerun the sampling stage$"):
            read(out)
    (out / "shard-0000002.npz").unlink()
    with pytest.raises(NVError, match="shard-0000002.npz is missing or corrupt: rerun the sampling stage$"):
        sample_budget(out)
    with pytest.raises(NVError, match="no sampling manifest"):
        load_samples(tmp_path / "nothing")
    # a manifest or shard that is whole but wrong: one line, not a KeyError, a TypeError or (token ids past the
    # vocabulary reaching scipy) a segmentation fault
    manifest = json.loads((fresh / "manifest.json").read_text())
    for bad in ({}, [], {**manifest, "D": "5"}, {**manifest, "chunk": 0}, {k: v for k, v in manifest.items() if k != "temperature"}):
        (fresh / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(NVError, match="manifest.json is corrupt"):
            load_samples(fresh)
    (fresh / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 10}))
    with pytest.raises(NVError, match="shard-0000000.npz is missing or corrupt"):
        load_samples(fresh)
    (fresh / "manifest.json").write_text(json.dumps(manifest))
    # whole but wrong inside: an array of the wrong length (seen from its header), values no sample has, a damaged
    # zip member (found where its values are read): one line naming the shard, no numpy or zipfile traceback
    shard = fresh / "shard-0000002.npz"
    good = shard.read_bytes()
    with np.load(shard) as z:
        arrays = {k: z[k] for k in z.files}
    for edit, message in (({"logprobs": arrays["logprobs"][:-3]}, "shard-0000002.npz is missing or corrupt"),
                          ({"prompt_tokens": arrays["prompt_tokens"][:1]}, "shard-0000002.npz is missing or corrupt"),
                          ({"logprobs": np.where(np.arange(arrays["logprobs"].size) < 4, np.nan, arrays["logprobs"])},
                           r"shard-0000002.npz is corrupt \(4 logprobs not finite\): delete it and sample again"),
                          ({"counts": np.zeros_like(arrays["counts"])}, r"\(\d+ counts below 1\)"),
                          ({"prompt_tokens": np.zeros_like(arrays["prompt_tokens"])}, r"\(\d+ prompt_tokens below 1\)"),
                          ({"prompt_tokens": arrays["prompt_tokens"] + 0.5}, r"\(prompt_tokens stored as float64, not integers\)")):
        np.savez(shard, **(arrays | edit))
        for read in (load_samples, lambda f: list(iter_shards(f)[1])):
            with pytest.raises(NVError, match=message):
                read(fresh)
    for prompt_tokens in ({"prompt_tokens": arrays["prompt_tokens"][:1]}, {}, {"prompt_tokens": 0 * arrays["prompt_tokens"]},
                          {"prompt_tokens": arrays["prompt_tokens"] + 0.5}):  # too short; absent; zero; not integers
        np.savez(shard, **({k: v for k, v in arrays.items() if k != "prompt_tokens"} | prompt_tokens))
        with pytest.raises(NVError, match="shard-0000002.npz is missing or corrupt: rerun the sampling stage$"):
            sample_budget(fresh)
    shard.write_bytes(_damage_logprobs(good))
    with pytest.raises(NVError, match=r"shard-0000002.npz is corrupt \(Bad CRC-32"):
        load_samples(fresh)
    assert sample_budget(fresh) == b.budget()  # the budget reads no entry: a damaged log-prob member is not its concern
    np.savez(shard, **(arrays | {"indices": np.full_like(arrays["indices"], -1)}))  # entries no reader accepts
    with pytest.raises(NVError, match="shard-0000002.npz is missing or corrupt"):
        load_samples(fresh)
    assert sample_budget(fresh) == b.budget()
    shard.write_bytes(good)
    assert np.array_equal(load_samples(fresh).logprobs.data, b.logprobs.data)


def test_a_full_disk_is_a_one_line_error_and_the_rerun_resumes(lm32, tmp_path, capsys):
    """Sampling onto a real full disk (a 300 kB tmpfs: two or three of five 5-prompt shards fit) stops with one
    line naming the shard, keeps the finished shards and no torn file; with space freed, the same call resumes and
    equals a run on an ample disk. Mounting needs root: skipped elsewhere."""
    import subprocess

    from nv.errors import run_main

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs (the full disk) needs root")
    try:
        prompts = [f"{a}{b}xyz" for a in "ab" for b in "cdefghijklmnopq"][:25]
        kw = dict(N=3000, temperature=2.0, seed=5, vocab_size=49152, identity={}, chunk=5, progress=False)
        sims = [Simulator(lm32, batch_size=64) for _ in range(2)]
        runs = [lambda sim=sim: collect(sim, prompts, out_dir=disk / "out", checkpoint_root=disk / "ck", **kw) for sim in sims]
        assert run_main(runs[0]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: no space left on the device writing ") and "shard-" in err and "\n" not in err
        (work,) = (disk / "ck").glob("sampling-*")
        kept = {f.name: f.read_bytes() for f in work.glob("shard-*.npz")}
        assert 1 <= len(kept) < 5 and not list(work.glob("*.tmp.npz")), sorted(f.name for f in work.iterdir())
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert run_main(runs[1]) == 0
        assert sims[1].cost.calls == (25 - 5 * len(kept)) * 3000  # only the unfinished shards
        assert all((disk / "out" / name).read_bytes() == data for name, data in kept.items())
        ref = collect(Simulator(lm32, batch_size=64), prompts, out_dir=tmp_path / "ref", checkpoint_root=tmp_path / "c2", **kw)
        a, b = load_samples(disk / "out"), load_samples(ref)
        assert (a.counts != b.counts).nnz == 0 and np.array_equal(a.logprobs.data, b.logprobs.data)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_subsample_is_the_first_N_calls(lm32, tmp_path):
    sim = Simulator(lm32)
    kw = dict(N=20000, temperature=2.0, seed=0, vocab_size=49152, identity={}, chunk=1, progress=False)
    folder = collect(sim, ["abcde", "⠓ꦂ🜁ᚠ∰"], out_dir=tmp_path / "o", checkpoint_root=tmp_path / "c", **kw)
    S = load_samples(folder)
    sub = S.subsample(2000, seed=1)
    # thinned on disk a shard at a time (one prompt each here): the same draws
    streamed = load_samples(thin(folder, tmp_path / "t", 2000, seed=1))
    assert streamed.N == 2000 and all(np.array_equal(getattr(getattr(streamed, m), f), getattr(getattr(sub, m), f))
                                      for m in ("counts", "logprobs") for f in ("data", "indices", "indptr"))
    assert np.all(np.asarray(sub.counts.sum(axis=1)).ravel() == 2000)
    assert (sub.counts > S.counts).nnz == 0  # never more draws of a token than in the full run
    full = {(q, t): y for q, t, y in zip(*S.logprobs.nonzero(), S.logprobs.data)}
    assert all(full[(q, t)] == y for q, t, y in zip(*sub.logprobs.nonzero(), sub.logprobs.data))
    assert sub.tokens() * 10 == S.tokens()
    with pytest.raises(NVError, match="sub-budget"):
        S.subsample(30000, seed=1)


def test_thinning_counts_the_calls_that_named_no_token(tmp_path):
    """A row whose counts sum to less than its N calls (replies that named no token: an empty end-of-turn, undecodable
    text, a withheld log-prob) thins N' of its N calls, the unnamed ones a bucket of their own: 6 named of 10 calls at
    N' = 7 keep 4.2 named on average and never fail (they kept all 6, and N' = 8 raised "nsample > sum(colors)", which
    stopped the adaptive loop's check); on disk a shard at a time the same draws."""
    counts = sp.csr_matrix((np.array([4, 2, 10], dtype=np.int32), np.array([0, 1, 2]), np.array([0, 2, 3])), shape=(2, 5))
    logprobs = sp.csr_matrix((np.array([-1.0, -2.0, -0.5], dtype=np.float32), counts.indices, counts.indptr), shape=(2, 5))
    S = SampledMatrix(logprobs, counts, np.array([5, 5]), 10, 2.0)
    kept = [S.subsample(7, seed).counts.toarray() for seed in range(2000)]
    named = np.array([k[0].sum() for k in kept])
    assert named.max() <= 6 and abs(named.mean() - 7 * 6 / 10) < 0.05 and all(k[1].sum() == 7 for k in kept)
    assert S.subsample(9, 0).counts[0].sum() <= 6  # more calls than named tokens: no error
    folder = save_samples(S, tmp_path / "s", chunk=1)
    streamed = load_samples(thin(folder, tmp_path / "t", 7, seed=3))
    assert (streamed.counts != S.subsample(7, 3).counts).nnz == 0


def test_streamed_mask_and_columns_match_the_full_matrix(lm32, tmp_path):
    """observed_mask is the full matrix's pattern; load_samples(columns=mask) holds exactly its entries in those
    columns; the common set from the mask's pruning equals the full one (benchmarks/paper_scale.py's path)."""
    prompts = ["abcde", "fghij", "klmno", "pqrst", "uvwxy"]
    kw = dict(N=3000, temperature=2.0, seed=0, vocab_size=49152, identity={}, chunk=2, progress=False)
    folder = collect(Simulator(lm32), prompts, out_dir=tmp_path / "o", checkpoint_root=tmp_path / "c", **kw)
    S = load_samples(folder)
    mask = observed_mask(folder)
    assert mask.dtype == bool and mask.shape == S.counts.shape and ((S.counts > 0) != mask).nnz == 0
    columns = np.asarray(mask.sum(axis=0)).ravel() >= 3
    part = load_samples(folder, columns=columns)
    assert 0 < part.counts.nnz < S.counts.nnz and set(part.counts.indices) == set(np.flatnonzero(columns))
    for full, kept in ((S.counts, part.counts), (S.logprobs, part.logprobs)):
        assert (full[:, columns] != kept[:, columns]).nnz == 0 and kept[:, ~columns].nnz == 0
    assert np.array_equal(part.prompt_tokens, S.prompt_tokens) and (part.N, part.D) == (S.N, S.D)
    whole, pruned = common_set(S), greedy_prune(mask)
    kept = np.zeros(S.counts.shape[1], dtype=bool)
    kept[pruned.cols] = True
    streamed = common_set(load_samples(folder, columns=kept), pruned)
    assert whole.Y.shape[1] > 10 and np.array_equal(whole.Y, streamed.Y)
    of_folder, part = common_set_of(folder)
    assert np.array_equal(of_folder.Y, whole.Y) and part.counts.nnz < S.counts.nnz and part.budget() == S.budget()


def test_head_is_the_first_prompts_of_the_thinning_read_from_their_shards_alone(lm32, tmp_path):
    """``head`` (the planner's pilot): the first prompts of ``subsample``'s thinning, across a shard boundary and cut
    inside a shard, read from the shards that hold them: a corrupt later shard does not stop it, as it does a whole
    read, and is a one-line error where it is needed."""
    prompts = ["abcde", "fghij", "klmno", "pqrst", "uvwxy"]
    kw = dict(N=3000, temperature=2.0, seed=0, vocab_size=49152, identity={}, chunk=2, progress=False)
    folder = collect(Simulator(lm32), prompts, out_dir=tmp_path / "o", checkpoint_root=tmp_path / "c", **kw)
    S = load_samples(folder)
    for N in (1000, 3000):  # at its own N: the sample itself, as subsample
        whole = S.subsample(N, seed=1)
        part = head(folder, 3, N, seed=1)
        assert (part.D, part.N, part.temperature) == (3, N, 2.0) and np.array_equal(part.prompt_tokens, S.prompt_tokens[:3])
        for m in ("counts", "logprobs"):
            assert (getattr(part, m) != getattr(whole, m)[:3]).nnz == 0 and getattr(part, m).nnz > 0
    (folder / "shard-0000004.npz").write_bytes(b"torn")
    assert (head(folder, 4, 1000, seed=1).counts != S.subsample(1000, seed=1).counts[:4]).nnz == 0
    for read in (load_samples, lambda f: head(f, 5, 1000, seed=1)):
        with pytest.raises(NVError, match="shard-0000004.npz is missing or corrupt"):
            read(folder)
    with pytest.raises(NVError, match="sub-budget N must be in"):
        head(folder, 3, 3001, seed=1)
    with pytest.raises(NVError, match="at least 1, got 0"):
        head(folder, 0, 1000, seed=1)


def test_diverse_mode_draws_fresh_prompts_every_round(sim):
    res = search_prompts(sim, D=30, rounds=3, batch_size=20, explore_rounds=1, threshold=0.5, seed=2, mode="diverse",
                         progress=False)
    assert res.rounds_explored == 3 and len(set(res.prompts)) == 60
    best = res.prompts[int(np.argmin(res.argmax_prob[:20]))]
    assert sum(sum(a != b for a, b in zip(p, best)) <= 1 for p in res.prompts[20:]) < 5  # not variants of the best
    with pytest.raises(NVError, match="search mode"):
        search_prompts(sim, D=1, rounds=1, batch_size=1, explore_rounds=1, threshold=0.5, seed=0, mode="greedy")


def test_entropy_and_top_k_mass_of_masked_and_one_hot_rows():
    """A token of probability 0 (log-prob -inf: masked, or a one-hot row) adds 0 log 0 = 0 to the entropy, where it
    made the row's entropy NaN; top_k_mass needs k >= 1 (k = 0 returned the whole mass)."""
    from nv.phase1.entropy import entropy_nats, top_k_mass
    with np.errstate(divide="ignore"):
        rows = np.log(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]]))
    assert np.allclose(entropy_nats(rows), [np.log(2), 0.0, 1.5 * np.log(2)])
    assert np.allclose(top_k_mass(rows, 1), [0.5, 1.0, 0.5]) and np.allclose(top_k_mass(rows, 5), 1.0)
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_mass(rows, 0)
