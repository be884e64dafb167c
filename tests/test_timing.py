"""Phase 2 collection (nv.phase2.protocol) on the real embedded model in process, the random-weight reference
family (nv.models.reference_family) and the leave-one-out evaluation (nv.phase2.evaluation)."""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from nv.errors import NVError
from nv.oracle import Simulator
from nv.models.reference_family import Shape, random_llama, shape_from_entry, write_gguf
from nv.phase2.protocol import BASELINE, LengthTimings, TimingJob, collect_interleaved, collect_timings, summarize, timing_prompt
from nv.phase2.evaluation import evaluate, held_out
from nv.phase2.fit import scaling_relation

LENGTHS = [48, 96]
RUN = {"model": "embedded", "platform": "inprocess"}


class CountingSimulator(Simulator):
    """The real simulator, recording the token count of every timed call (the test's probe)."""

    def __init__(self, lm):
        super().__init__(lm, batch_size=1)
        self.sent: list[int] = []

    def time_request(self, prompt):
        call = super().time_request(prompt)
        self.sent.append(call.prompt_tokens)
        return call


def test_damaged_timing_rows_are_one_line():
    with pytest.raises(NVError, match="must start with the ell = 1 baseline"):
        summarize([])
    rows = [LengthTimings(BASELINE, [1, 1], [0.1, 0.1]), LengthTimings(50, [50, 50, 50], [0.2, 0.2, 0.3])]
    with pytest.raises(NVError, match=r"differ in their number of trials \(\[2, 3\]\)"):
        summarize(rows)


def test_fresh_random_prefix_per_trial():
    rng = np.random.default_rng(0)
    a, b = timing_prompt(300, rng), timing_prompt(300, rng)
    assert a != b and a[:20] != b[:20]
    assert a.endswith(b[-200:])  # same passage, different prefix


def test_real_inprocess_timing_run(lm32, tmp_path):
    oracle = CountingSimulator(lm32)
    rows = collect_timings(oracle, LENGTHS, trials=3, warmups=3, seed=1, checkpoint=tmp_path / "t.jsonl", run_id=RUN, progress=False)
    assert [r.target for r in rows] == [BASELINE, *LENGTHS]
    assert len(oracle.sent) == 3 + 3 * 3  # warm-ups + baseline + two lengths
    for row in rows[1:]:  # the backend's own count lands near the aim (the random prefix varies by a few tokens)
        assert len(row.seconds) == 3 and all(abs(n - row.target) <= 8 for n in row.ell)
    stats = summarize(rows, trim=0.0)
    assert stats["ell"].tolist() == [np.mean(r.ell) for r in rows[1:]]
    base = np.mean(rows[0].seconds)
    assert np.allclose(stats["T"], [np.mean(r.seconds) - base for r in rows[1:]])
    assert np.all(stats["sigma"] > 0)


def test_interrupted_run_resumes_from_measured_lengths(lm32, tmp_path):
    checkpoint = tmp_path / "t.jsonl"
    first = CountingSimulator(lm32)
    full = collect_timings(first, LENGTHS, 2, 2, 5, checkpoint, RUN, progress=False)
    lines = checkpoint.read_text().splitlines()
    assert len(lines) == 1 + 3  # header, baseline, two lengths
    # interrupt: the last length's line was torn mid-write
    checkpoint.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    again = CountingSimulator(lm32)
    resumed = collect_timings(again, LENGTHS, 2, 2, 5, checkpoint, RUN, progress=False)
    assert len(again.sent) == 2 + 2  # warm-ups and the one torn length only
    assert [r.target for r in resumed] == [r.target for r in full]
    assert [r.ell for r in resumed] == [r.ell for r in full]  # prompts depend on (seed, length) only
    assert all(json.loads(x) for x in checkpoint.read_text().splitlines())  # the torn line is gone
    third = CountingSimulator(lm32)
    collect_timings(third, LENGTHS, 2, 2, 5, checkpoint, RUN, progress=False)
    assert third.sent == []  # complete: nothing is timed again
    other = CountingSimulator(lm32)
    collect_timings(other, LENGTHS, 2, 2, 6, checkpoint, RUN, progress=False)  # another seed: starts over
    assert len(other.sent) == 2 + 3 * 2
    for foreign in (b"[1, 2]\n", b"null\n", b"\xff\xfe\n"):  # another program's file: replaced, not a traceback
        checkpoint.write_bytes(foreign)
        replaced = CountingSimulator(lm32)
        collect_timings(replaced, LENGTHS, 2, 2, 6, checkpoint, RUN, progress=False)
        assert len(replaced.sent) == 2 + 3 * 2


