"""The Carlini et al. logit-bias baseline (nv.theory.carlini) on the real embedded model (float32 logits)."""

from __future__ import annotations

import numpy as np
import pytest

from nv.theory.carlini import (
    carlini_attack,
    carlini_cost,
    cost_overhead,
    largest_gap,
    logit_matrix,
    recover_probs,
    singular_values,
    system_tokens,
)
from nv.errors import NVError
from nv.oracle import Oracle, Simulator
from nv.oracle.simulator import log_softmax
from nv.phase1.search import random_prompts

PROMPTS = ["héllo wörld", "日本語のテ", "🙂🙃😀😁😂", "abcde", "مرحبا بكم", "⠓ꦂ🜁ᚠ∰"]
EPS = np.finfo(np.float64).eps


@pytest.fixture(scope="module")
def sim(lm32):
    return Simulator(lm32, logits="float32", batch_size=100)


@pytest.fixture(scope="module")
def attack(sim):
    """600 > d = 576 random 2-character prompts (short inputs keep the forward passes ~1 min)."""
    prompts = random_prompts(np.random.default_rng(0), 600, length=2)
    assert len(set(prompts)) == len(prompts)
    return prompts, carlini_attack(sim, prompts)


def test_recovered_probabilities_match_the_softmax(sim):
    """p_q^(t) from the bias -1 calls equals softmax(z)_t up to the rounding of the returned y'_top.

    y'_top is a float64 near y_top, so it carries an absolute error of ~eps |y'_top|; the inversion
    divides it by 1 - 1/e. Hence |p_hat - p| <= 4 eps max(1, |y'_top|) / (1 - 1/e) + 4 eps p
    (absolute ~1e-15): a relative error below 1e-6 for every p >= 1e-8, while p below ~1e-16 is
    unresolvable: the attack drops columns recovered worse than 1 % (nv.theory.carlini.resolution).
    """
    logp = log_softmax(sim.logits(PROMPTS))
    top, y_top, y_biased = sim.top1_logit_bias(PROMPTS, np.arange(sim.vocab_size))
    rows = np.arange(len(PROMPTS))
    np.testing.assert_array_equal(top, logp.argmax(axis=1))
    np.testing.assert_allclose(y_top, logp[rows, top], rtol=4 * EPS, atol=0)
    assert np.isnan(y_biased[rows, top]).all() and np.isnan(y_biased).sum() == len(PROMPTS)
    p, p_hat = np.exp(logp), recover_probs(y_top, y_biased)
    p[rows, top] = p_hat[rows, top] = 0.0
    bound = 4 * EPS * np.maximum(1.0, np.abs(np.nan_to_num(y_biased))) / (1 - np.exp(-1)) + 4 * EPS * p
    assert np.all(np.abs(p_hat - p) <= bound)
    big = p >= 1e-8
    assert np.abs(p_hat[big] / p[big] - 1).max() < 1e-6


def test_bias_switch_matches_a_biased_softmax(sim):
    """The closed form equals the top log-prob of log_softmax(z + b e_t), also when t becomes the top."""
    z = sim.logits(PROMPTS[:1])[0]
    tokens = np.array([int(np.argsort(z)[-2]), 7, 1000, 49151])
    for bias in (-1.0, -5.0, 3.0):
        _, _, y_biased = sim.top1_logit_bias(PROMPTS[:1], tokens, bias)
        for t, y in zip(tokens, y_biased[0]):
            zb = z.copy()
            zb[t] += bias
            assert y == pytest.approx(log_softmax(zb).max(), rel=1e-13)


def test_cost_is_one_call_per_query_and_the_paper_formula(sim):
    """Charged tokens: |V| calls per prompt of (l_sys + input + 1 output); one-token inputs give d |V| (l_sys + 2)."""
    fresh = Simulator(sim.lm, logits="float32")
    l_sys = system_tokens(fresh)
    inputs = ["a", "b", "c"]
    assert [fresh.format.prompt_tokens(x) for x in inputs] == [l_sys + 1] * 3
    top, _, _ = fresh.top1_logit_bias(inputs, np.arange(fresh.vocab_size))
    V = fresh.vocab_size
    assert fresh.cost.calls == 3 * V
    assert fresh.cost.tokens == carlini_cost(3, V, l_sys) == 3 * V * (l_sys + 2)
    fresh.top1_logit_bias(inputs[:1], np.array([top[0], 5, 6]))  # the top token is never queried
    assert fresh.cost.calls == 3 * V + 3


def test_attack_recovers_d_exactly(attack, sim):
    prompts, result = attack
    d = sim.lm.arch.d
    assert result.d_hat == d == 576
    assert result.sigma[d - 1] / result.sigma[d] > 100  # a drop of two orders of magnitude
    assert largest_gap(singular_values(result.Q, centre=False)) == d + 1  # the softmax offset adds one
    assert result.resolved_tokens >= 0.99 * sim.vocab_size  # ~40 tokens with p < 1e-13 under some prompt
    assert result.Q.shape == (600, sim.vocab_size)


