"""Adaptive sampling (``sampling.N: auto``): phase 1 decides its own budget N (issue 14; the paper fixes N).

Rounds of sampling at growing N (N_0, growth x N_0, ..., capped at ``N_max``): round r draws the
N_r - N_{r-1} new calls per prompt with its own seed, so the rounds together are the first N_r calls of one
nested sample (a sum of independent multinomials is the multinomial of the sum). After each round the merged
Y_hat is pruned to its common set and given to the robust estimator. The merged sample lives on disk (a sampling
folder under ``adaptive-merged``, rewritten each round a shard at a time, as is its check's thinned copy): a round
holds the observation mask for the pruning (5 bytes an entry) and the common set's columns, not the sample's values
(12 bytes an entry, twice that while merging). On disk it takes ~12 bytes an entry, beside the rounds' own folders,
up to twice that while the next merge or the check is written; the folder is removed when the loop ends or stops.

With ``sampling.estimator: incomplete`` a round the robust estimate leaves not saturated is asked again of the
missing-data estimator (``nv.phase1.incomplete``, on every observed entry of the tokens most prompts drew), and so is
its check: that estimator answers at a fraction of the robust one's budget, at ~5-10 min of this CPU a round.

Stop rule: the estimate is saturated at N_r and, on the same draws thinned to N_r / sqrt(2) (hypergeometric, no
new calls), saturated again with d_hat_raw within +-1: the drop is not a fluke of the last draws. Two consecutive rounds (the issue's rule)
would pay for a whole extra round to learn the same; thinning asks the same question of a nested sub-budget.
A round that is saturated but fails its check is followed by one sqrt(2) larger instead of growth x larger
(``next_budget``): its check then falls on the budget already found saturated, so the loop pays at most sqrt(2)
past the first budget whose own check would pass, where doubling paid 2x.
Otherwise the loop stops at ``N_max`` or at a budget cap (``Budget`` of the HTTP oracle), reporting not
saturated with its lower bound and the cost of the next round.

Each finished round is a sampling folder (``nv.phase1.sampling.collect``) under the checkpoint root, keyed by
the round's seed and size: a rerun after a stop redoes no finished round (the estimates that chose each next
size are recomputed, so the same rounds follow; a round cut short at ``N_max`` is drawn again at its own size once
N_max is raised, and its short folder removed), and on an endpoint the journal answers every request already
paid for. The rounds run inside ``oracle.repeats()``: the simulator keeps the prompts' logits, so only the first
round runs forward passes.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from nv.errors import NVError
from nv.oracle.base import BudgetExhausted, Oracle
from nv.phase1.pipeline import common_set_of, estimate_on, missing_data
from nv.phase1.sampling import (MANIFEST, MANIFEST_KEYS, SampledMatrix, collect, iter_shards, meta_key, place, sample_meta,
                                thin, write_samples)
from nv.phase1.spectrum import SpectrumEstimate


CHECK = math.sqrt(2)  # round r's check: its draws thinned to N_r / CHECK
MAX_ROUNDS = 64  # each round re-estimates the spectrum: a growth that needs more to reach N_max is a slip


def next_budget(N: int, saturated: bool, N_max: int, growth: float = 2.0) -> int:
    """The round after one of N calls per prompt: growth x N, or min(growth, sqrt 2) x N after a saturated round
    whose check failed (its successor's check is then N itself), capped at N_max."""
    if not 1 <= N <= N_max or growth <= 1:
        raise NVError(f"adaptive sampling needs 1 <= N <= N_max and growth > 1, got N={N}, N_max={N_max}, growth={growth}")
    return min(N_max, math.ceil(N * (min(growth, CHECK) if saturated else growth)))


def check_rounds(N0: int, N_max: int, growth: float) -> None:
    """The params' check, before anything is sent: a valid first round, and N_max within ``MAX_ROUNDS`` of it."""
    next_budget(N0, False, N_max, growth)
    if math.log(N_max / N0) > MAX_ROUNDS * math.log(growth):
        raise NVError(f"sampling.growth = {growth} takes more than {MAX_ROUNDS} rounds from N = {N0:,} to N_max = {N_max:,} "
                      f"(each estimates the spectrum again): use a growth of at least {(N_max / N0) ** (1 / MAX_ROUNDS):.3g}")


def schedule(N0: int, N_max: int, growth: float = 2.0) -> list[int]:
    """The rounds' cumulative N while no round is saturated: N_0, growth N_0, growth^2 N_0, ..., the last capped
    at N_max (the most rounds a budget plan needs to afford)."""
    check_rounds(N0, N_max, growth)
    out = [N0]
    while out[-1] < N_max:
        out.append(next_budget(out[-1], False, N_max, growth))
    return out


def round_seed(seed: int, r: int) -> int:
    """The seed of round r's draws: distinct per round, a function of params.yaml's seed only."""
    return int(np.random.SeedSequence([seed, r]).generate_state(1)[0])


def merge(a: Path, b: Path, out: Path) -> Path:
    """Y_hat of the union of the samples in folders ``a`` and ``b`` (of the same prompts: the rounds merged so far
    and the next one), written to ``out`` in ``b``'s shards: counts add; a token's log-prob is the count-weighted mean
    of their values (equal on an exact oracle; an average against a noisy one). Both are read a few rows at a time
    (``iter_shards``): memory holds a shard of each and their union, never a sample."""
    meta_b, rows_b = iter_shards(b)
    meta_a, rows_a = iter_shards(a, meta_b["chunk"])
    if (meta_a["D"], meta_a["vocab_size"]) != (meta_b["D"], meta_b["vocab_size"]):
        raise NVError(f"adaptive sampling: rounds of shapes {(meta_a['D'], meta_a['vocab_size'])} and "
                      f"{(meta_b['D'], meta_b['vocab_size'])} cannot merge")

    def union():
        for (a_counts, a_logprobs, prompt_tokens), (b_counts, b_logprobs, _) in zip(rows_a, rows_b):
            counts = (a_counts.astype(np.int64) + b_counts).tocsr()  # counts >= 1: the pattern is the union
            w = (a_logprobs.astype(np.float64).multiply(a_counts) + b_logprobs.multiply(b_counts)).tocsr()
            counts.sort_indices()
            w.sort_indices()
            # a sparse sum drops the entries that come to exactly 0 (log-prob 0: a token of probability 1 in float32),
            # and only those (log-probs are <= 0): they are put back as 0 on the union's pattern
            weighted = w.data if w.nnz == counts.nnz else _on_pattern(w, counts)
            yield counts, sp.csr_matrix((weighted / counts.data, counts.indices, counts.indptr), shape=counts.shape), prompt_tokens

    meta = {k: meta_b[k] for k in MANIFEST_KEYS} | {"N": meta_a["N"] + meta_b["N"], "temperature": meta_a["temperature"]}
    return write_samples(out, meta, union())


def _on_pattern(m: sp.csr_matrix, pattern: sp.csr_matrix) -> np.ndarray:
    """The values of ``m`` on the (sorted) pattern of ``pattern``, which holds ``m``'s: 0 where ``m`` stores none."""
    def keys(x: sp.csr_matrix) -> np.ndarray:  # row x |V| + column of each stored entry, ascending
        return np.repeat(np.arange(x.shape[0], dtype=np.int64), np.diff(x.indptr)) * x.shape[1] + x.indices

    out = np.zeros(pattern.nnz)
    out[np.searchsorted(keys(pattern), keys(m))] = m.data
    return out


@dataclass
class Round:
    """One round's outcome, as the progress display and the report show it."""

    round: int
    N: int
    D_prime: int
    C: int
    saturated: bool
    d_hat_raw: int | None
    lower_bound: int | None
    check_N: int
    check_d_hat_raw: int | None
    tokens: int
    calls: int

    def line(self) -> str:
        found = f"d_hat_raw = {self.d_hat_raw} (check at N = {self.check_N:,}: {self.check_d_hat_raw})" if self.saturated \
            else f"not saturated, d >= {self.lower_bound}"
        return (f"round {self.round}: N = {self.N:,}, common set {self.D_prime} x {self.C}, {found}; "
                f"spent {self.tokens:.3g} tokens (§5), {self.calls:.3g} calls")


def after(done: Round, stable: bool, N_max: int, growth: float) -> int | None:
    """The loop's next round after ``done`` (``next_budget``), or None where it stops: its rule holds, or N_max."""
    return None if stable or done.N >= N_max else next_budget(done.N, done.saturated, N_max, growth)


def stopped(estimate_: SpectrumEstimate, check: SpectrumEstimate) -> bool:
    """The stop rule: saturated at N_r and at the thinned check budget, within +-1."""
    return (estimate_.saturated and check.saturated
            and abs(int(estimate_.d_hat_raw) - int(check.d_hat_raw)) <= 1)


def round_estimate(Y: np.ndarray, robust: dict) -> tuple[SpectrumEstimate, tuple[int, int]]:
    """The robust estimate on a round's matrix Y and Y's shape: what ``assess`` needs of it."""
    return estimate_on(Y, "robust", robust), Y.shape


def folder_estimate(folder: Path, robust: dict, ladder: dict | None, seed: int
                    ) -> tuple[SpectrumEstimate, tuple[int, int], SampledMatrix]:
    """``round_estimate`` of the sample in ``folder`` (its common set, ``common_set_of``), and with ``ladder``
    (``spectrum.incomplete``, for ``sampling.estimator: incomplete``) ``missing_data``'s where that is saturated
    (otherwise the robust one stands, its lower bound the ladder's anchor). Also the sample's cost
    (``SampledMatrix.cost``: its prompts' tokens, N and tau, no entries: a round's frequent tokens, which the ladder
    reads, are not held through the next estimate or the check)."""
    common, S = common_set_of(folder, None if ladder is None else ladder["frac"])
    est, shape = round_estimate(common.Y, robust)
    del common
    if ladder is not None and not est.saturated:
        found = missing_data(S, est, shape, {"robust": robust, "incomplete": ladder}, seed)
        est = found if found.saturated else est
    return est, shape, S.cost()


def assess(r: int, est: SpectrumEstimate, shape: tuple[int, int], budget: dict,
           check: Callable[[int], SpectrumEstimate]) -> tuple[Round, bool]:
    """Round r from its estimate ``est`` on its matrix Y (``shape``: D' x |C|; the common set of its merged Y_hat of
    N_r = ``budget["N"]`` calls per prompt, or a view of it, ``nv.defences``) and its cost (``SampledMatrix.budget``):
    when saturated, estimated again by ``check(N_r / sqrt(2))``, on the same draws thinned to that N
    (hypergeometric); returns the round and whether the stop rule holds."""
    check_N = max(1, int(budget["N"] / CHECK))
    checked = check(check_N) if est.saturated else est
    done = Round(r, budget["N"], *shape, est.saturated, est.d_hat_raw, est.lower_bound, check_N,
                 checked.d_hat_raw if est.saturated else None, budget["tokens"], budget["calls"])
    return done, stopped(est, checked)


def sample_adaptive(
    oracle: Oracle,
    prompts: list[str],
    sampling: dict,
    robust: dict,
    seed: int,
    out_dir: Path,
    vocab_size: int,
    checkpoint_root: Path,
    identity: dict,
    progress: bool = True,
    report: Callable[[str], None] | None = None,
    ladder: dict | None = None,
) -> tuple[Path, list[Round], str]:
    """Sample in rounds until the stop rule holds, N_max is reached or the oracle refuses the next round (a budget
    cap: ``NVError`` from the oracle). Writes the merged Y_hat to ``out_dir`` (``load_samples`` reads it); returns
    it, the rounds and why the loop stopped ("stable", "N_max" or the cap's message). ``report`` gets each round's
    line and the stop's (default: stderr, beside the progress bars; nothing without ``progress``). ``ladder``
    (``spectrum.incomplete``, with ``sampling.estimator: incomplete``): the missing-data estimator also answers
    (``folder_estimate``)."""
    if report is None:
        report = (lambda line: tqdm.write(line, file=sys.stderr)) if progress else (lambda line: None)
    N_max, growth = sampling["N_max"], sampling["growth"]
    N, previous = sampling["N0"], 0
    uncapped = N  # the round's size before the cap at N_max
    check_rounds(N, N_max, growth)
    work = Path(checkpoint_root) / "adaptive-merged"  # the rounds merged so far and the check's thinned copy
    rounds, merged, S = [], None, None  # S: the merged sample's cost (its prompts' tokens, N, tau)
    shutil.rmtree(work, ignore_errors=True)  # a stopped run's: rebuilt from the round folders
    try:
        with oracle.repeats():  # every round samples the same prompts (the simulator keeps their logits)
            for r in itertools.count():
                delta = N - previous
                # the round's draws, named by what they are (target, prompts, tau, width; not their storage, chunk)
                meta = sample_meta(prompts, delta, sampling["temperature"], round_seed(seed, r), vocab_size,
                                   {**identity, "round": r})
                key = meta_key({k: v for k, v in meta.items() if k != "chunk"})
                folder = Path(checkpoint_root) / "adaptive" / f"round-{r}-{round_seed(seed, r)}-{delta}-{key}"
                if not _finished(folder):
                    # a round the budget cannot finish is not started (its cost is known from the rounds before), and one
                    # that passes a cap all the same stops the loop with the rounds finished so far
                    try:
                        collect(oracle, prompts, delta, sampling["temperature"], round_seed(seed, r), folder, vocab_size,
                                checkpoint_root=checkpoint_root, identity={**identity, "round": r}, chunk=sampling["chunk"],
                                progress=progress, prompt_tokens=None if S is None else S.prompt_tokens,
                                desc=f"round {r}: N {previous:,} -> {N:,}")
                    except BudgetExhausted as exc:
                        if merged is None:
                            raise
                        why = f"round {r} (N = {N:,}, {_tokens(S, delta):.3g} more tokens) not affordable: {exc}"
                        report(f"stopped: {why}")
                        break
                    for other in _resized(folder, meta):
                        shutil.rmtree(other, ignore_errors=True)
                if merged is None:
                    merged = folder
                else:  # on disk, not in memory: a round's estimate holds the mask of the merged sample, not its values
                    merged = merge(merged, folder, work / f"merged-{r}")
                    shutil.rmtree(work / f"merged-{r - 1}", ignore_errors=True)
                est, shape, S = folder_estimate(merged, robust, ladder, seed)
                done, stable = assess(r, est, shape, S.budget(), lambda n: folder_estimate(
                    thin(merged, work / "check", n, seed), robust, ladder, seed)[0])
                shutil.rmtree(work / "check", ignore_errors=True)
                rounds.append(done)
                report(done.line() + (" (the missing-data estimator's)" if est.method == "incomplete" else ""))
                nxt = after(done, stable, N_max, growth)
                if nxt is None:
                    why = "stable" if stable else "N_max"
                    if not stable:  # what going on would cost, at the prompts' measured tokens
                        # a round N_max cut short is drawn again at its own size: the next round the loop runs
                        more = uncapped if uncapped > N else next_budget(N, done.saturated, sys.maxsize, growth)
                        again = (f"; round {r} is drawn again at that size (an endpoint's journal answers what it paid)"
                                 if uncapped > N else "")
                        report(f"stopped: N_max = {N_max:,} reached, the estimate not yet stable; the next round (N = {more:,}) "
                               f"would cost {_tokens(S, more - N):.3g} more tokens (§5){again}: raise sampling.N_max to "
                               f"at least {more:,} and rerun the same command")
                    break
                uncapped = next_budget(N, done.saturated, sys.maxsize, growth)
                previous, N = N, nxt
        _publish(merged, work, Path(out_dir), {"adaptive": [asdict(x) for x in rounds], "stop": why})
    finally:  # the merged samples and the check's copy, also when the loop is stopped
        shutil.rmtree(work, ignore_errors=True)
    return Path(out_dir), rounds, why


def _publish(merged: Path, work: Path, out_dir: Path, extra: dict) -> None:
    """The merged sample as the loop's output folder, its manifest with ``extra`` (the rounds, the stop) written
    before it is moved there (``place``): from the work folder, or from a copy of round 0's own (kept for a rerun)."""
    staged = merged if merged.parent == work else Path(shutil.copytree(merged, work / "output"))
    meta = json.loads((staged / MANIFEST).read_text())
    (staged / MANIFEST).write_text(json.dumps({k: meta[k] for k in MANIFEST_KEYS} | extra, indent=2, ensure_ascii=False) + "\n")
    place(staged, out_dir)


def _tokens(S: SampledMatrix, calls: int) -> int:
    """§5 tokens of ``calls`` more calls per prompt of sample ``S``, at its prompts' measured tokens (prompt + 1 each)."""
    return int((S.prompt_tokens.astype(np.int64) + 1).sum()) * calls


def _resized(folder: Path, meta: dict) -> list[Path]:
    """The folders of round ``folder``'s draws at a smaller size (``meta`` but N; a round cut short at an earlier
    ``N_max``): superseded once this one is finished. A larger one (a run at a larger ``N_max`` or ``N0``) is kept."""
    same = {k: v for k, v in meta.items() if k not in ("N", "chunk")}
    found = []
    for other in folder.parent.glob("-".join(folder.name.split("-")[:3]) + "-*"):
        try:
            theirs = json.loads((other / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if other != folder and isinstance(theirs, dict) and {k: v for k, v in theirs.items() if k not in ("N", "chunk")} == same \
                and isinstance(theirs.get("N"), int) and theirs["N"] < meta["N"]:
            found.append(other)
    return found


def _finished(folder: Path) -> bool:
    """A round already sampled (a rerun after a stop; its folder's name holds the key of its draws, ``meta_key``) and
    every shard intact (``iter_shards``'s checks, which read no values)."""
    try:
        iter_shards(folder)
    except NVError:
        return False
    return True