def test_interleaved_models_share_one_random_order_and_resume_apart(lm32, tmp_path):
    small = random_llama(shape_from_entry({"d": 64, "L": 2, "n_kv_heads": 1, "d_ffn": 128}, lm32.arch.vocab_size, 512),
                         lm32.tokenizer, "float32", 0, "small")
    log: list[str] = []

    class Logged(CountingSimulator):
        def __init__(self, lm, name):
            super().__init__(lm)
            self.name = name

        def time_request(self, prompt):
            log.append(self.name)
            return super().time_request(prompt)

    lengths = [40, 56, 72, 88, 104, 120]

    def jobs():
        return [TimingJob(Logged(lm, name), lengths, tmp_path / f"{name}.jsonl", {"model": name})
                for lm, name in ((lm32, "a"), (small, "b"))]

    first = jobs()
    rows = collect_interleaved(first, 2, 2, 3, progress=False)
    timed = log[2 * (2 + 2):]  # after both models' warm-ups and baselines: the lengths, 2 calls each
    switches = sum(x != y for x, y in zip(timed[::2], timed[2::2]))
    assert sorted(timed[::2]) == ["a"] * 6 + ["b"] * 6 and switches >= 3  # one order across models, not a then b
    for job, got in zip(first, rows):
        assert [r.target for r in got] == [BASELINE, *lengths]
        alone = collect_timings(CountingSimulator(job.oracle.lm), lengths, 2, 2, 3, tmp_path / "alone.jsonl", job.run_id,
                                progress=False)
        assert [r.ell for r in alone] == [r.ell for r in got]  # the same prompts as the model timed alone
    lines = (tmp_path / "b.jsonl").read_text().splitlines()
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # model b lost its last length
    log.clear()
    again = jobs()
    resumed = collect_interleaved(again, 2, 2, 3, progress=False)
    assert log == ["b"] * (2 + 2) and [r.ell for r in resumed[0]] == [r.ell for r in rows[0]]


def test_bad_timing_requests_are_refused(lm32, tmp_path):
    with pytest.raises(NVError, match="trials"):
        collect_timings(Simulator(lm32), LENGTHS, 1, 3, 0, tmp_path / "a", RUN, progress=False)
    with pytest.raises(NVError, match="lengths"):
        collect_timings(Simulator(lm32), [1, 50], 2, 3, 0, tmp_path / "b", RUN, progress=False)
    with pytest.raises(NVError, match="warm-up"):
        collect_timings(Simulator(lm32), LENGTHS, 2, 1, 0, tmp_path / "c", RUN, progress=False)


def test_random_llama_has_the_requested_shape(lm32):
    shape = shape_from_entry({"d": 128, "L": 3, "n_kv_heads": 1, "d_ffn": 320}, lm32.arch.vocab_size, 512)
    lm = random_llama(shape, lm32.tokenizer, "float32", seed=0, name="tiny")
    a = lm.arch
    assert (a.d, a.L, a.n_heads, a.n_kv_heads, a.d_ffn, a.vocab_size, a.tied_embeddings) == (128, 3, 2, 1, 320, lm32.arch.vocab_size, False)
    assert Simulator(lm, batch_size=1).time_request("hello").prompt_tokens > 1
    again = random_llama(shape, lm32.tokenizer, "float32", seed=0, name="tiny")
    assert all(np.array_equal(x, y) for x, y in zip(lm.model.state_dict().values(), again.model.state_dict().values()))
    with pytest.raises(NVError, match="multiple of the head size"):
        shape_from_entry({"d": 100, "L": 3, "n_kv_heads": 1, "d_ffn": 320}, 10, 512)
    with pytest.raises(NVError, match="KV groups"):
        Shape(128, 3, 2, 3, 320, 10, 512)


