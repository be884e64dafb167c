"""Alg. 1 lines 1-5: N samples per prompt at temperature tau into the sparse D x |V| matrix Y_hat.

Work is checkpointed in shards of ``chunk`` prompts (atomic writes), in a folder keyed by
everything that determines the draws; an interrupted run resumes from the finished shards and
loses no finished prompt. Prompt q is seeded with (seed, q), so a resumed run draws exactly
what an uninterrupted one would. The result is stored sparse (CSR arrays per shard), never as
a dense D x |V| array.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from nv.errors import NPZ_ERRORS, NVError
from nv.oracle.base import BudgetExhausted, Oracle

MANIFEST = "manifest.json"
ENTRY = {"indices": np.int32, "logprobs": np.float32, "counts": np.int32}  # a stored entry of Y_hat, in the shards
ENTRY_BYTES = sum(np.dtype(t).itemsize for t in ENTRY.values())  # 12 bytes on disk (uncompressed shards)


@dataclass
class SampledMatrix:
    """Y_hat (observed log-probs y_q^(i), CSR float32) with the sample counts and per-prompt cost."""

    logprobs: sp.csr_matrix
    counts: sp.csr_matrix
    prompt_tokens: np.ndarray
    N: int
    temperature: float

    @property
    def D(self) -> int:
        return self.logprobs.shape[0]

    def tokens(self) -> int:
        """§5 cost of the N samples per prompt: sum_q (prompt tokens_q + 1 output token) * N."""
        return int((self.prompt_tokens.astype(np.int64) + 1).sum() * self.N)

    def calls(self) -> int:
        return self.D * self.N

    def budget(self) -> dict:
        """D, N, tau and the §5 cost of this matrix (what a report needs besides the estimate)."""
        return {"D": self.D, "N": self.N, "temperature": self.temperature, "tokens": self.tokens(), "calls": self.calls()}

    def cost(self) -> SampledMatrix:
        """The same prompts, N and tau without the entries: what ``budget`` reads, not the sample."""
        empty = sp.csr_matrix(self.logprobs.shape, dtype=np.float32)
        return SampledMatrix(empty, empty, self.prompt_tokens, self.N, self.temperature)

    def subsample(self, N: int, seed: int) -> SampledMatrix:
        """N of the N_max calls of every prompt, drawn without replacement (multivariate hypergeometric): distributed
        as its first N calls. Each call draws anew, so two budgets' thinnings are not nested draw by draw."""
        if not 1 <= N <= self.N:
            raise NVError(f"sub-budget N must be in [1, {self.N}], got {N}")
        if N == self.N:
            return self
        counts, logprobs = _thinned(self.counts, self.logprobs, N, self.N, np.random.default_rng(seed))
        return SampledMatrix(logprobs, counts, self.prompt_tokens, N, self.temperature)


def _thinned(counts: sp.csr_matrix, logprobs: sp.csr_matrix, N: int, N_from: int, rng: np.random.Generator
             ) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Rows of Y_hat (counts, log-probs) of N_from calls each thinned to N calls each, drawing from ``rng`` row after
    row: the same draws whether the rows come whole (``SampledMatrix.subsample``) or a shard at a time with the
    generator carried on (``thin``). A row whose counts sum to less than N_from (calls that named no token: an empty
    or undecodable reply, a defence's withheld log-prob) thins them as one more bucket, dropped after: N of its
    N_from calls, not N of its identified ones (which gave every such row too many, or failed where N exceeded them).
    With ``live.top_logprobs`` > 0 a row's counts are reveals, more than its calls: thinned as they are."""
    indptr = counts.indptr
    # row by row into arrays sized for every entry, then shrunk in place (realloc): only the kept entries are
    # ever written, so resident memory is the thinned sample alone, not an nnz-sized draw and keep mask beside it
    out = {"counts": np.empty_like(counts.data), "indices": np.empty_like(counts.indices),
           "logprobs": np.empty_like(logprobs.data)}
    new_indptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    for q in range(counts.shape[0]):
        row = slice(indptr[q], indptr[q + 1])
        colors = counts.data[row]
        unnamed = N_from - int(colors.sum())
        drawn = rng.multivariate_hypergeometric(np.append(colors, unnamed), N)[:-1] if unnamed > 0 else \
            rng.multivariate_hypergeometric(colors, N)
        keep = drawn > 0
        start, stop = new_indptr[q], new_indptr[q] + np.count_nonzero(keep)
        out["counts"][start:stop] = drawn[keep]
        out["indices"][start:stop] = counts.indices[row][keep]
        out["logprobs"][start:stop] = logprobs.data[row][keep]
        new_indptr[q + 1] = stop
    for a in out.values():
        a.resize(new_indptr[-1], refcheck=False)
    return (sp.csr_matrix((out["counts"], out["indices"], new_indptr), shape=counts.shape),
            sp.csr_matrix((out["logprobs"], out["indices"], new_indptr), shape=counts.shape))


def meta_key(meta: dict) -> str:
    """A short hash of a sample's manifest ``meta``: names the folder of exactly those draws."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def _save_shard(path: Path, samples, vocab_size: int) -> None:
    """Write one shard of the oracle's ``samples`` (one per prompt), atomically (``_save_rows``)."""
    indptr = np.zeros(len(samples) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(s.token_ids) for s in samples])
    _save_rows(path, indptr, np.concatenate([s.token_ids for s in samples]), np.concatenate([s.logprobs for s in samples]),
               np.concatenate([s.counts for s in samples]), np.array([s.prompt_tokens for s in samples]), vocab_size)


