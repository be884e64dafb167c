"""Peak memory of the phase-1 operations on a large stored sample (issue 13's 12 GB bound; the 1.5B's 3,000 x 10^6
draws hold 3.9·10^8 entries, 4.65 GB): reading it back from its shards (``observed_mask``, ``load_samples`` whole
and of the common set's columns), thinning (``SampledMatrix.subsample``), the common set (Alg. 1 lines 5-7),
the adaptive loop replayed on stored draws (``nv.phase1.exactness.adaptive_replay``), the interactive
inspector's budget (``nv.phase1.inspect.Source.spectra``), and one round of the adaptive
loop on disk (``nv.phase1.adaptive``: two rounds' folders merged, the common set from the mask, the check thinned to a
folder).

The sample is synthetic, shaped like a real one: D prompts over |V| = 151,936 tokens, N calls per prompt
multinomial over a Zipf law on one shared token ranking, log-probs of rank R = 256 (h_q W^T, bf16-rounded), so the
common set is large and the robust estimator saturates and the replay's checks run. Sizes are in units of the
sample's own arrays (12 bytes per observed entry), above the resident set before each step (the sample itself).
Bounds: thinning peaks at the thinned copy alone (<= 1.15 x the thinned sample: no nnz-sized draw and keep mask
beside it); reading the sample back at <= 1.1 x the sample (arrays filled in place, no list of parts
concatenated), its observation mask at <= 0.5 x (5 bytes per entry of the 12); the common set at <= 0.3 x the sample (no copy of Y_hat's rows); the replay at <= 0.8 x the sample
(each round and its check thinned from the shards on disk, of each only the observation mask and the common set's
columns read; thinning in memory held the sample and a round's draws, ~1.2 x, and a round's draws beside its check,
as before issue 13's change, two), the inspector's budget likewise at <= 0.8 x (it thinned the sample read whole in memory until dfbf0de); the round on disk at <= 0.8 x (the merged sample's observation mask, 5 of its 12 bytes an entry, and the
pruning's bitmap; a round held the sample and the union of its merge, ~2 x, while the merged sample was in memory). Each bound is printed MET or MISSED (machines are noisy); a wrong result (a sample read back other
than it was written, thinned rows not summing to N, a replay that does
not find rank R, a merge other than the sample split into its two rounds, an inspector's common set other than
the thinned sample's) exits with status 1. Run: python benchmarks/bench_sample_memory.py [--D 3000] [--N 100000] [--work DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from nv.models.loading import release_memory
from nv.phase1.adaptive import merge
from nv.phase1.exactness import adaptive_replay
from nv.phase1.inspect import Source
from nv.phase1.pipeline import common_set, common_set_of
from nv.phase1.sampling import SampledMatrix, load_samples, observed_mask, save_samples, thin

from _common import GIB, peak_rss, reset_peak_rss, verdict

RANK, VOCAB = 256, 151_936


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and back: the logits' storage precision."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def synthetic(D: int, N: int, seed: int = 0) -> SampledMatrix:
    """D prompts x N calls: counts multinomial over p_v ~ rank(v)^-1.05 (one ranking, a per-prompt exponent jitter),
    log-probs -8 + h_q . w_v (R = 256 dimensions) rounded to bf16 on the observed entries only."""
    rng = np.random.default_rng(seed)
    ranking = rng.permutation(VOCAB)
    H = rng.normal(scale=0.25, size=(D, RANK)).astype(np.float32)
    W = rng.normal(size=(VOCAB, RANK)).astype(np.float32)
    indptr, indices, counts, logprobs = [0], [], [], []
    for q in range(D):
        p = np.arange(1, VOCAB + 1, dtype=np.float64) ** -rng.uniform(1.0, 1.1)
        c = np.zeros(VOCAB, dtype=np.int64)
        c[ranking] = rng.multinomial(N, p / p.sum())
        idx = np.flatnonzero(c).astype(np.int32)
        indices.append(idx)
        counts.append(c[idx].astype(np.int32))
        logprobs.append(bf16(-8.0 + W[idx] @ H[q]))
        indptr.append(indptr[-1] + idx.size)
    indptr, indices = np.asarray(indptr, dtype=np.int64), np.concatenate(indices)
    shape = (D, VOCAB)
    return SampledMatrix(sp.csr_matrix((np.concatenate(logprobs), indices, indptr), shape=shape),
                         sp.csr_matrix((np.concatenate(counts), indices, indptr), shape=shape),
                         np.full(D, 20, dtype=np.int32), N, 2.0)


def size(S: SampledMatrix) -> float:
    """The sample's arrays in GiB (counts, indices, log-probs: 12 bytes per entry)."""
    return (S.counts.data.nbytes + S.counts.indices.nbytes + S.logprobs.data.nbytes) / GIB


def step(name: str, fn, *args):
    """Run fn once; print and return (result, seconds, peak GiB above the resident set before it). Freed heap is handed
    back first: glibc would otherwise serve the step from blocks it kept resident (the synthetic sample's build leaves
    ~1 GiB of them), and the step would read as free."""
    release_memory()
    reset_peak_rss()
    base = peak_rss()
    t0 = time.perf_counter()
    out = fn(*args)
    seconds, above = time.perf_counter() - t0, peak_rss() - base
    print(f"{name}: {seconds:.1f} s, peak {above:.2f} GiB above the {base:.2f} GiB before it")
    return out, seconds, above