def test_reference_gguf_has_the_template_layout(lm32, tmp_path):
    import gguf

    from nv.models.loading import embedded_gguf
    from nv.models.packaged import tied_embeddings

    shape = shape_from_entry({"d": 128, "L": 2, "n_kv_heads": 1, "d_ffn": 256}, lm32.arch.vocab_size, 512)
    path = write_gguf(random_llama(shape, lm32.tokenizer, "float32", 0, "tiny"), embedded_gguf(), tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(path))
    kinds = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in reader.tensors}
    assert kinds["blk.1.ffn_down.weight"] == ("Q4_1", [256, 128])
    assert kinds["blk.0.attn_k.weight"] == ("Q4_1", [128, 64])
    assert kinds["output.weight"] == ("Q8_0", [128, lm32.arch.vocab_size])
    assert kinds["output_norm.weight"][0] == "F32"
    assert not tied_embeddings(reader)  # its own random unembedding: untied by content too, not only by presence
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.embedding_length"].contents() == 128
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{%")
    assert not (tmp_path / "tiny.tmp").exists()
    wide = shape_from_entry({"d": 256, "L": 1, "n_kv_heads": 1, "d_ffn": 256, "head_dim": 128}, lm32.arch.vocab_size, 512)
    assert (wide.n_heads, wide.d_kv) == (2, 128)
    reader = gguf.GGUFReader(str(write_gguf(random_llama(wide, lm32.tokenizer, "float32", 0, "wide"), embedded_gguf(),
                                            tmp_path / "wide.gguf")))
    assert reader.fields["llama.rope.dimension_count"].contents() == 128
    assert reader.fields["llama.attention.head_count"].contents() == 2


def test_a_damaged_cached_reference_gguf_is_written_again(lm32, tmp_path, monkeypatch):
    """A reference's GGUF in the cache cut short outside nv (it is written atomically) is detected and written again,
    where it used to be served as it was (llama.cpp's load error on every rerun)."""
    from nv.phase2 import platforms

    monkeypatch.setattr(platforms, "default_cache_dir", lambda: tmp_path)
    shape = shape_from_entry({"d": 128, "L": 2, "n_kv_heads": 1, "d_ffn": 256}, lm32.arch.vocab_size, 512)
    model = platforms.TimedModel("tiny", "reference", random_llama(shape, lm32.tokenizer, "float32", 0, "tiny"), 128, 64, 256,
                                 512, synthetic=True)
    path = platforms._gguf_for(model, 0)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    model.gguf = None
    assert platforms._gguf_for(model, 0) == path and path.read_bytes() == whole


def test_a_reference_llamacpp_cannot_serve_fails_before_any_platform_is_timed(lm32, tmp_path, monkeypatch):
    """A d_ffn off llama.cpp's 32-weight blocks failed in gguf's quantiser (QuantError) after the in-process sweep had
    been timed, and again at every rerun (a review): now a one-line error naming the entry, before any timing."""
    from nv.phase2 import platforms

    monkeypatch.setattr(platforms, "default_cache_dir", lambda: tmp_path)
    shape = shape_from_entry({"d": 128, "L": 1, "n_kv_heads": 1, "d_ffn": 1000}, lm32.arch.vocab_size, 512)
    model = platforms.TimedModel("odd", "reference", random_llama(shape, lm32.tokenizer, "float32", 0, "odd"), 128, 64, 1000,
                                 512, synthetic=True)
    timing = {"platforms": {"inprocess": {"references": "all", "r": 0.1, "trials": 2, "threads": 1},
                            "llamacpp": {"references": "all", "r": 0.1, "trials": 2, "threads": 1}},
              "n_lengths": 6, "discard": 2}
    with pytest.raises(NVError, match="reference odd: d_ffn = 1000 is not a multiple of 32") as err:
        platforms.time_model(model, timing, 0, tmp_path / "out", tmp_path / "ck", progress=False)
    assert "\n" not in str(err.value) and not list((tmp_path / "out").iterdir())


def _record(name, role, L, d, d_used, beta, alpha, platform, rng, k=1.0):
    """A timing record as time_model writes it, with T from Eq. 2 (times k) plus 1 % noise."""
    ell = np.linspace(0.5, 1.5, 16) * 5 * d
    T = scaling_relation(k * beta, alpha, L, d, ell) * (1 + 0.01 * rng.standard_normal(len(ell)))
    return {"model": name, "role": role, "platform": platform, "L": L, "d": d, "d_used": d_used, "P": 1e8, "vocab_size": 49152,
            "n_heads": d // 64, "n_kv_heads": 2, "d_ffn": 3 * d, "tied": False, "ell": ell.tolist(), "T": T.tolist(),
            "sigma": (0.01 * T).tolist(), "trials": 10, "tokens": 1}


TIMING = {"discard": 4, "kv_ratio": 0.25, "ffn_ratio": 3.5}


def test_leave_one_out_recovers_depth_on_both_platforms():
    rng = np.random.default_rng(0)
    family = [(f"r{i}", L, d) for i, (L, d) in enumerate([(12, 384), (24, 384), (16, 512), (32, 512), (20, 640), (28, 768)])]
    records = {}
    for platform, k, refs in (("inprocess", 1.0, family), ("llamacpp", 3.0, family[::2])):  # a subset on the second
        recs = [_record(name, "reference", L, d, d, 2e-12, 0.01, platform, rng, k) for name, L, d in refs]
        recs.append(_record("g", "target", 30, 576, 600, 2e-12, 0.01, platform, rng, k))
        records[platform] = recs
    table = evaluate(records, TIMING)
    refs = table[table.role == "reference"]
    assert len(refs) == 6 + 3 and np.all(refs.L_err < 0.05)
    cross = refs[refs.platform == "llamacpp"]
    assert np.allclose(cross.k, 3.0, rtol=0.05) and np.allclose(refs[refs.platform == "inprocess"].k, 1.0)
    target = table[table.role == "target"].set_index(["platform", "d_source"])
    # same platform, true d: L = 30 to within 0.5 layers (1 % timing noise; 30.1 +- 0.2 over six seeds)
    assert abs(target.loc[("inprocess", "true d"), "L_hat"] - 30) < 0.5
    # with d_hat = 600 > d = 576 the slope per unit ell^2 d_hat shrinks: L_hat = 30 * 576 / 600 = 28.8, which the
    # 0.5 tolerance tells apart from 30 (the d_hat row must not be the true-d row under another name)
    assert abs(target.loc[("inprocess", "d_hat"), "L_hat"] - 28.8) < 0.5
    for platform in ("inprocess", "llamacpp"):  # both estimators scale exactly as 1/d_hat (Eqs. 9, 10)
        for column in ("L_hat", "L_hat_eq10"):
            ratio = target.loc[(platform, "d_hat"), column] / target.loc[(platform, "true d"), column]
            assert ratio == pytest.approx(576 / 600, rel=1e-9), (platform, column)
    # across platforms k is fitted (2.93 here, the pooled gamma weights the platforms' points differently), so L_hat
    # carries k's error: 30.8 with the true d
    assert abs(target.loc[("llamacpp", "true d"), "L_hat"] - 30) < 1.0
    assert abs(target.loc[("llamacpp", "true d"), "L_hat_eq10"] - 30) < 1.0
    lone = held_out(records["inprocess"][:2], records["inprocess"][:2], records["inprocess"][0], TIMING, "d_used")
    assert "two reference models" in lone["note"] and "L_hat" not in lone  # reported, not fatal


def test_transfer_factor_pools_only_references_timed_on_both_platforms():
    """Eq. 8's k = gamma^tgt / gamma^ref compares the same models: a reference timed on the second platform alone (a
    params' llama.cpp list naming a model the reference platform lacks) is left out of both, not pooled into gamma^tgt,
    whose slope grows with the mean depth of what it pools (pooled, this setup read k = 2.29 for 2)."""
    rng = np.random.default_rng(1)
    shapes = [("a", 12, 384), ("b", 16, 512), ("c", 24, 448)]
    inproc = [_record(name, "reference", L, d, d, 2e-12, 0.01, "inprocess", rng) for name, L, d in shapes]
    llama = [_record(name, "reference", L, d, d, 2e-12, 0.01, "llamacpp", rng, 2.0) for name, L, d in shapes]
    g = _record("g", "target", 20, 576, 576, 2e-12, 0.01, "llamacpp", rng, 2.0)
    alone = _record("deep", "reference", 48, 512, 512, 2e-12, 0.01, "llamacpp", rng, 2.0)
    row, extra = (held_out(inproc, recs, g, TIMING, "d_used") for recs in (llama, llama + [alone]))
    assert row["k"] == pytest.approx(2.0, rel=0.05) and abs(row["L_hat"] - 20) < 1.0
    assert (extra["k"], extra["L_hat"], extra["L_hat_eq10"]) == (row["k"], row["L_hat"], row["L_hat_eq10"])


def test_timings_that_do_not_grow_are_reported_and_drawn_not_fatal(tmp_path):
    """A second platform whose references' times fall with ell^2 d (a machine busy enough to swamp a short sweep: a CI
    run of the tiny pipeline beside another job hit it) has no transfer factor: every model's row there says why, the
    same platform's rows still have a depth, and every figure of the timing fit is drawn, the cross-platform one
    saying there is no k."""
    import matplotlib.pyplot as plt

    from nv.plots import phase2 as plots_timing
    from nv.plots import save

    rng = np.random.default_rng(0)
    family = [(f"r{i}", L, d) for i, (L, d) in enumerate([(12, 384), (24, 384), (16, 512), (32, 512)])]
    records = {platform: [_record(name, "reference", L, d, d, beta, alpha, platform, rng) for name, L, d in family]
                         + [_record("g", "target", 30, 576, 576, beta, alpha, platform, rng)]
               for platform, beta, alpha in (("inprocess", 2e-12, 0.01), ("llamacpp", -2e-12, 10.0))}
    table = evaluate(records, TIMING)
    cross, same = table[table.platform == "llamacpp"], table[table.platform == "inprocess"]
    assert cross.note.str.contains("gamma fits must be positive").all() and cross.L_hat.isna().all()
    assert (same.note == "").all() and same.L_hat.notna().all()
    cross_figure = plots_timing.cross_platform(records, TIMING["discard"])
    title = cross_figure.get_suptitle()
    assert title.startswith("No cross-platform calibration: k = gamma_llamacpp / gamma_inprocess")
    assert re.search(r"gamma_inprocess = \d\S* s, gamma_llamacpp = -\d", title), title  # each gamma named by its platform
    # each missing estimate is a cross under the axis, where no bar of 0 % can be mistaken for it (they sat on 0 %)
    error_figure = plots_timing.errors(table)
    crosses = [ln for ax in error_figure.axes for ln in ax.get_lines() if ln.get_marker() == "x" and len(ln.get_ydata())]
    assert len(crosses) == 3 * 2 * (cross.d_source == "d_hat").sum() and all(ln.get_ydata()[0] < 0 for ln in crosses)
    for name, figure in (("scaling", plots_timing.scaling(records, TIMING["discard"])),
                         ("measured", plots_timing.measured_vs_predicted(records, table)),
                         ("errors", error_figure), ("cross", cross_figure)):
        save(figure, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    plt.close("all")


def test_real_timing_through_a_llamacpp_server(lm32):
    """Both timed models of a cross-platform run on the real llama.cpp server (HTTP, 127.0.0.1):
    the embedded GGUF target and a random-weight reference written as GGUF on the fly."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python[server] is not installed: `make server` (or `make test`) installs it")
    from nv.models.loading import embedded_gguf
    from nv.phase2.platforms import TimedModel, platform_oracle

    shape = shape_from_entry({"d": 128, "L": 2, "n_kv_heads": 1, "d_ffn": 256}, lm32.arch.vocab_size, 512)
    reference = TimedModel("tiny", "reference", random_llama(shape, lm32.tokenizer, "float32", 0, "tiny"), 128, 64, 256, 512,
                           synthetic=True)
    target = TimedModel("embedded", "target", lm32, 576, 144, 2016, 8192, gguf=embedded_gguf())
    for model in (reference, target):
        with platform_oracle("llamacpp", model, threads=1, n_ctx=512, seed=0) as oracle:
            rows = collect_timings(oracle, LENGTHS, 2, 2, 0, Path(tempfile.mkdtemp()) / "t.jsonl", {"model": model.name}, progress=False)
            assert oracle.cost.calls == 2 + 3 * 2
        for row in rows[1:]:
            assert all(abs(n - row.target) <= 8 for n in row.ell)
        assert all(s > 0 for r in rows for s in r.seconds)


def test_a_real_reference_model_keeps_its_true_shape(lm32):
    from nv.phase2.platforms import reference_model

    real = reference_model("smollm2", {"spec": "embedded"}, lm32, seed=0)
    assert (real.d_used, real.d_kv_used, real.d_ffn_used, real.p_max) == (576, 192, 1536, 8192)
    assert real.gguf is not None and real.gguf.suffix == ".gguf" and not real.synthetic
    assert real.lengths(0.6, 24)[0] == 922  # App. D sweep of the true shape: ell* = 1843


def test_target_sweep_takes_phase1_d_hat(tmp_path):
    from nv.phase2.platforms import target_d_hat

    metrics = tmp_path / "hidden_dim.json"
    with pytest.raises(NVError, match="run phase 1"):
        target_d_hat("phase1", metrics)
    metrics.write_text(json.dumps({"d_hat": None, "reason": "not saturated"}))
    with pytest.raises(NVError, match="not saturated"):
        target_d_hat("phase1", metrics)
    metrics.write_text(json.dumps({"d_hat": 640, "reason": "ok"}))
    assert target_d_hat("phase1", metrics) == 640 and target_d_hat(576, metrics) == 576


def test_measured_prefill_time_grows_with_prompt_length(lm32):
    """What Eq. 2 rests on, measured on the real model in process: a longer prompt takes longer to prefill.

    Prompts of ~64, ~256 and ~1,024 tokens (template included), 4 trials each, interleaved so that a slow
    moment of this shared machine hits every length alike; medians. Measured on a loaded 2-core machine:
    0.20, 0.51, 2.13 s; asserted: strictly increasing and at least 3x from 64 to 1,024 tokens."""
    sim = Simulator(lm32, batch_size=1)
    rng = np.random.default_rng(0)
    prompts = {}
    for target in (64, 256, 1024):
        chars = 4 * target
        for _ in range(20):  # aim at the token count through the real tokenizer and template
            prompt = timing_prompt(chars, np.random.default_rng(target))
            ell = sim.format.prompt_tokens(prompt)
            if abs(ell - target) <= 4:
                break
            chars = max(0, chars + round((target - ell) * len(prompt) / max(ell, 1) * 0.9))
        assert abs(ell - target) <= 4, (target, ell)
        prompts[target] = prompt
    sim.time_request(prompts[64])  # warm-up
    seconds = {t: [] for t in prompts}
    for _ in range(4):
        for t in rng.permutation(list(prompts)):
            call = sim.time_request(prompts[int(t)])
            assert abs(call.prompt_tokens - int(t)) <= 4
            seconds[int(t)].append(call.seconds)
    median = {t: float(np.median(v)) for t, v in seconds.items()}
    print("prefill seconds (median of 4):", {t: round(m, 4) for t, m in median.items()})
    assert median[64] < median[256] < median[1024]
    assert median[1024] > 3 * median[64]
