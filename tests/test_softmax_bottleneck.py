"""The softmax bottleneck on the real model (SmolLM2-135M, d = 576), through the real spectral estimators.

White box: full log-prob rows have rank d (row-centred), and `nv.phase1.spectrum.robust` finds the drop.
Black box: the whole phase-1 pipeline (`nv.phase1.pipeline.run`: prompt search, sampling, greedy pruning,
both estimators, report) on the simulator at the smallest budget that saturates with float32 logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from nv.oracle import Simulator
from nv.phase1.pipeline import common_set, estimate_both, run
from nv.phase1.sampling import load_samples
from nv.phase1.search import random_prompts
from nv.phase1.spectrum import robust, snap

D_TRUE = 576


@pytest.fixture(scope="module")
def sim(lm32):
    """The simulator with float32 logits (bf16 rounding blurs the drop at d: README, Phase 1)."""
    return Simulator(lm32, logits="float32", batch_size=64)


def test_full_logprob_matrix_drops_at_the_hidden_dimension(sim):
    prompts = random_prompts(np.random.default_rng(0), 700)
    Y = sim.log_probs(prompts)  # 700 x 49152, white-box
    est = robust(Y)  # the project's estimator: row-centring, float64 Gram, scored log-gaps
    assert (est.method, est.saturated, est.reason) == ("robust", True, "ok")
    assert (est.d_hat_raw, est.d_hat) == (D_TRUE, D_TRUE)
    sigma = est.diagnostics["sigma"]
    assert sigma.size == 700 and sigma[D_TRUE - 1] / sigma[D_TRUE] > 50  # the drop itself, not just its score
    assert est.diagnostics["z"][D_TRUE - 1] > 10 * 8  # z = 353 measured; z_min = 8: no borderline call


# The smallest budget measured to saturate robustly (float32 logits, tau = 2, random prompts): at D = 700 prompts,
# N = 5e4 samples per prompt gave common sets of ~650 x ~850 and z ~ 170-220 in four draws; N = 4e4 gave
# ~645 x ~645 (too close to d), N = 3e4 ~540 x ~540 (< d: not saturated), and D = 650 left D' ~ 610.
BUDGET = {"D": 700, "N": 50_000}


@pytest.fixture(scope="module")
def phase1(sim, root, tmp_path_factory):
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["model"]["logits"] = "float32"
    params["search"].update(mode="diverse", D=BUDGET["D"], rounds=1, batch_size=BUDGET["D"])
    params["sampling"].update(N=BUDGET["N"], temperature=2.0, chunk=100)
    out = tmp_path_factory.mktemp("phase1")
    before = sim.cost.calls
    record = run(sim, params, out, "embedded", d_true=D_TRUE, progress=False)
    return {"record": record, "out": out, "params": params, "calls": sim.cost.calls - before}


def test_phase1_pipeline_recovers_the_hidden_dimension(phase1):
    record = phase1["record"]
    assert json.loads((phase1["out"] / "report.json").read_text()) == record
    assert (record["estimator"], record["saturated"], record["reason"]) == ("robust", True, "ok")
    assert abs(record["d_hat_raw"] - D_TRUE) <= 3 and record["d_hat"] == snap(record["d_hat_raw"], phase1["params"]["spectrum"]["robust"]["g"])
    assert record["lower_bound"] is None and record["rel_error"] <= 3 / D_TRUE
    # the common set is larger than d on both sides (else no drop at d could be seen) and well below D x |V|
    assert D_TRUE < record["D_prime"] <= BUDGET["D"] and D_TRUE < record["common_set_size"] < 5000
    assert (record["D"], record["N"], record["temperature"]) == (BUDGET["D"], BUDGET["N"], 2.0)
    assert record["calls"] == BUDGET["D"] + BUDGET["D"] * BUDGET["N"] == phase1["calls"]  # search + sampling


def test_phase1_below_that_budget_is_a_lower_bound_not_a_guess(phase1):
    """The same samples thinned to their first 2e4 calls per prompt (as the budget sweep does): the common set
    is smaller than d, so no drop at d can exist, and the robust estimator must say so instead of guessing."""
    sampled = load_samples(phase1["out"] / "samples").subsample(20_000, seed=0)
    common = common_set(sampled)
    assert min(common.Y.shape) <= D_TRUE
    est = estimate_both(common.Y, phase1["params"]["spectrum"])["robust"]
    assert (est.saturated, est.reason, est.d_hat) == (False, "not saturated", None)
    assert 0 < est.lower_bound < D_TRUE