def _save_rows(path: Path, indptr, indices, logprobs, counts, prompt_tokens, vocab_size: int) -> None:
    """Write one shard (CSR arrays of its rows and their prompts' tokens) atomically: a temporary file, then a rename."""
    tmp = path.with_suffix(".tmp.npz")
    try:
        np.savez(tmp, indptr=np.asarray(indptr, dtype=np.int64), indices=np.asarray(indices, dtype=ENTRY["indices"]),
                 logprobs=np.asarray(logprobs, dtype=ENTRY["logprobs"]), counts=np.asarray(counts, dtype=ENTRY["counts"]),
                 prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32), vocab_size=vocab_size)
    except BaseException as exc:  # a torn file (a full disk, Ctrl-C) is not left to hold the space
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not exc.filename:  # zipfile's close names no file
            exc.filename = str(path)
        raise
    os.replace(tmp, path)


SHARD_FIELDS = {"indptr", "indices", "counts", "logprobs", "prompt_tokens"}
MANIFEST_KEYS = ("N", "temperature", "chunk", "D", "vocab_size")  # a sample's own; a round's adds its seed and identity
MANIFEST_INTS = tuple(k for k in MANIFEST_KEYS if k != "temperature")


def _length(z, name: str) -> int:
    """The length of array ``name`` of an open .npz, from its header alone (its data is not read)."""
    with z.zip.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        shape = (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)[0]
    return shape[0] if len(shape) == 1 else -1


def _shard_entries(path: Path, rows: int, vocab_size: int, columns: np.ndarray | None = None,
                   values: bool = False) -> int | None:
    """The entries of a whole shard of ``rows`` prompts (only those of ``columns``, a boolean mask over the vocabulary,
    where given), or None where it is not whole: every array of its length (the others' from their headers), row
    pointers from 0 up to its entries, token ids in the vocabulary (ids past it would reach scipy unchecked). One read
    of the shard's indices checks and counts; the values are checked where they are read (``_checked``), or here with
    ``values`` (a checkpoint about to be reused at resume: a damaged member is sampled again, not kept)."""
    try:
        with np.load(path) as z:
            if not SHARD_FIELDS <= set(z.files):
                return None
            indptr, indices = z["indptr"], z["indices"]
            if not (len(indptr) == rows + 1 and indptr[0] == 0 and bool(np.all(np.diff(indptr) >= 0))
                    and len(indices) == indptr[-1] and (not len(indices) or 0 <= indices.min() <= indices.max() < vocab_size)
                    and _length(z, "logprobs") == _length(z, "counts") == len(indices) and _length(z, "prompt_tokens") == rows):
                return None
            if values:
                for field in ("logprobs", "counts", "prompt_tokens"):
                    _checked(field, z[field])
    except Exception:  # a torn or corrupt shard is recomputed
        return None
    return int(indptr[-1]) if columns is None else int(np.count_nonzero(columns[indices]))


