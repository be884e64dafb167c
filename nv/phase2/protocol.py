"""Phase 2 timing collection: Stage 1 of Fig. algo_timing with the App. D timing protocol.

For each sequence length ell_j: prompts of ~ell_j tokens built by repeating a fixed passage behind a
fresh random prefix per trial (so no prefix cache can serve a trial), K trials of one call with one
output token, timed client-side through ``Oracle.time_request``; before them three warm-up calls and
an ell = 1 baseline. Lengths are recorded as the backend's own prompt-token count per trial (it
includes the chat template), since a black-box client can only aim at a length, not set it.

The run is checkpointed one length at a time in a JSONL file: an interrupted run resumes from the
lengths already measured. Prompts depend only on (seed, length), so a resumed run sends what an
uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from nv.errors import NVError
from nv.oracle.base import Oracle, TimedCall
from nv.phase2.fit import prefill_times

log = logging.getLogger(__name__)

PASSAGE = (
    "The river bends twice before it reaches the old mill, where the water slows and the town begins. "
    "Every morning the baker opens the shutters, the ferry crosses with the first travellers, and the "
    "bells of the market hall count the hours until the light fades over the western hills. "
)
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
BASELINE = 1  # App. D: the ell = 1 baseline subtracted from every length


def random_prefix(rng: np.random.Generator, words: int = 6) -> str:
    """A fresh nonsense prefix: the first tokens differ from every other trial's."""
    return " ".join("".join(rng.choice(LETTERS, 5)) for _ in range(words)) + ". "


