"""Loading a causal LM for white-box simulation, and its true architecture (evaluation only).

A model spec is one of:
- a packaged model name (``nv.models.packaged``): ``embedded`` (SmolLM2-135M-Instruct, the default),
  ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``, GGUF files shipped in registry packages;
- a path to a local ``.gguf`` file;
- a local folder with a transformers checkpoint;
- a Hugging Face model id (needs the hub or its local cache; the GPU user's path).

GGUF files are dequantised by transformers (~30 s for the embedded model), so the dequantised model is
cached once as float32 safetensors under the cache folder, keyed by the file's SHA-256, and every load,
in either dtype, reads that copy (< 1 s): the weights do not depend on where the file lies (a fresh
venv, a copy) nor on which dtype a machine happened to load first (a bf16 copy read in float32 would
carry bf16-rounded weights).

On a CPU without a bf16 GEMM (AVX2-only hosts), ``float32_gemms`` runs every linear layer's product in float32 on the
same bf16 values, as a bf16 GEMM does elsewhere, 4x faster than torch's fallback there; every model built here
(``load_model``, ``reference_family.random_llama``) goes through it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import shutil
import tempfile
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nv.errors import NVError
from nv.models.packaged import PACKAGED, cache_folder, file_sha256, packaged_gguf, read_gguf, tied_embeddings

EMBEDDED = "embedded"
DTYPES = ("bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")

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
    """The embedded model's GGUF file (also the quantisation template of the reference family's GGUFs)."""
    return packaged_gguf(EMBEDDED, default_cache_dir())


def resolve(spec: str) -> tuple[str, str | None]:
    """Map a model spec to (``from_pretrained`` source, gguf file name or None)."""
    if spec in PACKAGED:
        path = packaged_gguf(spec, default_cache_dir())
        return str(path.parent), path.name
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if path.is_dir():
            raise NVError(f"{spec} is a folder, not a GGUF file")
        if not path.is_file():
            raise NVError(f"GGUF file not found: {spec}")
        return str(path.parent.resolve()), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NVError(f"model folder {spec} has no config.json: give a transformers model folder (config.json, "
                          "weights, tokenizer) or a .gguf file")
        return str(path.resolve()), None
    if path.exists():
        raise NVError(f"model path is neither a folder nor a .gguf file: {spec}")
    return spec, None  # a Hugging Face hub id


def gguf_path(spec: str) -> Path | None:
    """The GGUF file a model spec names (a packaged model or a .gguf path), None for a folder or hub id."""
    source, gguf = resolve(spec)
    return Path(source) / gguf if gguf else None


def architecture(model) -> Architecture:
    """d, L, |V|, heads, kv heads, d_ffn, tying and total parameters from the config."""
    cfg = model.config
    text_cfg = getattr(cfg, "text_config", None) or cfg
    n_heads = getattr(text_cfg, "num_attention_heads", None)
    if not n_heads:
        raise NVError(f"model type {getattr(cfg, 'model_type', '?')!r} is not a transformer decoder (its config has no "
                      "attention heads): the attack's phase 2 and the report need one")
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


def torch_device(device: str = "auto") -> str:
    """params.yaml's ``model.device`` as a torch device: ``auto`` is cuda where torch sees a GPU, else cpu.
    Every model the project loads or builds (target, references, baselines) goes to this one device."""
    import torch

    if device not in DEVICES:
        raise NVError(f"model.device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise NVError("model.device is cuda, but torch sees no CUDA GPU on this machine: set model.device to auto or cpu")
    return device


def _gguf_cache_folder(spec: str, path: Path, cache_dir: Path) -> Path:
    """The cache folder of GGUF ``path``: named by the file's SHA-256 (a packaged model's from the table; a file given
    by path is hashed at each load, ~2 s per GB here)."""
    sha = PACKAGED[spec].sha256 if spec in PACKAGED else file_sha256(path)
    return cache_dir / f"{path.stem}-{sha[:16]}"


def _from_pretrained(source: str, gguf: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), output_loading_info=True,
                                                           **kwargs)
    except (OSError, ValueError, KeyError) as exc:  # ValueError, KeyError: an architecture transformers cannot build
        hint = " (offline: HF_HUB_OFFLINE=1)" if offline and isinstance(exc, OSError) else ""
        raise NVError(f"cannot load model '{source}'{hint}: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
    # a config claiming more layers than the weights hold (random weights for the rest), or fewer (a layer dropped); a
    # GGUF's own header is checked by read_gguf, as transformers skips the tensors it has no place for
    for keys, verb in ((sorted(info["missing_keys"]), "has no weights for"),
                       (sorted(k for k in info["unexpected_keys"] if ".layers." in k), "holds weights its config has no place for:")):
        if keys:
            raise NVError(f"model '{Path(source, gguf or '')}' {verb} {len(keys)} parameter(s) ({keys[0]}, ...): its config "
                          "does not match its weights")
    return model, tokenizer


STAMP = "nv-stamp.json"  # a cache entry's files as written (size, modification time): changed since, it is rebuilt


def _stamp(folder: Path) -> dict:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP}


def _write_cache(model, tokenizer, folder: Path) -> bool:
    """Save a dequantised GGUF model as safetensors with its ``STAMP``, atomically (tmp folder + rename); False if it
    could not."""
    from safetensors import SafetensorError

    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=cache_folder(folder.parent), prefix=".tmp-"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(_stamp(tmp)))
        tmp.rename(folder)
        return True
    except (OSError, SafetensorError, NVError) as exc:  # safetensors raises its own error for the weights' I/O (a full disk)
        log.warning("could not cache the dequantised model in %s: %s", folder, exc)
        return False
    finally:  # also on Ctrl-C, SIGTERM or a MemoryError mid-save: no GB-sized .tmp-* folder left in the cache
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(spec: str, source: str, gguf: str, dtype: str, cache_dir: Path):
    """(model, tokenizer) of a GGUF file in ``dtype``, read from its float32 cache entry, built on first use; an
    entry whose files changed since they were written (``STAMP``: cut short, overwritten in place) or that cannot be
    read is rebuilt with a warning. Where no entry can be written, the file is loaded directly."""
    folder = _gguf_cache_folder(spec, Path(source) / gguf, cache_dir)
    if folder.is_dir():
        try:
            if json.loads((folder / STAMP).read_text()) != _stamp(folder):
                raise NVError("its files changed since it was written")
            return _from_pretrained(str(folder), None, dtype)
        except Exception as exc:  # any unreadable cache entry is rebuilt from the source, unless memory ran out (a
            # MemoryError, or torch's RuntimeError "can't allocate memory"): a sound entry, whose rebuild needs more
            if isinstance(exc, MemoryError) or "allocate memory" in str(exc) or "out of memory" in str(exc):
                raise
            log.warning("model cache %s is unreadable (%s): rebuilding it", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    read_gguf(Path(source) / gguf)  # a truncated or corrupt file: one line, not transformers' traceback
    model, tokenizer = _from_pretrained(source, gguf, "float32")
    if not _write_cache(model, tokenizer, folder):
        return (model, tokenizer) if dtype == "float32" else _from_pretrained(source, gguf, dtype)
    del model
    release_memory()  # the dequantisation's freed blocks, before the entry is read back (README: Models)
    return _from_pretrained(str(folder), None, dtype)


def load_model(spec: str = EMBEDDED, dtype: str = "bfloat16", cache_dir: Path | None = None, device: str = "auto") -> LoadedModel:
    """Load ``spec`` for inference in ``dtype`` (compute precision) on ``device`` (see ``torch_device``), eval mode.

    GGUF sources go through a float32 safetensors cache (``_load_gguf``).
    """
    if dtype not in DTYPES:
        raise NVError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    target_device = torch_device(device)
    source, gguf = resolve(spec)
    if gguf:
        model, tokenizer = _load_gguf(spec, source, gguf, dtype, cache_dir or default_cache_dir())
    else:
        model, tokenizer = _from_pretrained(source, None, dtype)
    model.eval().to(target_device)
    float32_gemms(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    arch = architecture(model)
    if gguf and not arch.tied_embeddings and tied_embeddings(read_gguf(Path(source) / gguf)):
        # the file stores the one matrix twice (its output.weight is the embedding): loaded untied, counted once
        arch = replace(arch, tied_embeddings=True, params=arch.params - arch.vocab_size * arch.d)
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, arch=arch)


def bf16_gemm_native() -> bool:
    """Whether torch multiplies bf16 matrices with oneDNN on this CPU (it needs AVX-512 or better); where it does
    not (AVX2-only hosts), torch's fallback GEMM ran a bf16 forward pass ~6x slower than float32 (6.4x on SmolLM2; README: Determinism)."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if probe is None else bool(probe())


