"""The oracle interface: the only way attack code talks to a model (§2 threat model).

One call samples one token at temperature tau and returns it with its log-probability;
a temperature-0 call returns the argmax token; a timed call returns end-to-end latency.
Every backend charges its calls with the §5 cost metric:
tokens = (system prompt + input tokens + output tokens) * (# samples), no caching assumed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from nv.errors import NVError

LOGPROB_MODES = ("processed", "raw")


@dataclass
class Cost:
    """Running cost of an attack in calls and tokens (§5)."""

    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def charge(self, prompt_tokens: int, calls: int, output_tokens: int = 1) -> None:
        """Charge ``calls`` calls of one prompt with ``prompt_tokens`` tokens each."""
        self.calls += calls
        self.prompt_tokens += prompt_tokens * calls
        self.output_tokens += output_tokens * calls

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens": self.tokens}


@dataclass(frozen=True)
class Samples:
    """What N calls on one prompt return: distinct tokens, their log-probs y_q^(i), counts,
    and the prompt tokens (system prompt + template + input) each call was charged for."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    counts: np.ndarray
    prompt_tokens: int

    @property
    def n(self) -> int:
        return int(self.counts.sum())


@dataclass(frozen=True)
class TimedCall:
    """One timed call (App. D): seconds from request to the first output token, and the prompt
    tokens the backend processed (its own count, e.g. an HTTP server's ``usage.prompt_tokens``)."""

    seconds: float
    prompt_tokens: int


def check_sampling(n: int, temperature: float, prompts: Sequence[str], seeds: Sequence) -> None:
    """One-line errors for an impossible sampling request."""
    if len(seeds) != len(prompts):
        raise NVError(f"need one seed per prompt, got {len(seeds)} for {len(prompts)}")
    if int(n) != n or n < 1:
        raise NVError(f"number of samples N must be an integer >= 1, got {n}")
    if not temperature > 0:
        raise NVError(f"temperature must be > 0, got {temperature} (use argmax() for greedy calls)")


class BudgetExhausted(NVError):
    """The next request would pass a budget cap; nothing over it was sent."""


class Oracle(ABC):
    """A restrictive LLM API: sampled token + its log-probability, and timing."""

    def __init__(self) -> None:
        self.cost = Cost()

    @abstractmethod
    def sample(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence) -> list[Samples]:
        """``n`` calls per prompt at ``temperature``; ``seeds[q]`` seeds prompt q's draws."""

    @abstractmethod
    def argmax(self, prompts: Sequence[str]) -> list[Samples]:
        """One temperature-0 call per prompt: the argmax token and the log-prob the API reports."""

    @abstractmethod
    def time_request(self, prompt: str) -> TimedCall:
        """One call with one output token, timed client-side from request to that token."""

    def refuses(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence,
                prompt_tokens: Sequence[int] | None = None) -> str | None:
        """Why ``sample(prompts, n, temperature, seeds)`` would pass a budget cap of this backend, or None (a backend
        without a budget: never). ``prompt_tokens``: each prompt's tokens per call where a sample measured them; else
        the backend's own measure of them, or its estimate."""
        return None

    @contextmanager
    def repeats(self) -> Iterator[None]:
        """A span in which the same prompts are sampled again (the adaptive loop's rounds): a backend may keep what
        it computed for them until the span ends. The answers are the same either way; by default nothing is kept."""
        yield