def rest_of(S: SampledMatrix, part: SampledMatrix) -> SampledMatrix:
    """The calls of S that are not in ``part`` (its first calls, ``subsample``): counts subtracted on S's pattern, the
    tokens drawn only in ``part`` dropped."""
    counts = S.counts.data.copy()
    for q in range(S.D):
        row, taken = slice(*S.counts.indptr[q : q + 2]), slice(*part.counts.indptr[q : q + 2])
        counts[row.start + np.searchsorted(S.counts.indices[row], part.counts.indices[taken])] -= part.counts.data[taken]
    keep = counts > 0
    indptr = np.concatenate([[0], np.cumsum(keep)])[S.counts.indptr]
    indices = S.counts.indices[keep]
    return SampledMatrix(sp.csr_matrix((S.logprobs.data[keep], indices, indptr), shape=S.counts.shape),
                         sp.csr_matrix((counts[keep], indices, indptr), shape=S.counts.shape), S.prompt_tokens,
                         S.N - part.N, S.temperature)


def disk_round(a: Path, b: Path, work: Path, check_N: int) -> tuple[Path, tuple, tuple]:
    """One round of the adaptive loop's work on disk: merge, common set from the mask, the check thinned to a folder."""
    merged = merge(a, b, work / "merged")
    common, _ = common_set_of(merged)
    check, _ = common_set_of(thin(merged, work / "check", check_N, 0))
    return merged, common.Y.shape, check.Y.shape


def bound(what: str, ratio: float, limit: float) -> None:
    print(f"  {what}: {ratio:.2f} (bound {limit}) {'MET' if ratio <= limit else 'MISSED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", type=int, default=3000)
    ap.add_argument("--N", type=int, default=100_000)
    ap.add_argument("--work", default=None, help="folder for the shards (default: a temporary one)")
    args = ap.parse_args()
    wrong = []
    S, _, _ = step(f"synthetic sample {args.D} x {args.N:,}", synthetic, args.D, args.N)
    S_gib = size(S)
    print(f"  {S.counts.nnz:,} observed entries, {S_gib:.2f} GiB")

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        folder = save_samples(S, Path(tmp) / "samples")
        mask, _, peak = step("read back: observation mask (observed_mask)", observed_mask, folder)
        bound("peak / sample", peak / S_gib, 0.5)
        if not (np.array_equal(mask.indptr, S.counts.indptr) and np.array_equal(mask.indices, S.counts.indices)):
            wrong.append("observed_mask differs from the sample written")
        del mask
        back, _, peak = step("read back: Y_hat whole (load_samples)", load_samples, folder)
        bound("peak / sample", peak / S_gib, 1.1)
        if not all(np.array_equal(getattr(back.logprobs, f), getattr(S.logprobs, f)) for f in ("data", "indices", "indptr")) \
                or not np.array_equal(back.counts.data, S.counts.data):
            wrong.append("load_samples differs from the sample written")
        del back
        seen = S.counts.getnnz(axis=0)  # prompts that drew each token
        columns = seen >= 0.9 * S.D
        part, _, peak = step(f"read back: {int(columns.sum())} columns (load_samples(columns))", load_samples, folder, columns)
        bound("peak / sample", peak / S_gib, 1.1)
        if part.counts.nnz != int(seen[columns].sum()):
            wrong.append("load_samples(columns) kept another number of entries than the sample has in those columns")
        del part
        # the sample as two rounds (its first N / 2 calls and the rest), saved, then merged back as the loop does
        first_half = S.subsample(args.N // 2, 0)
        a = save_samples(first_half, Path(tmp) / "round-0")
        b = save_samples(rest_of(S, first_half), Path(tmp) / "round-1")
        del first_half
        (merged, shape, check), _, peak = step("adaptive round on disk (merge, common set, check)", disk_round, a, b,
                                               Path(tmp), int(args.N / np.sqrt(2)))
        print(f"  common set {shape[0]} x {shape[1]}, its check's {check[0]} x {check[1]}")
        bound("peak / sample", peak / S_gib, 0.8)
        back = load_samples(merged)
        if (back.counts != S.counts).nnz or not np.allclose(back.logprobs.data, S.logprobs.data, rtol=1e-6, atol=0):
            wrong.append("the two rounds merged differ from the sample they split")
        del back
        sampling = {"N0": max(1, args.N // 8), "N_max": args.N, "growth": 2.0}
        (rounds, why), _, peak = step("adaptive replay from disk (N/8, N/4, N/2, N)", adaptive_replay, folder, sampling,
                                      {"g": 64, "z_min": 8.0, "min_ratio": 1.05}, 0)
        for r in rounds:
            print(f"  {r.line()}")
        print(f"  stop: {why}")
        bound("peak / sample", peak / S_gib, 0.8)
        if not rounds or rounds[-1].d_hat_raw is None or abs(rounds[-1].d_hat_raw - RANK) > 3:
            wrong.append(f"the replay's last round does not find rank {RANK}: {rounds[-1].line() if rounds else 'no round'}")
        inspected, _, peak = step("spectrum inspector at N / 2 from disk (Source.spectra)",
                                  Source(Path(tmp) / "unused.npz", samples=folder).spectra, args.N // 2)
        print(f"  common set {inspected.shape[0]} x {inspected.shape[1]}")
        bound("peak / sample", peak / S_gib, 0.8)
        if inspected.shape != common_set(S.subsample(args.N // 2, 0)).Y.shape:
            wrong.append("the inspector's budget differs from the common set of the sample thinned in memory")

    half, _, peak = step("thin to N / 2 (subsample)", S.subsample, args.N // 2, 0)
    bound("peak / thinned sample", peak / size(half), 1.15)
    if not np.all(np.asarray(half.counts.sum(axis=1)).ravel() == args.N // 2):
        wrong.append("a thinned row does not sum to N / 2")
    del half

    cs, _, peak = step("common set (greedy pruning + Y)", common_set, S)
    print(f"  common set {cs.Y.shape[0]} x {cs.Y.shape[1]}")
    bound("peak / sample", peak / S_gib, 0.3)
    del cs

    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(main())
