"""The simulator backend on the real embedded model: log-prob semantics, sampling law, cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from nv.errors import NVError
from nv.oracle import Simulator
from nv.oracle.simulator import log_softmax

PROMPTS = ["héllo wörld", "日本語のテ", "🙂🙃😀😁😂", "abcde", "مرحبا بكم", "⠓ꦂ🜁ᚠ∰"]


def plain_logits(lm, fmt, prompts) -> np.ndarray:
    """Reference: one unbatched full forward pass per prompt, no prefix reuse."""
    rows = []
    with torch.inference_mode():
        for p in prompts:
            rows.append(lm.model(input_ids=torch.tensor([fmt.ids(p)])).logits[0, -1].double().numpy())
    return np.array(rows)


@pytest.fixture(scope="module")
def reference(lm32):
    sim = Simulator(lm32, logits="float32")
    return plain_logits(lm32, sim.format, PROMPTS)


def test_prefix_reuse_matches_plain_forward(lm32, reference):
    for reuse in (True, False):
        sim = Simulator(lm32, logits="float32", batch_size=4, prefix_reuse=reuse)
        assert np.abs(sim.logits(PROMPTS) - reference).max() < 2e-4
        assert bool(sim._prefix_kv) == reuse
    prefix = sim.format.shared_prefix
    assert len(prefix) >= 20 and lm32.tokenizer.decode(prefix).endswith("user\n")  # system prompt + template head


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_sampled_logprobs_are_log_softmax_of_the_model(lm32, reference, mode):
    tau = 2.0
    sim = Simulator(lm32, logits="float32", logprobs=mode)
    samples = sim.sample(PROMPTS, 5000, tau, seeds=[(1, q) for q in range(len(PROMPTS))])
    for z, s in zip(reference, samples):
        expected = log_softmax(z / tau) if mode == "processed" else log_softmax(z)
        assert s.n == 5000
        assert np.abs(s.logprobs - expected[s.token_ids]).max() < 2e-4


def test_bfloat16_logits_are_rounded_before_the_softmax(lm32, reference):
    z = Simulator(lm32, logits="bfloat16").logits(PROMPTS)
    z32 = Simulator(lm32, logits="float32").logits(PROMPTS)
    # exactly the float32 logits of the same forward pass, rounded to bf16 (compared with the plain unbatched pass, a
    # logit near 0 can differ by more than its own bf16 spacing: the two float32 paths differ by up to 2e-4)
    assert np.array_equal(z, torch.tensor(z32).to(torch.bfloat16).double().numpy())
    assert np.all(np.abs(z - reference) <= np.abs(reference) * 2.0**-8 + 2e-4)
    assert np.abs(z - reference).max() > 1e-4  # and really rounded


def test_token_frequencies_follow_the_distribution(lm32, reference):
    """Chi-square goodness of fit of N = 2e5 draws (the Poisson + top-up path) at a fixed seed."""
    tau, n = 2.0, 200_000
    sim = Simulator(lm32, logits="float32")
    (s,) = sim.sample(PROMPTS[:1], n, tau, seeds=[7])
    p = np.exp(log_softmax(reference[0] / tau))
    observed = np.zeros_like(p)
    observed[s.token_ids] = s.counts
    order = np.argsort(p)[::-1]
    big = order[p[order] * n >= 20]  # bins with enough expected counts; the rest pooled
    obs = np.append(observed[big], n - observed[big].sum())
    exp = np.append(p[big] * n, n - p[big].sum() * n)
    assert len(big) > 500
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_same_seed_same_samples(lm32):
    sim = Simulator(lm32, logits="float32")
    a = sim.sample(PROMPTS[:2], 10**6, 2.0, seeds=[(0, 0), (0, 1)])
    b = sim.sample(PROMPTS[:2], 10**6, 2.0, seeds=[(0, 0), (0, 1)])
    for x, y in zip(a, b):
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.counts, y.counts)
        assert x.n == 10**6


def test_cost_follows_the_paper_formula(lm32):
    """(system prompt + input + output tokens) x samples, counted independently via the chat template."""
    sim = Simulator(lm32, logits="float32")
    n = 1000
    sim.sample(PROMPTS, n, 2.0, seeds=list(range(len(PROMPTS))))
    sim.argmax(PROMPTS[:2])
    tok = lm32.tokenizer
    lengths = [
        len(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)["input_ids"])
        for p in PROMPTS
    ]
    expected = sum((ell + 1) * n for ell in lengths) + sum(ell + 1 for ell in lengths[:2])
    assert sim.cost.calls == n * len(PROMPTS) + 2
    assert sim.cost.tokens == expected
    assert sim.cost.output_tokens == n * len(PROMPTS) + 2


def test_argmax_reports_the_temperature_one_logprob(lm32, reference):
    sim = Simulator(lm32, logits="float32")
    for z, s in zip(reference, sim.argmax(PROMPTS)):
        assert s.token_ids[0] == np.argmax(z)
        assert abs(s.logprobs[0] - log_softmax(z).max()) < 2e-4


def test_time_request_is_positive_and_charged(lm32):
    sim = Simulator(lm32)
    call = sim.time_request("abcde")
    assert call.seconds > 0
    assert call.prompt_tokens == len(sim.format.ids("abcde"))
    assert sim.cost.calls == 1 and sim.cost.prompt_tokens == call.prompt_tokens


@pytest.mark.parametrize(
    "n, tau, message", [(10, 0.0, "temperature"), (10, -1.0, "temperature"), (0, 1.0, "N must"), (2.5, 1.0, "N must")]
)
def test_bad_sampling_requests_are_refused(lm32, n, tau, message):
    sim = Simulator(lm32)
    with pytest.raises(NVError, match=message):
        sim.sample(PROMPTS[:1], n, tau, seeds=[0])
    assert sim.cost.calls == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": "topk"}, r"logprobs must be one of \('processed', 'raw'\), got 'topk'"),
    ({"logits": "fp8"}, r"logits must be one of \('bfloat16', 'float32'\), got 'fp8'"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
])
def test_bad_switches_are_refused(lm32, kwargs, message):
    with pytest.raises(NVError, match=message):
        Simulator(lm32, **kwargs)


def test_argmax_dtype_scores_in_float32_on_the_same_weights_and_restores_the_model():
    """model.argmax_dtype: float32: the search's temperature-0 calls run the bf16-loaded weights in float32
    (bf16 -> float32 is exact), so their log-probs equal a float32 copy of those weights, not bf16 compute."""
    import copy

    from nv.models.loading import load_model

    lm = load_model("embedded", dtype="bfloat16")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()} | {n: b.clone() for n, b in lm.model.named_buffers()}
    scored = Simulator(lm, logits="float32", argmax_dtype="float32").argmax(PROMPTS)
    after = dict(lm.model.state_dict()) | dict(lm.model.named_buffers())
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())  # bit-identical model
    lm32 = copy.copy(lm)
    lm32.model = copy.deepcopy(lm.model)
    for p in lm32.model.parameters():
        p.data = p.data.float()
    exact = Simulator(lm32, logits="float32").argmax(PROMPTS)
    bf16 = Simulator(lm, logits="float32").argmax(PROMPTS)
    got, want, low = (np.array([s.logprobs[0] for s in x]) for x in (scored, exact, bf16))
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(got - low).max() > 1e-3  # bf16 compute really differs: the switch is not a no-op
    with pytest.raises(NVError, match=r"argmax_dtype must be one of \('bfloat16', 'float32'\), got 'float16'"):
        Simulator(lm, argmax_dtype="float16")


def test_each_prompt_is_tokenized_once_per_call(lm32):
    sim = Simulator(lm32, logits="float32")
    assert sim.format.shared_prefix  # computed once per simulator (two probe strings), before the count starts
    calls = []
    ids = sim.format.ids
    sim.format.ids = lambda user: calls.append(user) or ids(user)
    samples = sim.sample(PROMPTS, 10, 1.0, seeds=list(range(len(PROMPTS))))
    assert sorted(calls) == sorted(PROMPTS)
    assert [s.prompt_tokens for s in samples] == [len(ids(p)) for p in PROMPTS]
    calls.clear()
    sim.argmax(PROMPTS)
    assert sorted(calls) == sorted(PROMPTS)