def sample_meta(prompts: list[str], N: int, temperature: float, seed: int, vocab_size: int, identity: dict,
                chunk: int = 100) -> dict:
    """The manifest ``collect`` writes for these draws: what they are (N, tau, seed, prompts, vocab_size, the
    target's ``identity``) and how they are stored (``chunk``)."""
    return {"N": N, "temperature": temperature, "seed": seed, "chunk": chunk, "D": len(prompts), "vocab_size": vocab_size,
            "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(), **identity}


def collect(
    oracle: Oracle,
    prompts: list[str],
    N: int,
    temperature: float,
    seed: int,
    out_dir: str | Path,
    vocab_size: int,
    checkpoint_root: str | Path,
    identity: dict,
    chunk: int = 100,
    progress: bool = True,
    prompt_tokens: np.ndarray | None = None,
    desc: str | None = None,
) -> Path:
    """Sample every prompt into the sparse Y_hat (Alg. 1 lines 1-5), in shards under ``out_dir``; return ``out_dir``.

    ``identity`` names the target (model spec and oracle switches): with the prompts, N, tau and
    seed it keys the checkpoint folder under ``checkpoint_root``, so stale work is never reused.
    The oracle is first asked whether the unfinished shards' calls would pass a budget cap (``Oracle.refuses``,
    with ``prompt_tokens``, each prompt's tokens per call, where an earlier sample measured them), and
    ``BudgetExhausted`` says so before anything is sent. ``desc``: the progress bar's label.
    """
    meta = sample_meta(prompts, N, temperature, seed, vocab_size, identity, chunk)
    work = Path(checkpoint_root) / f"sampling-{meta_key(meta)}"
    work.mkdir(parents=True, exist_ok=True)
    (work / MANIFEST).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    todo = [(s, path, n) for s, path, n in _layout(work, meta) if _shard_entries(path, n, vocab_size, values=True) is None]
    if todo:
        rows = [q for s, _, n in todo for q in range(s, s + n)]
        refusal = oracle.refuses([prompts[q] for q in rows], N, temperature, [(seed, q) for q in rows],
                                 None if prompt_tokens is None else prompt_tokens[rows])
        if refusal is not None:
            raise BudgetExhausted(f"budget reached before sampling {N:,} calls per prompt: {refusal}; nothing of it was "
                                  "sent: raise the budget and rerun the same command to resume")
    bar = tqdm(total=len(prompts), initial=len(prompts) - sum(n for _, _, n in todo),
               desc=desc or f"sampling N={N:,}", unit="prompt", disable=not progress)
    for s, path, n in todo:
        samples = oracle.sample(prompts[s : s + n], N, temperature, seeds=[(seed, q) for q in range(s, s + n)])
        _save_shard(path, samples, vocab_size)
        bar.update(n)
    bar.close()
    return place(work, Path(out_dir))


def place(staged: Path, folder: Path) -> Path:
    """Move the finished folder ``staged`` to ``folder`` (what was there removed first): a folder found there is whole."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staged), str(folder))
    return folder


def save_samples(S: SampledMatrix, folder: str | Path, extra: dict | None = None, chunk: int = 100) -> Path:
    """Write Y_hat as ``collect`` does (shards of ``chunk`` prompts and a manifest with ``extra``), for a matrix
    assembled in memory; ``load_samples`` reads it back."""
    blocks = ((S.counts[s : s + chunk], S.logprobs[s : s + chunk], S.prompt_tokens[s : s + chunk]) for s in range(0, S.D, chunk))
    return write_samples(folder, {"N": S.N, "temperature": S.temperature, "chunk": chunk, "D": S.D,
                                  "vocab_size": S.counts.shape[1], **(extra or {})}, blocks)


def write_samples(folder: str | Path, meta: dict, blocks: Iterator[tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]]) -> Path:
    """A sampling folder from ``blocks`` of ``meta["chunk"]`` rows each (the last may be shorter): (counts,
    log-probs, prompt tokens) of each, in row order; ``meta`` is its manifest. Written beside ``folder`` and moved
    into place once whole (``place``); an interrupted write leaves neither a folder that passes for a finished one
    nor the part written."""
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        start = 0
        for counts, logprobs, prompt_tokens in blocks:
            rows = min(meta["chunk"], meta["D"] - start)
            if counts.shape[0] != rows or not (np.array_equal(counts.indptr, logprobs.indptr)
                                               and np.array_equal(counts.indices, logprobs.indices)):
                raise NVError(f"a sample's block at row {start} is not {rows} rows of one pattern of counts and log-probs")
            _save_rows(_shard_path(partial, start), counts.indptr - counts.indptr[0], counts.indices, logprobs.data,
                       counts.data, prompt_tokens, meta["vocab_size"])
            start += rows
        if start != meta["D"]:
            raise NVError(f"a sample's blocks end at row {start}, not at its D = {meta['D']}")
        (partial / MANIFEST).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return place(partial, folder)


def manifest(folder: str | Path) -> dict:
    """The checked manifest of a sampling folder (D, N, tau, chunk, |V|; its shards are checked where they are read)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / MANIFEST).read_text())
    except OSError:
        raise NVError(f"no sampling manifest in {folder}: run the sampling stage first") from None
    except ValueError:
        raise NVError(f"sampling manifest {folder / MANIFEST} is not JSON: rerun the sampling stage") from None
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), int) and meta[k] >= 1 for k in MANIFEST_INTS)
            and isinstance(meta.get("temperature"), (int, float)) and meta["temperature"] > 0):
        raise NVError(f"sampling manifest {folder / MANIFEST} is corrupt (it needs {', '.join(MANIFEST_INTS)} >= 1 and a "
                      "temperature > 0): rerun the sampling stage")
    return meta


