"""High-entropy prompt search (App. B.1.1): 5-character prompts from Unicode character groups.

Exploration rounds draw fresh random prompts (from round 2 on, half of each batch are one-character
variants of the current best) and end early once a prompt's argmax probability falls below a
threshold; the remaining rounds are pure refinement (one-character mutations of the best, spread
evenly across character groups). Every string is evaluated once; the D prompts of lowest argmax
probability are kept. The argmax probability is the log-prob of one temperature-0 call, charged to
the oracle's budget.

``mode="diverse"`` (our default) draws fresh random prompts in every round and keeps the D lowest.
Measured on SmolLM2-135M (D = 3000, N = 3e5): the paper's refinement fills the kept set with
one-character variants of one prompt, whose hidden states barely differ, and no spectral drop
appears (robust: not saturated, lower bound 436); random prompts at the same budget give d = 576.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from nv.errors import NVError
from nv.oracle.base import Oracle

# Inclusive code-point ranges of printable characters, one entry per group.
GROUPS: dict[str, list[tuple[int, int]]] = {
    "latin": [(0x41, 0x5A), (0x61, 0x7A), (0xC0, 0xFF), (0x100, 0x17F)],
    "greek": [(0x391, 0x3A9), (0x3B1, 0x3C9)],
    "cyrillic": [(0x410, 0x44F)],
    "hebrew": [(0x5D0, 0x5EA)],
    "arabic": [(0x621, 0x64A)],
    "devanagari": [(0x905, 0x939)],
    "thai": [(0xE01, 0xE2E)],
    "hangul": [(0xAC00, 0xD7A3)],
    "kana": [(0x3041, 0x3096), (0x30A1, 0x30FA)],
    "cjk": [(0x4E00, 0x9FFF)],
    "braille": [(0x2801, 0x28FF)],
    "math": [(0x2200, 0x22FF), (0x27C0, 0x27EF)],
    "arrows_shapes": [(0x2190, 0x21FF), (0x25A0, 0x25FF)],
    "box_drawing": [(0x2500, 0x257F)],
    "runic": [(0x16A0, 0x16EA)],
    "emoji": [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF)],
}


def _alphabets() -> list[np.ndarray]:
    return [np.concatenate([np.arange(a, b + 1) for a, b in ranges]) for ranges in GROUPS.values()]


ALPHABETS = _alphabets()


def random_char(rng: np.random.Generator, group: int | None = None) -> str:
    """One character from ``group`` (an index into GROUPS), or from a random group."""
    alphabet = ALPHABETS[rng.integers(len(ALPHABETS)) if group is None else group]
    return chr(int(alphabet[rng.integers(len(alphabet))]))


def random_prompts(rng: np.random.Generator, count: int, length: int = 5) -> list[str]:
    """``count`` prompts of ``length`` characters, each character from a random group."""
    return ["".join(random_char(rng) for _ in range(length)) for _ in range(count)]


def mutate(rng: np.random.Generator, prompt: str, group: int | None = None) -> str:
    """A one-character variant: one random position replaced by a character of ``group``."""
    i = int(rng.integers(len(prompt)))
    return prompt[:i] + random_char(rng, group) + prompt[i + 1 :]


SEARCH_MODES = ("paper", "diverse")


@dataclass
class SearchResult:
    """Every evaluated prompt with its argmax probability, and the D kept (lowest first)."""

    prompts: list[str]
    argmax_prob: np.ndarray
    kept: list[str]
    rounds_explored: int


def _unique_batch(make: Callable[[int], str], size: int, seen: set[str], max_tries: int) -> list[str]:
    """Up to ``size`` strings from ``make(t)``, t the try's number, never evaluated before (bounded retries). A
    refinement's ``make`` picks the character group by t, so a group whose variants are all spent passes the turn to
    the next one (by the batch's length, it held the batch there until ``max_tries``: every later group's share lost)."""
    batch: list[str] = []
    tries = 0
    while len(batch) < size and tries < max_tries:
        candidate = make(tries)
        tries += 1
        if candidate not in seen:
            seen.add(candidate)
            batch.append(candidate)
    return batch


def search_prompts(
    oracle: Oracle,
    D: int,
    rounds: int,
    batch_size: int,
    explore_rounds: int,
    threshold: float,
    seed: int,
    length: int = 5,
    mode: str = "paper",
    progress: bool = True,
) -> SearchResult:
    """App. B.1.1 search (``mode="paper"``) or fresh random rounds only (``mode="diverse"``);
    returns the ``D`` evaluated prompts of lowest argmax probability."""
    if mode not in SEARCH_MODES:
        raise NVError(f"search mode must be one of {SEARCH_MODES}, got {mode!r}")
    if rounds * batch_size < D:
        raise NVError(f"search evaluates at most rounds*batch_size = {rounds * batch_size} prompts < D = {D}")
    if not 0 < threshold < 1:
        raise NVError(f"search threshold must be in (0, 1), got {threshold}")
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    prompts: list[str] = []
    probs: list[float] = []
    best, exploring, explored = "", True, 0
    max_tries = 20 * batch_size
    for r in tqdm(range(rounds), desc="prompt search", disable=not progress):
        exploring = mode == "diverse" or (exploring and r < explore_rounds)
        if exploring:
            n_var = batch_size // 2 if r >= 1 and mode == "paper" else 0
            batch = _unique_batch(lambda i: mutate(rng, best), n_var, seen, max_tries)
            batch += _unique_batch(lambda i: random_prompts(rng, 1, length)[0], batch_size - len(batch), seen, max_tries)
            explored += 1
        else:
            batch = _unique_batch(lambda t: mutate(rng, best, t % len(ALPHABETS)), batch_size, seen, max_tries)
        if not batch:
            break
        # a withheld argmax log-prob (NaN: under a provider's min_logprob floor) is below every value returned: the
        # flattest prompts, probability 0 for the ranking
        p = np.nan_to_num(np.exp([s.logprobs[0] for s in oracle.argmax(batch)]), nan=0.0)
        prompts += batch
        probs += p.tolist()
        best = prompts[int(np.argmin(probs))]
        if exploring and mode == "paper" and p.min() < threshold:
            exploring = False
    argmax_prob = np.array(probs)
    order = np.argsort(argmax_prob, kind="stable")
    if len(prompts) < D:
        raise NVError(f"search found only {len(prompts)} distinct prompts < D = {D}")
    return SearchResult(prompts, argmax_prob, [prompts[i] for i in order[:D]], explored)
