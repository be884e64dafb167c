"""Budget planner for phase 1 (issue 14): from a cheap pilot, the expected common-set size mu(N) of the full attack
and the N at which it reaches a target, with the mean formula of §5.2 and App. F (Step 1 of Theorem 1's proof)

    mu(N) = sum_i prod_q (1 - (1 - p_q^(i))^N),

where p_q^(i) is unknown for most (prompt, token) pairs. The pilot (D_0 prompts, N_0 calls each) returns the exact
log-prob y_q^(i) of every token it drew. Model: across prompts, token i's log-probability is Normal(m_i, s_i^2)
(logits are sums of many terms over a random prompt). Token i's pilot record is censored by sampling itself: prompt q
shows y_q^(i) only if one of its N_0 draws hit v_i, which happens with probability 1 - (1 - p)^{N_0} -- a factor
that depends on the observed p alone, not on (m_i, s_i). So the likelihood of (m_i, s_i) is

    prod_{q observed} phi(y_q^(i); m_i, s_i) * I(m_i, s_i; N_0)^{D_0 - k_i},   I(m, s; N) = E_x[(1 - e^x)^N],

x ~ Normal(m, s^2): the observed values' density times the probability of missing the token in the other prompts.
It is maximised on a grid of (m, s), from the sufficient statistics k_i, sum y, sum y^2 of each token. Prompts are
independent, so mu(N) over D prompts is sum_i (1 - I(m_i, s_i; N))^D. Tokens the pilot saw in fewer than
``min_seen`` prompts are left out (a lower bound on mu, tight where they are too rare to matter).

y is the log-prob of the distribution sampled, log_softmax(z / tau); a pilot of raw log-probs, log_softmax(z) at tau
!= 1 (llama.cpp, vLLM's default), is told apart by its draws and converted first (``fit``, ``as_processed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy import optimize

from nv.errors import NVError
from nv.phase1.sampling import ENTRY_BYTES, SampledMatrix, head, manifest, observed_mask, thinned_folder

M_GRID = np.linspace(-25.0, 0.0, 251)  # m_i: mean log-probability across prompts
S_GRID = np.geomspace(0.05, 5.0, 41)  # s_i: its spread across prompts
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(40)  # E over Normal(0, 1) by Gauss-Hermite quadrature
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


def miss_probability(m: np.ndarray, s: np.ndarray, N: float) -> np.ndarray:
    """I(m, s; N) = E[(1 - e^x)^N], x ~ Normal(m, s^2) clipped just below 0: the chance that N draws of one prompt miss a
    token whose log-prob is Normal(m, s^2) across prompts."""
    x = np.minimum(np.asarray(m)[..., None] + np.asarray(s)[..., None] * _NODES, -1e-12)
    return np.exp(N * np.log1p(-np.exp(x))) @ _WEIGHTS


@dataclass(frozen=True)
class TokenModel:
    """Fitted (m_i, s_i) of every token the pilot saw in at least ``min_seen`` prompts; ``D0``, ``N0`` the pilot."""

    m: np.ndarray
    s: np.ndarray
    seen: np.ndarray
    D0: int
    N0: int
    tokens_left_out: int
    logprobs: str  # the pilot's log-probs as served: "processed" (its draws' own) or "raw" (converted, ``fit``)

    def expected_common(self, N: float | np.ndarray, D: int) -> np.ndarray:
        """mu(N) for D fresh prompts like the pilot's: sum_i (1 - I(m_i, s_i; N))^D."""
        Ns = np.atleast_1d(np.asarray(N, dtype=np.float64))
        with np.errstate(divide="ignore"):  # a token missed for sure: log(0) = -inf, presence exp(-inf) = 0
            mu = np.array([np.sum(np.exp(D * np.log1p(-miss_probability(self.m, self.s, n)))) for n in Ns])
        return mu if np.ndim(N) else float(mu[0])

    def expected_distinct(self, N: float | np.ndarray) -> float | np.ndarray:
        """The distinct tokens one prompt like the pilot's draws in N calls, sum_i (1 - I(m_i, s_i; N)): its row's
        entries of Y_hat (D times it the sample's, ``ENTRY_BYTES`` each on disk). The tokens left out are not counted,
        as in mu, so it errs low at large N (README, planner: +1.1 % to -3.7 % on SmolLM2 and the 0.5B, up to 30x the
        pilot's N)."""
        Ns = np.atleast_1d(np.asarray(N, dtype=np.float64))
        out = np.array([np.sum(1.0 - miss_probability(self.m, self.s, n)) for n in Ns])
        return out if np.ndim(N) else float(out[0])

    def samples_for(self, target: float, D: int, N_max: float = 1e9) -> float | None:
        """The N at which mu(N) reaches ``target`` (bisection on log N); None when even N_max does not."""
        if self.expected_common(N_max, D) < target:
            return None

        def short(log_N: float) -> float:  # log mu(N) - log target, increasing in N
            return math.log(max(self.expected_common(math.exp(log_N), D), 1e-300)) - math.log(target)

        if short(0.0) >= 0:
            return 1.0
        return math.exp(optimize.brentq(short, 0.0, math.log(N_max), xtol=1e-3))