def _shard_path(folder: Path, start: int) -> Path:
    """The shard of a sampling folder whose first row is ``start``."""
    return folder / f"shard-{start:07d}.npz"


def _layout(folder: Path, meta: dict, prompts: int | None = None) -> Iterator[tuple[int, Path, int]]:
    """(first row, path, rows) of each shard of a sampling folder, in order; with ``prompts``, of those holding the
    first ``prompts`` rows only."""
    for s in range(0, meta["D"] if prompts is None else min(prompts, meta["D"]), meta["chunk"]):
        yield s, _shard_path(folder, s), min(meta["chunk"], meta["D"] - s)


def _shards(folder: Path, columns: np.ndarray | None = None, prompts: int | None = None) -> tuple[dict, list[Path], int]:
    """The manifest, the checked shard paths of a sampling folder and their entries in all (those of ``columns`` only,
    where given); with ``prompts``, only the shards holding the first ``prompts`` rows."""
    meta = manifest(folder)
    paths, nnz = [], 0
    for _, path, rows in _layout(folder, meta, prompts):
        entries = _shard_entries(path, rows, meta["vocab_size"], columns)
        if entries is None:
            raise NVError(f"sampling shard {path} is missing or corrupt: rerun the sampling stage")
        paths.append(path)
        nnz += entries
    return meta, paths, nnz


def _read_shards(folder: str | Path, fields: tuple[str, ...], columns: np.ndarray | None) -> tuple[dict, dict]:
    """The manifest and Y_hat's CSR arrays (``indptr``, ``prompt_tokens`` and ``fields`` of the shards), filled in place
    shard by shard: peak memory is the matrix itself, not twice it (a list of parts, then their concatenation).
    ``columns`` (a boolean mask over the vocabulary): only those tokens' entries are kept."""
    meta, paths, nnz = _shards(Path(folder), columns)
    arrays = {"indptr": np.zeros(meta["D"] + 1, dtype=np.int64), "prompt_tokens": np.empty(meta["D"], dtype=np.int32),
              **{k: np.empty(nnz, dtype=ENTRY[k]) for k in fields}}
    row = offset = 0
    for path in paths:
        with _reading(path) as z:
            indptr, indices = z["indptr"], z["indices"]  # NpzFile reads an array from the file at every access
            keep = slice(None) if columns is None else columns[indices]
            rows = len(indptr) - 1
            if columns is not None:  # entries kept per row: a running count of the mask at the row boundaries
                indptr = np.concatenate([[0], np.cumsum(keep)])[indptr]
            size = int(indptr[-1])
            arrays["indptr"][row + 1 : row + rows + 1] = indptr[1:] + offset
            for k in fields:
                arrays[k][offset : offset + size] = (indices if k == "indices" else _checked(k, z[k]))[keep]
            arrays["prompt_tokens"][row : row + rows] = _checked("prompt_tokens", z["prompt_tokens"])
        row, offset = row + rows, offset + size
    return meta, arrays