def timing_prompt(chars: int, rng: np.random.Generator) -> str:
    """App. D prompt: random prefix + the fixed passage repeated to ``chars`` characters."""
    return random_prefix(rng) + (PASSAGE * (chars // len(PASSAGE) + 1))[:chars]


@dataclass(frozen=True)
class TokenScale:
    """Prompt tokens ~ offset + per_char * passage characters (fitted on two warm-up calls)."""

    offset: float
    per_char: float

    def chars_for(self, tokens: int) -> int:
        return max(0, round((tokens - self.offset) / self.per_char))


def warm_up(oracle: Oracle, warmups: int, seed: int, longest: int) -> TokenScale:
    """The protocol's warm-up calls (untimed), which also calibrate characters -> tokens.

    The first two probe 0 and 2 x ``longest`` passage characters (about half the longest length in
    English text, so within any context that holds the sweep); the rest run at the longest length.
    """
    if warmups < 2:
        raise NVError(f"timing needs >= 2 warm-up calls (they calibrate the prompt length), got {warmups}")
    rng = np.random.default_rng([seed, 0])
    chars = max(200, 2 * longest)
    short, long = (oracle.time_request(timing_prompt(c, rng)) for c in (0, chars))
    scale = TokenScale(short.prompt_tokens, (long.prompt_tokens - short.prompt_tokens) / chars)
    if scale.per_char <= 0:
        raise NVError("the backend reports the same prompt-token count for short and long prompts")
    for _ in range(warmups - 2):
        oracle.time_request(timing_prompt(scale.chars_for(longest), rng))
    return scale


@dataclass
class LengthTimings:
    """K timed calls aimed at ``target`` tokens: the backend's token counts and latencies (s). The attention probe
    (``nv.phase2.probe``) aims at a cached context instead: ``ell`` is the cached prompt's count, ``new`` each timed
    call's tokens beyond it (None in App. D's protocol)."""

    target: int
    ell: list[int]
    seconds: list[float]
    new: list[int] | None = None

    def record(self) -> dict:
        """The row as JSON fields (``new`` only where the probe set it, so App. D's records keep their form)."""
        return {k: v for k, v in asdict(self).items() if k != "new" or v is not None}


def _measure(oracle: Oracle, target: int, trials: int, seed: int, scale: TokenScale) -> LengthTimings:
    rng = np.random.default_rng([seed, target])
    if target == BASELINE:  # one fresh random letter: the shortest possible user message
        calls: list[TimedCall] = [oracle.time_request(str(rng.choice(LETTERS))) for _ in range(trials)]
    else:
        calls = [oracle.time_request(timing_prompt(scale.chars_for(target), rng)) for _ in range(trials)]
    return LengthTimings(target, [c.prompt_tokens for c in calls], [c.seconds for c in calls])


def _resume(path: Path, key: str) -> dict[int, LengthTimings]:
    """Finished lengths of a run with the same key, then the checkpoint rewritten to exactly those
    (header + good rows): a torn last line is dropped with a warning, another run's file replaced."""
    done: dict[int, LengthTimings] = {}
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    if lines:
        try:
            head = json.loads(lines[0])
        except json.JSONDecodeError:
            head = None
        same_run = isinstance(head, dict) and head.get("key") == key
        if not same_run:
            log.warning("timing checkpoint %s belongs to another run: starting over", path)
            lines = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            row = LengthTimings(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            log.warning("timing checkpoint %s: dropping the torn line %d and what follows", path, number)
            break
        done[row.target] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in [{"key": key}, *(r.record() for r in done.values())]))
    tmp.replace(path)
    return done


@dataclass
class TimingJob:
    """One model's sweep for ``collect_interleaved``: its oracle, target lengths, checkpoint and run key."""

    oracle: Oracle
    lengths: Sequence[int]
    checkpoint: Path
    run_id: dict


def collect_timings(
    oracle: Oracle,
    lengths: Sequence[int],
    trials: int,
    warmups: int,
    seed: int,
    checkpoint: Path,
    run_id: dict,
    progress: bool = True,
    measure: Callable[[Oracle, int, int, int, TokenScale], LengthTimings] | None = None,
) -> list[LengthTimings]:
    """Stage 1 of Fig. algo_timing for one model on one platform: the baseline, then every length.

    Lengths are measured in a seeded random order (slow drifts of the machine then do not bend the
    curve); ``run_id`` (model, platform, ...) keys the checkpoint so another run never resumes it.
    Returns the baseline first, then the lengths in ascending order. ``measure`` times one length (default: App. D's
    K fresh prompts; the attention probe's ``measure_cached``).
    """
    return collect_interleaved([TimingJob(oracle, lengths, checkpoint, run_id)], trials, warmups, seed, progress,
                               measure)[0]


def collect_interleaved(
    jobs: Sequence[TimingJob],
    trials: int,
    warmups: int,
    seed: int,
    progress: bool = True,
    measure: Callable[[Oracle, int, int, int, TokenScale], LengthTimings] | None = None,
) -> list[list[LengthTimings]]:
    """``collect_timings`` for several models at once: every job's warm-ups and baseline first, then all jobs'
    lengths in one seeded random order, so a drift of the machine falls on every model alike instead of on
    whichever was timed during it (the references calibrate the target only as far as they saw the same machine).
    Per job: the baseline first, then its lengths in ascending order; each job resumes from its own checkpoint.
    """
    if trials < 2:
        raise NVError(f"timing needs >= 2 trials per length, got {trials}")
    targets, done = [], []
    for job in jobs:
        t = sorted({int(x) for x in job.lengths})
        if not t or t[0] <= BASELINE:
            raise NVError(f"sequence lengths must be > {BASELINE}, got {list(job.lengths)}")
        key = hashlib.sha256(json.dumps([job.run_id, t, trials, warmups, seed], sort_keys=True).encode()).hexdigest()
        targets.append(t)
        done.append(_resume(job.checkpoint, key))
    pairs = [(j, t) for j, t_j in enumerate(targets) for t in t_j]
    order = [(j, BASELINE) for j in range(len(jobs))] + [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]
    todo = [(j, t) for j, t in order if t not in done[j]]
    if todo:
        scales = {j: warm_up(jobs[j].oracle, warmups, seed, max(targets[j])) for j in sorted({j for j, _ in todo})}
        desc = f"timing {jobs[0].run_id.get('model', '')}" if len(jobs) == 1 else f"timing {len(jobs)} models"
        bar = tqdm(total=len(todo) * trials, desc=desc, disable=not progress, unit="call")
        journals = {j: jobs[j].checkpoint.open("a") for j in scales}
        try:
            for j, target in todo:
                row = (measure or _measure)(jobs[j].oracle, target, trials, seed, scales[j])
                journals[j].write(json.dumps(row.record()) + "\n")
                journals[j].flush()
                done[j][target] = row
                bar.update(trials)
        finally:
            for journal in journals.values():
                journal.close()
            bar.close()
    return [[d[BASELINE]] + [d[t] for t in t_j] for d, t_j in zip(done, targets)]


def summarize(rows: list[LengthTimings], trim: float = 0.1) -> dict[str, np.ndarray]:
    """App. D statistics: per length the mean measured ell, the 10 %-trimmed mean latency minus the
    ell = 1 baseline's (the prefill time T), and sigma_T = std / sqrt(N_kept)."""
    if not rows or rows[0].target != BASELINE:
        raise NVError("timing rows must start with the ell = 1 baseline")
    baseline, rest = rows[0], rows[1:]
    counts = sorted({len(r.seconds) for r in rows})
    if len(counts) > 1:
        raise NVError(f"timing rows differ in their number of trials ({counts}): "
                      "a damaged record; rerun its timing stage")
    T, sigma = prefill_times(np.array([r.seconds for r in rest]), np.array(baseline.seconds), trim)
    ell = np.array([np.mean(r.ell) for r in rest])
    return {"ell": ell, "T": T, "sigma": sigma, "tokens": sum(sum(r.ell) for r in rows)}