def disk_bytes(model: TokenModel, D: int, rounds: list[int], adaptive: bool = False) -> dict[str, float]:
    """Disk taken by the draws of D prompts, at ``ENTRY_BYTES`` an entry of D x ``expected_distinct``: ``sample``, the
    stored Y_hat at ``rounds[-1]``; ``peak``, the most on disk at once. A fixed N (one round, not ``adaptive``) writes
    the sample alone. The adaptive loop (``nv.phase1.adaptive``; ``rounds``: its cumulative N) peaks at its last
    round: every round's own draws (kept for a rerun), the merged sample, and beside it the one merged before it
    (while it is written; round 1 merges into round 0's own folder) or the check's copy thinned to N / sqrt 2 (written
    after that one is removed), whichever is larger; a single round's output is copied from its own folder. It
    assumes the rounds as planned: a saturated round whose check fails is followed by a sqrt 2 step, one more round's
    draws. From ``expected_distinct``, so it errs low as that does."""
    def size(N: float) -> float:
        return D * ENTRY_BYTES * model.expected_distinct(N)

    sample = size(rounds[-1])
    if not adaptive:
        return {"sample": sample, "peak": sample}
    own = sum(size(b - a) for a, b in zip([0, *rounds[:-1]], rounds))
    check = size(rounds[-1] / math.sqrt(2))
    if len(rounds) == 1:  # the check beside round 0's folder, then the output copied from it
        return {"sample": sample, "peak": own + max(check, sample)}
    before = size(rounds[-2]) if len(rounds) > 2 else 0.0
    return {"sample": sample, "peak": own + sample + max(before, check)}


FREQUENT = 30.0  # expected draws N_0 e^y of an entry that ``draws_over_expected`` compares
AGREEMENT = (0.8, 1.25)  # observed / expected draws of those entries for a pilot the model describes
MIN_CHECKED = 20  # fewer such entries cannot tell whether the pilot's log-probs are its draws' (nv attack refuses it)


def draws_over_expected(pilot: SampledMatrix) -> tuple[float, int]:
    """The model's premise, checked on the pilot: its draws follow its log-probs, p = e^y. Over the entries expected
    ``FREQUENT`` times or more (N_0 e^y >= 30; all but surely drawn, so the selection does not depend on the counts),
    sum of counts / sum of N_0 e^y, ~1 (within a few %) where it holds, and their number. It does not hold for raw
    log-probs at tau != 1 (log_softmax(z), llama.cpp and vLLM's default, while the draws follow softmax(z / tau)) nor
    for counts that are top-k reveals (``live.top_logprobs`` > 0)."""
    counts, logp = pilot.counts.tocoo(), pilot.logprobs.tocsr()
    y = np.asarray(logp[counts.row, counts.col], dtype=np.float64).ravel()
    expected = pilot.N * np.exp(np.where(np.isfinite(y), y, -np.inf))
    frequent = expected >= FREQUENT
    n = int(np.count_nonzero(frequent))
    return (float(counts.data[frequent].sum() / expected[frequent].sum()) if n else np.nan), n