def test_attack_cost_accounting(attack, sim):
    prompts, result = attack
    V, l_sys = sim.vocab_size, result.l_sys
    template = sim.lm.tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True, add_generation_prompt=True)
    assert l_sys == sim.format.prompt_tokens("") == len(template["input_ids"])
    assert result.cost["calls"] == len(prompts) * V
    assert result.cost["tokens"] == sum(V * (sim.format.prompt_tokens(p) + 1) for p in prompts)
    assert result.cost["tokens"] == sum(carlini_cost(1, V, l_sys, sim.format.prompt_tokens(p) - l_sys) for p in prompts)
    assert result.formula_tokens == 576 * V * (l_sys + 2)


def test_the_switch_is_not_part_of_the_oracle_interface():
    """Attack code written against Oracle (what a live API offers) cannot reach a logit bias."""
    assert not hasattr(Oracle, "top1_logit_bias") and hasattr(Simulator, "top1_logit_bias")


def test_logit_matrix_marks_unresolvable_entries():
    # t = 2: no shift (p = 0), t = 3: p < 0, t = 4: p ~ 3e-15, 1 % of which is below the resolution
    y_biased = np.array([[np.nan, -1.0 + 1e-3, -1.0, -1.0 - 1e-3, -1.0 + 2e-15]])
    Q = logit_matrix(np.array([0]), np.array([-1.0]), y_biased)
    assert Q[0, 0] == 0.0 and np.isfinite(Q[0, 1]) and np.isnan(Q[0, 2:]).all()
    assert np.isfinite(logit_matrix(np.array([0]), np.array([-1.0]), y_biased, rtol=1.0)[0, 4])
    assert Q[0, 1] == pytest.approx(np.log(np.expm1(-1e-3) / np.expm1(-1.0)) + 1.0)
    assert singular_values(np.array([[1.0, np.nan, 2.0, 0.0], [0.0, 1.0, 1.0, 3.0]])).size == 2


def test_cost_overhead_takes_the_cheapest_budget_reaching_the_target():
    tokens, N = np.array([1e9, 3e9, 1e10, 3e10]), np.array([1e4, 3e4, 1e5, 3e5])
    out = cost_overhead(tokens, np.array([np.nan, 0.5, 0.25, 0.1]), N, carlini_tokens=10**8)
    assert (out["tokens"], out["N"], out["rel_error"]) == (10**10, 10**5, 0.25)
    assert out["ratio"] == 100.0 and out["lower_bound"] is None
    out = cost_overhead(tokens, np.array([np.nan, 0.9, 0.5, 0.31]), N, carlini_tokens=10**8)
    assert out["ratio"] is None and out["lower_bound"] == 300.0 and out["max_tokens"] == 3 * 10**10
    with pytest.raises(NVError, match="equally long"):
        cost_overhead(tokens, np.zeros(2), N, 1)
    # the figure names each estimator's point (it drew the robust one's alone, unnamed; a review), a lower bound where
    # an estimator never reached the target
    from nv.plots.theory import cost_overhead as figure

    overheads = {"robust": cost_overhead(tokens, np.array([np.nan, 0.5, 0.25, 0.1]), N, 10**8),
                 "incomplete": cost_overhead(tokens, np.array([np.nan, 0.9, 0.5, 0.31]), N, 10**8)}
    ax = figure(576, overheads | {"paper": overheads["robust"]}).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["robust", "incomplete", "paper"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "the paper's range: 12-190x (23 configurations)", "robust: 100x at N = 100,000",
        "incomplete: rel. error <= 30% not reached, > 300x", "paper's detector: 100x at N = 100,000"]
    (arrow,) = ax.texts  # the lower bound's upward arrow is drawn: its tip inside the axes
    assert arrow.xy == (1, 1200.0) and ax.get_ylim()[1] >= 1200 and arrow.get_annotation_clip() is False
    with pytest.raises(NVError, match="at least one estimator"):
        figure(576, {})


def test_bad_input(sim):
    with pytest.raises(NVError, match="negative logit bias"):
        recover_probs(np.zeros(1), np.zeros((1, 1)), bias=0.0)
    with pytest.raises(NVError, match="token ids"):
        sim.top1_logit_bias(PROMPTS[:1], np.array([sim.vocab_size]))
    with pytest.raises(NVError, match="1-D array"):
        sim.top1_logit_bias(PROMPTS[:1], np.array([0.5]))
    with pytest.raises(NVError, match="finite"):
        sim.top1_logit_bias(PROMPTS[:1], np.array([1]), bias=-np.inf)
    with pytest.raises(NVError, match="n > d prompts"):
        carlini_attack(sim, PROMPTS[:1])
    with pytest.raises(NVError, match="two singular values"):
        largest_gap(np.array([1.0]))
