"""Synthetic data generators (no real model): a toy LM whose logits have a known rank, for tests that need the right
answer exactly. The spectral estimators on the real SmolLM2 are tested in tests/test_softmax_bottleneck.py."""

from __future__ import annotations

import numpy as np

from nv.oracle.base import Oracle, Samples
from nv.oracle.multinomial import multinomial_counts


class LowRankOracle(Oracle):
    """A toy LM: the logits of prompt q are h_q W^T with h_q in R^R drawn from the prompt's bytes, so
    log_softmax(z / tau) has rank R + 1 and the right answer d = R is known exactly. ``sample_calls`` counts the
    prompts sampled (a resumed run must draw none twice)."""

    def __init__(self, rank: int = 12, vocab: int = 300, scale: float = 0.5):
        super().__init__()
        self.rank, self.vocab = rank, vocab
        self.W = np.random.default_rng(0).normal(scale=scale, size=(vocab, rank))
        self.sample_calls = 0

    def _logp(self, prompt: str, temperature: float) -> np.ndarray:
        z = self.W @ np.random.default_rng(list(prompt.encode())).normal(size=self.rank) / temperature
        return z - np.logaddexp.reduce(z)

    def sample(self, prompts, n, temperature, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds):
            logp = self._logp(prompt, temperature)
            counts = multinomial_counts(np.random.default_rng(seed), n, np.exp(logp))
            ids = np.flatnonzero(counts)
            out.append(Samples(ids, logp[ids].astype(np.float32), counts[ids], prompt_tokens=5))
            self.cost.charge(5, n)
            self.sample_calls += 1
        return out

    def argmax(self, prompts):
        out = []
        for prompt in prompts:
            logp = self._logp(prompt, 1.0)
            top = np.array([np.argmax(logp)])
            out.append(Samples(top, logp[top].astype(np.float32), np.ones(1, dtype=np.int64), prompt_tokens=5))
            self.cost.charge(5, 1)
        return out

    def time_request(self, prompt):
        raise NotImplementedError("the toy LM does not time")


def incomplete_logprobs(D: int = 400, V: int = 3000, rank: int = 60, tau: float = 2.0, decay: float = 30.0,
                        noise_only: bool = False, seed: int = 0) -> np.ndarray:
    """Next-token log-probs of known rank under a bf16 floor: logits = a token popularity profile + H W^T (rank
    ``rank``, column scales decaying ``decay``-fold; with ``noise_only`` i.i.d. noise instead), shifted into [16, 32)
    and rounded to bf16 (SmolLM2's floor: spacing 0.125), y = log_softmax(z / tau): a D x V array. The profile,
    shared by every prompt, is one more direction: the row-centred robust estimator counts ``rank`` + 1, the
    missing-data estimator (which takes the log-partition offset for its extra direction) ``rank``."""
    return _logprobs(np.random.default_rng(seed), D, V, rank, tau, decay, noise_only)


def _logprobs(rng, D, V, rank, tau, decay, noise_only):
    from nv.oracle.defence import round_to_format

    if noise_only:
        z = rng.normal(size=(D, V)) * 0.7
    else:
        z = (rng.normal(size=(D, rank)) * decay ** -(np.arange(rank) / (rank - 1))) @ rng.normal(size=(V, rank)).T
        z *= 0.7 / z.std()
    z = round_to_format(z + rng.normal(size=V) * 2.0 + 24.0, "bf16")
    return z / tau - np.logaddexp.reduce(z / tau, axis=1, keepdims=True)


def incomplete_sample(D: int = 400, V: int = 3000, rank: int = 60, N: int = 6000, tau: float = 2.0, decay: float = 30.0,
                      noise_only: bool = False, seed: int = 0):
    """A sampled Y_hat of ``incomplete_logprobs`` with missing entries as sampling leaves them: (q, i) observed with
    probability 1 - (1 - p_q^(i))^N, as N draws leave it. Returns a ``SampledMatrix``."""
    import scipy.sparse as sp

    from nv.phase1.sampling import SampledMatrix

    rng = np.random.default_rng(seed)
    y = _logprobs(rng, D, V, rank, tau, decay, noise_only)
    observed = rng.random(y.shape) < -np.expm1(N * np.log1p(-np.exp(y)))
    return SampledMatrix(sp.csr_matrix(np.where(observed, y, 0.0).astype(np.float32)),
                         sp.csr_matrix(observed.astype(np.int64)), np.full(D, 5), N, tau)


class LogProbOracle(Oracle):
    """Draws from fixed next-token log-probs ``y`` (row q for the prompt "prompt q", e.g. ``incomplete_logprobs``):
    the sampling temperature is the one ``y`` was made at."""

    def __init__(self, y: np.ndarray):
        super().__init__()
        self.y = y

    def sample(self, prompts, n, temperature, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds):
            logp = self.y[int(prompt.split()[-1])]
            counts = multinomial_counts(np.random.default_rng(seed), n, np.exp(logp))
            ids = np.flatnonzero(counts)
            out.append(Samples(ids, logp[ids].astype(np.float32), counts[ids], prompt_tokens=5))
            self.cost.charge(5, n)
        return out

    def argmax(self, prompts):
        raise NotImplementedError("only samples")

    def time_request(self, prompt):
        raise NotImplementedError("only samples")