def _agrees(pilot: SampledMatrix) -> tuple[bool, float, int]:
    ratio, n = draws_over_expected(pilot)
    return n < MIN_CHECKED or AGREEMENT[0] <= ratio <= AGREEMENT[1], ratio, n


def log_normaliser(y_tau: np.ndarray, counts: np.ndarray, N: int) -> float:
    """log Z_tau of one prompt from its drawn entries' raw log-probs scaled by the temperature, y_tau = y / tau, and
    counts: the root of sum_i E[c_i | c_i >= 1] = sum_i c_i with p_i = exp(y_tau_i - log Z) and E[c | c >= 1] =
    N p / (1 - (1 - p)^N), the count of a token given that it was drawn (every drawn entry counts, the rare ones
    too, without the bias of taking them as if they had not been selected by being drawn). +inf where every entry was
    drawn once (no root: nothing fixes Z). A withheld log-prob (NaN) takes no part."""
    y_tau, c = np.asarray(y_tau, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    shown = np.isfinite(y_tau)
    y_tau, c = y_tau[shown], c[shown]
    if not shown.any():
        return np.inf

    def excess(log_Z: float) -> float:
        p = np.exp(np.minimum(y_tau - log_Z, -1e-12))
        return float(np.sum(N * p / -np.expm1(N * np.log1p(-p))) - c.sum())

    top = float(y_tau.max())
    if excess(top) <= 0:  # every call drew the top token (one entry): p = 1 there
        return top
    if excess(top + 60.0) >= 0:
        return np.inf
    return optimize.brentq(excess, top, top + 60.0, xtol=1e-6)


def as_processed(pilot: SampledMatrix) -> SampledMatrix:
    """The pilot's raw log-probs y = log_softmax(z) turned into its draws' log_softmax(z / tau) = y / tau - log Z_tau,
    Z_tau per prompt from its counts (``log_normaliser``); a prompt whose Z is not fixed (every token drawn once) is
    left out."""
    logp, counts = pilot.logprobs.tocsr(), pilot.counts.tocsr()
    data = logp.data.astype(np.float64) / pilot.temperature
    log_Z = np.full(pilot.D, np.inf)
    for q in range(pilot.D):
        row = slice(logp.indptr[q], logp.indptr[q + 1])
        log_Z[q] = log_normaliser(data[row], counts.data[row], pilot.N)
        data[row] -= log_Z[q]
    converted = sp.csr_matrix((data.astype(logp.dtype), logp.indices, logp.indptr), shape=logp.shape)
    rows = np.flatnonzero(np.isfinite(log_Z))
    return SampledMatrix(converted[rows], counts[rows], pilot.prompt_tokens[rows], pilot.N, pilot.temperature)


def fit(pilot: SampledMatrix, min_seen: int = 3) -> TokenModel:
    """Maximum-likelihood (m_i, s_i) per token from the pilot's exact log-probs (module docstring). The pilot's
    log-probs are taken as its draws' (``processed``) where its frequent entries were drawn as often as they say
    (``draws_over_expected`` within ``AGREEMENT``, or too few such entries, under 20, to tell), else as raw
    log_softmax(z) and converted (``as_processed``), and refused where neither holds."""
    if pilot.D < 2 * min_seen:
        raise NVError(f"a pilot of {pilot.D} prompts is too small to fit the tail: use at least {2 * min_seen}")
    mode = "processed"
    agrees, ratio, n = _agrees(pilot)
    if not agrees:
        converted = as_processed(pilot)
        if not _agrees(converted)[0]:
            raise NVError(f"the pilot's draws follow neither its log-probs ({ratio:.2f}x the draws e^y predicts over its "
                          f"{n} most frequent entries) nor raw log-probs at tau = {pilot.temperature:g}: the planner needs "
                          "a pilot of one sampled token and its log-prob per call")
        pilot, mode = converted, "raw"
    counts = pilot.counts.tocsc()
    logp = pilot.logprobs.tocsc()
    k = np.diff(counts.indptr)
    keep = np.flatnonzero(k >= min_seen)
    if keep.size == 0:
        raise NVError(f"no token was drawn in {min_seen} pilot prompts: raise the pilot's N")
    y = logp.astype(np.float64)
    sy = np.asarray(y.sum(axis=0)).ravel()[keep]
    syy = np.asarray(y.multiply(y).sum(axis=0)).ravel()[keep]
    kk = k[keep].astype(np.float64)
    mm, ss = np.meshgrid(M_GRID, S_GRID, indexing="ij")
    log_miss = np.log(np.maximum(miss_probability(mm.ravel(), ss.ravel(), pilot.N), 1e-300))  # (grid,)
    m, s = mm.ravel(), ss.ravel()
    # log L = -k log s - (syy - 2 m sy + k m^2) / (2 s^2) + (D0 - k) log I(m, s; N0), for every token x grid point
    best_ll = np.full(keep.size, -np.inf)
    best = np.zeros(keep.size, dtype=np.int64)
    for j0 in range(0, m.size, 512):  # grid in chunks: tokens x 512 at a time
        mj, sj, lj = m[j0:j0 + 512], s[j0:j0 + 512], log_miss[j0:j0 + 512]
        ll = (-kk[:, None] * np.log(sj) - (syy[:, None] - 2 * mj * sy[:, None] + kk[:, None] * mj**2) / (2 * sj**2)
              + (pilot.D - kk)[:, None] * lj)
        arg = ll.argmax(axis=1)
        better = ll[np.arange(keep.size), arg] > best_ll
        best_ll[better] = ll[np.arange(keep.size), arg][better]
        best[better] = j0 + arg[better]
    return TokenModel(m[best], s[best], keep, pilot.D, pilot.N, int(np.count_nonzero((k > 0) & (k < min_seen))), mode)


def pilot_of(folder: str | Path, prompts: int, N: int, seed: int) -> SampledMatrix:
    """The pilot inside the full sample stored in ``folder``: its first ``prompts`` prompts and the first N calls of
    each (what a pilot run of that size would have drawn), read from the shards holding them alone (``head``)."""
    return head(folder, prompts, min(N, manifest(folder)["N"]), seed)


def strict_common_size(mask: sp.csr_matrix) -> int:
    """|C| before pruning: tokens drawn under every prompt of an observation mask (``observed_mask``)."""
    return int(np.count_nonzero(np.bincount(mask.indices, minlength=mask.shape[1]) == mask.shape[0]))  # no CSC copy


def check(model: TokenModel, folder: str | Path, budgets: list[int], seed: int) -> list[dict]:
    """The prediction against the full sample stored in ``folder`` at each budget N (nested draws, each thinned from
    disk and only its observation mask read): measured and predicted |C| over all D prompts, the N the planner
    would have asked for to get the measured |C| (``N_ratio`` = that / N), and the distinct tokens a prompt drew
    (the sample's size: ``TokenModel.expected_distinct``), measured and predicted."""
    meta, rows = manifest(folder), []
    for N in sorted(b for b in budgets if b <= meta["N"]):
        with thinned_folder(folder, N, seed) as at:
            mask = observed_mask(at)
            measured, distinct = strict_common_size(mask), mask.nnz / meta["D"]
            del mask
        N_pred = model.samples_for(measured, meta["D"]) if measured else None
        rows.append({"N": N, "D": meta["D"], "measured_C": measured, "predicted_C": model.expected_common(N, meta["D"]),
                     "N_predicted": N_pred, "N_ratio": None if N_pred is None else N_pred / N,
                     "measured_distinct": distinct, "predicted_distinct": model.expected_distinct(N)})
    return rows


def summarise(model: str, d_true: int, budget: dict, pilot: SampledMatrix, tail: TokenModel, stop_N: float,
              adaptive_stop_N: float) -> dict:
    """One model's planner row: the pilot's size and share of the full sample (``budget``: its
    ``SampledMatrix.budget``), the N (and tokens) the planner asks for |C| >= d, and the measured stops against it:
    ``stop_N`` (the budget sweep's first exact budget) and ``adaptive_stop_N`` (where ``sampling.N: auto`` stops on
    the same draws: its own run, or its loop replayed on them; NaN for either where there is none). ``d_true`` is the
    target only the evaluation knows."""
    N_for_d = tail.samples_for(d_true, budget["D"]) or np.nan
    return {"model": model, "d_true": d_true, "D": budget["D"], "pilot_prompts": pilot.D, "pilot_N": pilot.N,
            "pilot_tokens": pilot.tokens(), "pilot_share": pilot.tokens() / budget["tokens"], "tokens_fitted": tail.m.size,
            "tokens_left_out": tail.tokens_left_out, "N_for_d": N_for_d, "tokens_for_d": budget["tokens"] / budget["N"] * N_for_d,
            "stop_N": stop_N, "adaptive_stop_N": adaptive_stop_N,
            "stop_over_N_for_d": stop_N / N_for_d, "adaptive_stop_over_N_for_d": adaptive_stop_N / N_for_d}


CURVE_TOP = 3e6  # the figure's mu(N) curve runs from a third of the pilot's N to here


def stable_stops(adaptive: list[dict]) -> dict[str, float]:
    """Where ``sampling.N: auto`` stopped, per model, from the exactness stage's ``adaptive`` records (a stop at
    the draws' cap is no stop)."""
    return {s["model"]: s["N"] for s in adaptive if s["stop"] == "stable"}


def against_run(run, budgets: list[int], planner: dict, seed: int, adaptive_stop_N: float
                ) -> tuple[list[dict], dict, tuple[np.ndarray, np.ndarray]]:
    """The planner stage on one model's phase-1 run (``nv.outputs.Phase1Run``): the pilot (the first
    ``pilot_prompts`` prompts x ``pilot_N`` calls of its stored sample) fitted; ``check``'s rows at ``budgets`` with
    the budget sweep's pruned D' and |C| beside them; ``summarise``'s row, with the sweep's first exact budget (a
    robust row whose d_hat_raw lies in the detector's interval, ``covered``) as ``stop_N``; and mu(N) for the
    figure."""
    import pandas as pd

    from nv.phase1.sampling import sample_budget

    budget = sample_budget(run.samples)
    pilot = pilot_of(run.samples, planner["pilot_prompts"], planner["pilot_N"], seed)
    tail = fit(pilot, planner["min_seen"])
    sweep = pd.read_csv(run.sweep)
    robust = sweep[sweep.method == "robust"].set_index("N")
    rows = [r | {"model": run.spec, "pruned_D": robust.D_prime.get(r["N"]), "pruned_C": robust.C.get(r["N"])}
            for r in check(tail, run.samples, budgets, seed)]
    exact = robust[robust.d_hat_raw.notna() & robust.covered.astype(bool)]
    grid = np.geomspace(planner["pilot_N"] / 3, CURVE_TOP, 60)
    row = summarise(run.spec, run.d_true, budget, pilot, tail, stop_N=exact.index.min() if len(exact) else np.nan,
                    adaptive_stop_N=adaptive_stop_N)
    return rows, row, (grid, tail.expected_common(grid, budget["D"]))
