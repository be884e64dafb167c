"""The top-1 logit-bias attack of Carlini et al. (2024), the §5 baseline (§4.1 box, left).

Stage 1: per prompt q, the top token r and y_top; per token t != r, the top log-prob y'_top of a
call with logit bias b = -1 on t, inverted to p_q^(t) = (exp(y_top - y'_top) - 1)/(1/e - 1) and the
logit z_q^(t) = log p_q^(t) - y_top. Stage 2: Q (n x |V|) with Q_{q,t} = z_q^(t) (0 in the top
column: z_q^(r) = y_top - y_top). Stage 3: the singular values of Q and d_hat at the largest gap.

Rank: z_q^(t) = z_t - z_r is the logit matrix Z = H W^T (rank d) shifted by a per-row constant,
so Q has rank d + 1 in general (the softmax offset), and the row-centred Q = Z (I - 11^T/|V|)
has rank <= d exactly. Q is therefore row-centred by default, as the robust estimator centres Y.

The bias switch exists only on the simulator (``Simulator.top1_logit_bias``); the APIs of the
paper's threat model, and the HTTP backend, have none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nv.errors import NVError
from nv.phase1.spectrum import centred_singular_values, gram_eigenvalues

if TYPE_CHECKING:
    from nv.oracle.simulator import Simulator


def recover_probs(y_top: np.ndarray, y_top_biased: np.ndarray, bias: float = -1.0) -> np.ndarray:
    """p_q^(t) = (exp(y_top - y'_top) - 1)/(e^b - 1), i.e. (... - 1)/(1/e - 1) at b = -1 (§4.1 box, line 6).

    ``y_top`` has one entry per row of ``y_top_biased`` (n x k). Both sides go through expm1.
    """
    if not bias < 0:
        raise NVError(f"the inversion needs a negative logit bias, got {bias}")
    y_top = np.asarray(y_top, dtype=np.float64)[:, None]
    return np.expm1(y_top - np.asarray(y_top_biased, dtype=np.float64)) / np.expm1(bias)


def resolution(y_top_biased: np.ndarray, bias: float = -1.0) -> np.ndarray:
    """Absolute error bound of the recovered p: 4 eps max(1, |y'_top|) / (1 - e^b).

    The returned y'_top is a float64 near y_top, rounded to ~eps |y'_top|; the inversion divides
    that by 1 - e^b. Probabilities near or below it (~1e-15) cannot be recovered.
    """
    return 4 * np.finfo(np.float64).eps * np.maximum(1.0, np.abs(y_top_biased)) / -np.expm1(bias)


def logit_matrix(
    top: np.ndarray, y_top: np.ndarray, y_top_biased: np.ndarray, bias: float = -1.0, rtol: float = 1e-2
) -> np.ndarray:
    """Q_{q,t} = log p_q^(t) - y_top (§4.1 box, lines 7 and 9); 0 in each row's top column r_q.

    Entries recovered to a relative precision worse than ``rtol`` (p < resolution / rtol) are NaN:
    their log-errors would otherwise raise the noise floor of the spectrum tenfold or more.
    """
    y_top_biased = np.asarray(y_top_biased, dtype=np.float64)
    p = recover_probs(y_top, y_top_biased, bias)
    with np.errstate(divide="ignore", invalid="ignore"):
        Q = np.log(p)
    Q[~(p >= resolution(y_top_biased, bias) / rtol)] = np.nan
    Q -= np.asarray(y_top, dtype=np.float64)[:, None]
    Q[np.arange(Q.shape[0]), top] = 0.0
    return Q


def singular_values(Q: np.ndarray, centre: bool = True) -> np.ndarray:
    """sigma_1 >= sigma_2 >= ... of Q over its NaN-free columns: row-centred as phase 1's spectrum
    (nv.phase1.spectrum.centred_singular_values) when ``centre``, else of Q itself.

    Computed as sqrt of the float64 Gram eigenvalues (nv.phase1.spectrum.gram_eigenvalues): accurate for
    sigma_i >~ 1e-8 sigma_1, below the noise floor of float32 logits (~6e-8 sigma_1 on the embedded
    model) and far below that of bf16 logits.
    """
    Q = np.asarray(Q, dtype=np.float64)
    Q = Q[:, ~np.isnan(Q).any(axis=0)]
    return centred_singular_values(Q)[0] if centre else np.sqrt(gram_eigenvalues(Q))


def largest_gap(sigma: np.ndarray) -> int:
    """d_hat = argmax_i sigma_i / sigma_{i+1} (1-based; §4.1 box, line 12)."""
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.ndim != 1 or sigma.size < 2 or sigma[0] <= 0:
        raise NVError("need at least two singular values, the largest positive")
    return int(np.argmax(sigma[:-1] / np.maximum(sigma[1:], np.finfo(float).tiny))) + 1


def carlini_cost(n: int, V: int, l_sys: int, l_in: int = 1) -> int:
    """Tokens of the attack (§5): n |V| calls of l_sys + l_in input tokens and one output token.

    With n = d and one input token this is the paper's d |V| (l_sys + 2).
    """
    return int(n) * int(V) * (int(l_sys) + int(l_in) + 1)


def system_tokens(sim: Simulator) -> int:
    """l_sys: what one call costs beyond its input (default system prompt + chat template)."""
    return sim.format.prompt_tokens("")


@dataclass
class CarliniResult:
    """One run of the attack: d_hat, the spectrum, Q, and its cost (realized and by formula)."""

    d_hat: int
    sigma: np.ndarray
    Q: np.ndarray
    resolved_tokens: int
    l_sys: int
    cost: dict
    formula_tokens: int

    def summary(self) -> dict:
        """JSON-ready scalars."""
        n, V = self.Q.shape
        return {"d_hat": self.d_hat, "n_prompts": n, "vocab_size": V, "resolved_tokens": self.resolved_tokens,
                "gap_ratio": float(self.sigma[self.d_hat - 1] / self.sigma[self.d_hat]), "l_sys": self.l_sys,
                "realized": self.cost, "formula_tokens": self.formula_tokens}


def carlini_attack(
    sim: Simulator, prompts: Sequence[str], bias: float = -1.0, centre: bool = True, rtol: float = 1e-2
) -> CarliniResult:
    """The whole attack over all of V through the simulator's bias switch (§4.1 box, left).

    Needs n > d distinct prompts; tokens recovered worse than ``rtol`` under some prompt are left out
    of the spectrum (``resolved_tokens`` counts the rest). ``cost`` is what the simulator charged for
    these calls (n |V| of them); ``formula_tokens`` is the paper's d |V| (l_sys + 2) at d = d_hat.
    """
    if len(prompts) < 2:
        raise NVError(f"the attack needs n > d prompts, got {len(prompts)}")
    before = sim.cost.as_dict()
    top, y_top, y_biased = sim.top1_logit_bias(prompts, np.arange(sim.vocab_size), bias)
    after = sim.cost.as_dict()
    Q = logit_matrix(top, y_top, y_biased, bias, rtol)
    del y_biased
    sigma = singular_values(Q, centre)
    d_hat = largest_gap(sigma)
    l_sys = system_tokens(sim)
    return CarliniResult(
        d_hat=d_hat,
        sigma=sigma,
        Q=Q,
        resolved_tokens=int(np.count_nonzero(~np.isnan(Q).any(axis=0))),
        l_sys=l_sys,
        cost={k: after[k] - before[k] for k in after},
        formula_tokens=carlini_cost(d_hat, sim.vocab_size, l_sys),
    )


def cost_overhead(tokens: np.ndarray, rel_error: np.ndarray, N: np.ndarray, carlini_tokens: int,
                  max_rel_error: float = 0.3) -> dict:
    """§5 cost ratio: NightVision's tokens at its smallest budget with relative error <= ``max_rel_error``
    over Carlini's d |V| (l_sys + 2) (``carlini_tokens``).

    ``tokens``, ``rel_error`` (NaN: no estimate) and ``N`` describe one budget sweep. When no budget
    reaches the target, ``ratio`` is None and ``lower_bound`` = largest budget / Carlini's cost.
    """
    tokens, rel_error, N = (np.asarray(a, dtype=np.float64) for a in (tokens, rel_error, N))
    if tokens.size == 0 or not tokens.shape == rel_error.shape == N.shape:
        raise NVError("the budget sweep needs equally long, non-empty tokens, rel_error and N")
    if not carlini_tokens > 0:
        raise NVError(f"Carlini's cost must be positive, got {carlini_tokens}")
    out = {"max_rel_error": max_rel_error, "carlini_tokens": int(carlini_tokens), "max_tokens": int(tokens.max()),
           "tokens": None, "N": None, "rel_error": None, "ratio": None, "lower_bound": None}
    reached = np.flatnonzero(rel_error <= max_rel_error)  # NaN compares False
    if reached.size == 0:
        out["lower_bound"] = float(tokens.max() / carlini_tokens)
        return out
    i = reached[np.argmin(tokens[reached])]
    ratio = float(tokens[i] / carlini_tokens)
    out.update(tokens=int(tokens[i]), N=int(N[i]), rel_error=float(rel_error[i]), ratio=ratio)
    return out
