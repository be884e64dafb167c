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

    def sample(self, prompts, n, temperature, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds):
            z = self.W @ np.random.default_rng(list(prompt.encode())).normal(size=self.rank) / temperature
            logp = z - np.logaddexp.reduce(z)
            counts = multinomial_counts(np.random.default_rng(seed), n, np.exp(logp))
            ids = np.flatnonzero(counts)
            out.append(Samples(ids, logp[ids].astype(np.float32), counts[ids], prompt_tokens=5))
            self.cost.charge(5, n)
            self.sample_calls += 1
        return out

    def argmax(self, prompts):
        raise NotImplementedError("the toy LM only samples")

    def time_request(self, prompt):
        raise NotImplementedError("the toy LM only samples")