def _float32_linear(self, x):
    """``nn.Linear`` as a bf16 GEMM computes it: float32 products and sums of the bf16 inputs and weights (exact in
    float32), the output rounded to the input's dtype; the same as ``F.linear`` for float32 inputs."""
    import torch.nn.functional as F

    bias = None if self.bias is None else self.bias.float()
    return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def float32_gemms(model) -> int:
    """On a CPU without a bf16 GEMM (``bf16_gemm_native``), every ``nn.Linear`` of ``model`` runs its product in
    float32 on the same bf16 values (``_float32_linear``; the weights cast per call, so no memory is added); elsewhere
    nothing changes. Returns the number of layers switched."""
    import torch

    if next(model.parameters()).device.type != "cpu" or bf16_gemm_native():
        return 0
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in layers:
        m.forward = types.MethodType(_float32_linear, m)
    return len(layers)


def release_memory() -> None:
    """Hand the memory of objects already dropped (a model the caller has ``del``-ed) back to the OS: a garbage
    collection, then glibc's ``malloc_trim(0)`` where the C library has it. glibc keeps freed blocks below its mmap
    threshold (the forward passes' activations) in the process: after the 1.5B's prompt search, 3.6 GB stayed
    resident once the model was deleted and collected, 0.5 GB after the trim (README: validation, peak memory)."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