@contextmanager
def _reading(path: Path):
    """An open shard whose reads fail with one line naming it (a damaged zip member passes the cheap check of
    ``_shard_entries`` without ``values`` and shows itself only here)."""
    try:
        with np.load(path) as z:
            yield z
    except NPZ_ERRORS as exc:
        raise NVError(f"sampling shard {path} is corrupt ({exc}): delete it and sample again (dvc repro -f sampling, "
                      "or rerun the attack)") from None


def _checked(field: str, values: np.ndarray) -> np.ndarray:
    """A shard's log-probs (finite), counts or prompt tokens (integers >= 1); else a ValueError saying how many are
    not (``_reading`` names the shard)."""
    if field != "logprobs" and values.dtype.kind not in "iu":
        raise ValueError(f"{field} stored as {values.dtype}, not integers")
    ok = np.isfinite(values) if field == "logprobs" else values >= 1
    if not ok.all():
        raise ValueError(f"{np.count_nonzero(~ok)} {field} {'not finite' if field == 'logprobs' else 'below 1'}")
    return values


def observed_mask(folder: str | Path) -> sp.csr_matrix:
    """The D x |V| observation mask of Y_hat (boolean CSR: which tokens each prompt drew), streamed shard by shard from
    the indices alone: 5 bytes per observed entry against the 12 of ``load_samples`` (greedy pruning needs no more)."""
    meta, a = _read_shards(folder, ("indices",), None)
    return sp.csr_matrix((np.ones(a["indices"].size, dtype=bool), a["indices"], a["indptr"]), shape=(meta["D"], meta["vocab_size"]))


def iter_shards(folder: str | Path, chunk: int | None = None
                ) -> tuple[dict, Iterator[tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]]]:
    """Y_hat of ``folder`` a few rows at a time, for work that needs no more in memory at once: the manifest and an
    iterator of (counts, log-probs, prompt tokens) of each shard's rows (CSR), or of each block of ``chunk`` rows where
    given (the shards of another folder, whatever this one's own)."""
    meta, paths, _ = _shards(Path(folder))

    def shards() -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]]:
        return (_shard(path, meta["vocab_size"]) for path in paths)

    def blocks() -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]]:
        own, held, read = shards(), [], 0  # shards read that reach past the rows given: (first row, its three arrays)
        for start in range(0, meta["D"], chunk):
            stop = min(start + chunk, meta["D"])
            while read < stop:
                held.append((read, *next(own)))
                read += held[-1][1].shape[0]
            parts = [[x[max(start, first) - first : stop - first] for x in arrays] for first, *arrays in held]
            yield (sp.vstack([p[0] for p in parts], format="csr"), sp.vstack([p[1] for p in parts], format="csr"),
                   np.concatenate([p[2] for p in parts]))
            held = [h for h in held if h[0] + h[1].shape[0] > stop]

    return meta, shards() if chunk is None or chunk == meta["chunk"] else blocks()


def _shard(path: Path, vocab_size: int) -> tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """The (counts, log-probs, prompt tokens) of one checked shard's rows (``_shards``)."""
    with _reading(path) as z:
        indices, indptr = z["indices"], z["indptr"]
        shape = (len(indptr) - 1, vocab_size)
        counts = sp.csr_matrix((_checked("counts", z["counts"]), indices, indptr), shape=shape)
        logprobs = sp.csr_matrix((_checked("logprobs", z["logprobs"]), indices, indptr), shape=shape)
        return counts, logprobs, _checked("prompt_tokens", z["prompt_tokens"])


