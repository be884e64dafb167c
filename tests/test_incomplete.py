"""The missing-data estimator (nv.phase1.incomplete) on synthetic Y_hat of known rank, sampled like the real one."""

import numpy as np
import pytest

from nv.errors import NVError
from nv.phase1 import incomplete
from nv.phase1.pipeline import common_set
from nv.phase1.spectrum import robust
from synthetic import incomplete_sample


@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_the_rank_where_the_complete_block_cannot(seed):
    S = incomplete_sample(seed=seed)
    common = common_set(S).Y
    on_common = robust(common)
    assert not on_common.saturated  # the common block's tail is under the bf16 floor
    anchor = incomplete.anchor(on_common, common.shape)
    assert anchor == on_common.lower_bound  # the Gavish-Donoho count of the common block
    assert 0 < anchor < 60
    e = incomplete.estimate(S, anchor)
    assert e.method == "incomplete" and e.saturated and e.d_hat_raw == 60 and e.d_hat == 64
    assert e.diagnostics["shape"][1] > 5 * common.shape[1]  # the block uses columns the common set dropped
    rungs = e.diagnostics["rungs"]
    assert len(rungs) == 2 and all(r.d_hat_raw == 60 and r.k < 60 and r.far_drops == 0 for r in rungs)


def test_pure_noise_is_not_saturated_and_keeps_the_anchor():
    e = incomplete.estimate(incomplete_sample(noise_only=True), 40)
    assert not e.saturated and e.d_hat_raw is None and e.lower_bound == 40
    assert [r.k for r in e.diagnostics["rungs"]] == [32]  # 0.8 x 40; no answer, and the one rung left cannot agree
    capped = incomplete.estimate(incomplete_sample(noise_only=True), 40, rungs=(0.95, 1.0))
    assert not capped.saturated and [r.k for r in capped.diagnostics["rungs"]] == [34]  # 6 below the anchor


def test_too_few_draws_is_not_saturated():
    """At N = 1,500 the columns most prompts drew are few and the anchor small: the ladder says so, no number."""
    S = incomplete_sample(N=1500)
    common = common_set(S).Y
    e = incomplete.estimate(S, incomplete.anchor(robust(common), common.shape))
    assert not e.saturated and e.lower_bound < 60


def test_a_nearly_complete_block_without_a_floor_gives_no_number(tmp_path):
    """The toy LM (rank 12, 300 tokens, exact log-probs) at 40 and 80 prompts x 16,000 calls: ~0.08 % of the block
    missing. The residual signal those few entries erase is of low rank, with a drop of its own past the true 12 (19
    at 40 prompts on both rungs before the guards); with fewer missing entries than min(D, C) no rung runs: not
    saturated, never wrong. A rung run there all the same (k = 6) shows the low-rank erasure's drop."""
    from nv.phase1.sampling import collect, load_samples
    from synthetic import LowRankOracle

    oracle = LowRankOracle()
    for D in (40, 80):
        S = load_samples(collect(oracle, [f"prompt {q}" for q in range(D)], 16_000, 2.0, 0, tmp_path / f"s{D}", 300,
                                 tmp_path / "ck", {"m": "toy"}, 40, False))
        common = common_set(S).Y
        on_common = robust(common, g=8)
        assert on_common.d_hat_raw == oracle.rank  # complete enough for the common block itself
        e = incomplete.estimate(S, incomplete.anchor(on_common, common.shape), g=8)
        assert e.diagnostics["observed"] > 0.999 and 0 < e.diagnostics["missing"] < D
        assert not e.saturated and e.diagnostics["rungs"] == [] and e.lower_bound <= oracle.rank
    b = incomplete.block(S, 0.6)
    L, _, _ = incomplete.strong_fit(b, 6, 0.005, 300)
    sigma = incomplete.residual_singular_values(b, L, 6)
    assert sigma[7] < sigma[6] / 5  # the strong part's last direction (rank 13 uncentred: 7 past k = 6) ...
    assert (sigma[7:] > sigma[6] / 100).sum() >= 8  # ... then the erasures' own spectrum, well above the float floor


def test_block_keeps_the_observed_entries_exactly():
    S = incomplete_sample(N=3000)
    b = incomplete.block(S, 0.6)
    dense = S.logprobs[:, b.columns].toarray()
    seen = S.counts[:, b.columns].toarray() > 0
    assert np.array_equal(b.M, seen) and b.X.dtype == np.float32 and np.array_equal(b.X[seen], dense[seen])
    assert (b.q >= 0.6).all() and np.allclose(b.q, seen.mean(axis=0))
    with pytest.raises(NVError, match="frac"):
        incomplete.block(S, 0.0)


def test_outcome_judges_its_lower_bound_like_the_robust_one():
    from nv.phase1.exactness import outcome
    from nv.phase1.spectrum import SpectrumEstimate

    def est(lower):
        return SpectrumEstimate("incomplete", False, None, None, 64, lower, "not saturated", {})

    assert outcome(est(50), 60) == "not saturated" and outcome(est(70), 60) == "wrong"


def test_a_report_headlines_the_missing_data_estimate_where_the_robust_one_abstains():
    from nv.phase1.pipeline import report
    from nv.phase1.spectrum import SpectrumEstimate

    budget = {"D": 400, "N": 6000, "temperature": 2.0, "tokens": 10**7, "calls": 2.4 * 10**6}
    none = {"sigma": np.empty(0)}
    paper = SpectrumEstimate("paper", False, None, None, 128, None, "no saddle", none)
    abstains = SpectrumEstimate("robust", False, None, None, 64, 40, "not saturated", none)
    found = SpectrumEstimate("incomplete", True, 60, 64, 64, None, "ok", {"shape": (400, 900), "rungs": []})
    unsure = SpectrumEstimate("incomplete", False, None, None, 64, 40, "not saturated", {"shape": (400, 900), "rungs": []})
    exact = SpectrumEstimate("robust", True, 59, 64, 64, None, "ok", none)

    def said(robust, incomplete, method="robust"):
        r = report("m", 60, budget, (300, 200), {"robust": robust, "paper": paper, "incomplete": incomplete}, method)
        return r["estimator"], r["d_hat_raw"], r["lower_bound"], r["d_hat_incomplete_raw"]

    assert said(abstains, found) == ("incomplete", 60, None, 60)
    assert said(abstains, unsure) == ("robust", None, 40, None)  # neither answers: robust's bound, the ladder's anchor
    assert said(exact, found) == ("robust", 59, None, 60)  # robust answers: it stays the headline
    assert said(abstains, found, "paper")[:2] == ("paper", None)  # another headline is never replaced
