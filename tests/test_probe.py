"""The attention probe (nv.phase2.probe): the simulator's prompt cache on the real embedded model, the probe's protocol
through it, and its fit, calibration and depth on timings whose law is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nv.errors import NVError
from nv.oracle import Simulator
from nv.phase2.probe import calibrate_probe, depth_probe, fit_probe, leave_one_out, matched_references, measure_cached
from nv.phase2.protocol import LengthTimings, collect_timings, timing_prompt


class Watched(Simulator):
    """The real simulator with the tokens each timed forward pass computes and its last-position logits recorded
    (forward hooks on the model: the test's view, not the API's)."""

    def __init__(self, lm, prompt_cache: bool):
        super().__init__(lm, batch_size=1, prompt_cache=prompt_cache)
        self.computed: list[int] = []
        self.last_logits: list[np.ndarray] = []
        self.hooks = [
            lm.model.register_forward_pre_hook(lambda _, args, kwargs: self.computed.append(kwargs["input_ids"].shape[1]),
                                               with_kwargs=True),
            lm.model.register_forward_hook(lambda _, args, kwargs, out: self.last_logits.append(out.logits[0, -1].numpy().copy()),
                                           with_kwargs=True)]


@pytest.fixture()
def watched(lm32):
    """Watched simulators over the embedded model; their hooks are removed after the test."""
    made: list[Watched] = []

    def make(prompt_cache: bool) -> Watched:
        made.append(Watched(lm32, prompt_cache))
        return made[-1]

    yield make
    for w in made:
        for hook in w.hooks:
            hook.remove()


def test_prompt_cache_computes_only_the_new_tokens_and_changes_no_logit(watched):
    rng = np.random.default_rng(0)
    context = timing_prompt(600, rng)
    prompts = [context, context + " first words", context + " other words", timing_prompt(600, rng)]
    cached = watched(True)
    calls = [cached.time_request(p) for p in prompts]
    assert cached.computed[0] == calls[0].prompt_tokens  # nothing cached yet
    for call, computed in zip(calls[1:3], cached.computed[1:3]):  # the context is reused: the words and the template's end run
        assert call.prompt_tokens - calls[0].prompt_tokens <= computed <= call.prompt_tokens - calls[0].prompt_tokens + 8
    assert cached.computed[3] >= calls[3].prompt_tokens - 40  # a fresh random prefix: only the template's start is shared
    cached.time_request(prompts[3])  # the same prompt again: its last token still runs
    assert cached.computed[-1] == 1
    plain = watched(False)
    for p in prompts:
        plain.time_request(p)
    assert plain.computed == [c.prompt_tokens for c in calls]
    for a, b in zip(cached.last_logits[:4], plain.last_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)
    assert cached.cost.calls == 5 and cached.cost.prompt_tokens == sum(c.prompt_tokens for c in calls) + calls[3].prompt_tokens


def test_probe_protocol_through_the_cache(watched, tmp_path):
    oracle = watched(True)
    rows = collect_timings(oracle, [40, 120], trials=3, warmups=2, seed=3, checkpoint=tmp_path / "p.jsonl",
                           run_id={"model": "embedded", "probe": True}, progress=False, measure=measure_cached)
    assert [r.target for r in rows] == [1, 40, 120]
    # per context: one priming call, then 3 timed calls each computing its new tokens only
    assert len(oracle.computed) == 2 + 3 * 4
    for r in rows:
        assert len(set(r.ell)) == 1 and len(r.seconds) == len(r.new) == 3
        assert all(60 <= n <= 110 for n in r.new)  # six random words and ~64 tokens of passage past the cached context
    assert rows[2].ell[0] - rows[1].ell[0] == pytest.approx(80, abs=10)
    record = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[1])
    assert "new" in record
    assert "new" not in LengthTimings(5, [5], [0.1]).record()  # App. D's rows keep their form
    fit = fit_probe(rows)
    assert np.isfinite(fit.g) and 60 <= fit.s <= 110


def synthetic_rows(L: int, d: int, b: float, rng, stall: float = 0.0, new: int = 40) -> list[LengthTimings]:
    """T = t0 + b L d ell_c, one-sided: each trial late by ~2 % of T and, as measured on a shared machine, most trials
    (70 %) by a stall of ``stall`` seconds, every trial of the 1,200-token context too; ``new`` tokens per call."""
    rows = []
    for ell_c in (10, 400, 800, 1200, 1600, 2000, 2400):
        T = 0.05 + b * L * d * ell_c
        hit = np.ones(10, dtype=bool) if ell_c == 1200 else rng.random(10) < 0.7
        seconds = T * (1 + 0.02 * rng.exponential(size=10)) + stall * hit
        rows.append(LengthTimings(ell_c, [ell_c] * 10, seconds.tolist(), [new] * 10))
    return rows


def test_probe_recovers_depth_on_a_known_law():
    rng = np.random.default_rng(0)
    family = [(12, 384), (24, 384), (16, 512), (32, 512), (28, 768)]
    rate = np.array([fit_probe(synthetic_rows(L, d, 2e-9, rng, stall=0.5)).rate for L, d in family])
    L, d = np.array(family).T
    assert np.allclose(leave_one_out(rate, L, d), L, rtol=0.05)  # the fastest trial and Theil-Sen ignore the stalls
    b = calibrate_probe(rate, L, d)
    assert b == pytest.approx(2e-9 / 40, rel=0.03)
    target = fit_probe(synthetic_rows(24, 896, 2e-9 * 50 / 40, rng, stall=0.5, new=50))  # another tokenizer: 50 new tokens
    assert depth_probe(target.rate, b, 896) == pytest.approx(24, rel=0.05)
    with pytest.raises(NVError, match="no prompt cache"):
        calibrate_probe(-rate, L, d)
    with pytest.raises(NVError, match="App. D"):
        fit_probe([LengthTimings(n, [n], [0.1, 0.2]) for n in (10, 20, 30)])
    with pytest.raises(NVError, match="3 context lengths"):
        fit_probe(synthetic_rows(12, 384, 2e-9, rng)[:2])


def test_matched_references_sit_at_the_targets_width_with_the_default_ratios():
    refs = matched_references(896, (12, 24), kv_ratio=0.25, ffn_ratio=3.5)
    # 14 heads of 64: 0.25 x 14 = 3.5 KV heads, and the divisors of 14 nearest it are 2 (1.5 away) before 7
    assert refs == {"m-896x12": {"d": 896, "L": 12, "n_kv_heads": 2, "d_ffn": 3136},
                    "m-896x24": {"d": 896, "L": 24, "n_kv_heads": 2, "d_ffn": 3136}}
    assert {e["n_kv_heads"] for e in matched_references(576, (10, 20), 0.25, 3.5).values()} == {3}  # 9 heads: 2.25 -> 3
    assert {e["n_kv_heads"] for e in matched_references(512, (10, 20), 0.25, 3.5).values()} == {2}  # 8 heads: exactly 2
    with pytest.raises(NVError, match="multiple of the head size 64, got 900"):
        matched_references(900, (12, 24), 0.25, 3.5)