def head(folder: str | Path, prompts: int, N: int, seed: int) -> SampledMatrix:
    """The first ``prompts`` rows of ``load_samples(folder).subsample(N, seed)``, read from the shards holding them
    alone: rows are thinned in order, so the thinning of the first prompts is the first prompts of the thinning."""
    if prompts < 1:
        raise NVError(f"the first prompts of a sample must be at least 1, got {prompts}")
    meta, paths, _ = _shards(Path(folder), prompts=prompts)
    if not 1 <= N <= meta["N"]:
        raise NVError(f"sub-budget N must be in [1, {meta['N']}], got {N}")
    rng, parts, left = np.random.default_rng(seed), [], min(prompts, meta["D"])
    for path in paths:
        counts, logprobs, prompt_tokens = (x[:left] for x in _shard(path, meta["vocab_size"]))
        if N < meta["N"]:  # as ``subsample``: its own N is the sample itself, no draw
            counts, logprobs = _thinned(counts, logprobs, N, meta["N"], rng)
        parts.append((counts, logprobs, prompt_tokens))
        left -= counts.shape[0]
    return SampledMatrix(sp.vstack([p[1] for p in parts], format="csr"), sp.vstack([p[0] for p in parts], format="csr"),
                         np.concatenate([p[2] for p in parts]), N, meta["temperature"])


def thin(folder: str | Path, out: str | Path, N: int, seed: int) -> Path:
    """``load_samples(folder).subsample(N, seed)`` written to ``out``, a shard at a time (the same draws, without
    holding either sample); returns ``out``."""
    meta, shards = iter_shards(folder)
    if not 1 <= N <= meta["N"]:
        raise NVError(f"sub-budget N must be in [1, {meta['N']}], got {N}")
    rng = np.random.default_rng(seed)
    return write_samples(out, {k: meta[k] for k in MANIFEST_KEYS} | {"N": N},
                         (_thinned(counts, logprobs, N, meta["N"], rng) + (prompt_tokens,)
                          for counts, logprobs, prompt_tokens in shards))


@contextmanager
def thinned_folder(folder: str | Path, N: int, seed: int) -> Iterator[Path]:
    """The draws of ``folder`` thinned to N calls a prompt, as a folder (``load_samples`` of it is
    ``load_samples(folder).subsample(N, seed)``): a scratch folder written by ``thin`` and removed on exit, or
    ``folder`` itself at its own N. Nested budgets read this way never hold the whole sample beside its thinning."""
    if N == manifest(folder)["N"]:
        yield Path(folder)
        return
    scratch = Path(tempfile.mkdtemp(prefix=f"nv-thin-N{N}-"))
    try:
        yield thin(folder, scratch / "samples", N, seed)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_samples(folder: str | Path, columns: np.ndarray | None = None) -> SampledMatrix:
    """Reassemble Y_hat from the shards written by ``collect``; ``columns`` (a boolean mask over the vocabulary): only
    those tokens' entries are read into memory (a sample too large to hold, e.g. the paper's 20,000 x 10^6)."""
    meta, a = _read_shards(folder, ("indices", "logprobs", "counts"), columns)
    shape = (meta["D"], meta["vocab_size"])
    logprobs = sp.csr_matrix((a["logprobs"], a["indices"], a["indptr"]), shape=shape)
    counts = sp.csr_matrix((a["counts"], a["indices"], a["indptr"]), shape=shape)
    return SampledMatrix(logprobs, counts, a["prompt_tokens"], meta["N"], meta["temperature"])


def sample_budget(folder: str | Path) -> dict:
    """``SampledMatrix.budget`` of the sample stored in ``folder`` (D, N, tau, §5 cost): the manifest and each shard's
    prompt tokens alone are read, its entries left unread."""
    folder = Path(folder)
    meta, parts = manifest(folder), []
    for _, path, rows in _layout(folder, meta):
        try:
            with np.load(path) as z:
                prompt_tokens = _checked("prompt_tokens", z["prompt_tokens"])
        except (*NPZ_ERRORS, KeyError):  # _checked's ValueError among them
            prompt_tokens = None
        if prompt_tokens is None or prompt_tokens.shape != (rows,):
            raise NVError(f"sampling shard {path} is missing or corrupt: rerun the sampling stage")
        parts.append(prompt_tokens)
    empty = sp.csr_matrix((meta["D"], meta["vocab_size"]), dtype=np.float32)
    return SampledMatrix(empty, empty, np.concatenate(parts), meta["N"], meta["temperature"]).budget()
