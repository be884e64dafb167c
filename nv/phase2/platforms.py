"""The models timed by phase 2 and the platforms they are timed on (Stage 1 of Fig. algo_timing).

A platform is an oracle backend with its own settings: ``inprocess`` (the model's forward pass in
this process, the reference platform here) or ``llamacpp`` (a llama.cpp server on 127.0.0.1 reached
over its OpenAI-compatible HTTP API, timed from request to first token). Attack code sees only
``Oracle.time_request``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.models.loading import LoadedModel, default_cache_dir, embedded_gguf, gguf_path, load_model
from nv.models.packaged import cache_folder, read_gguf
from nv.outputs import read_json
from nv.oracle import Oracle, Simulator
from nv.models.reference_family import random_llama, shape_from_entry, write_gguf
from nv.phase2.protocol import LengthTimings, collect_timings, summarize
from nv.phase2.fit import sweep_lengths


@dataclass
class TimedModel:
    """One model of F or the target g: its true facts (never read by the attack) and what the attack
    uses: the d of the fits and the shape of its App. D sweep (true d, d_kv, d_ffn for references;
    d_hat and the default ratios for the target)."""

    name: str
    role: str  # "reference" or "target"
    lm: LoadedModel
    d_used: int
    d_kv_used: float
    d_ffn_used: float
    p_max: int
    gguf: Path | None = None  # the file a llama.cpp server serves
    synthetic: bool = False  # random weights, written as GGUF on demand

    def lengths(self, r: float, n: int, fit: int = 2) -> np.ndarray:
        """App. D sweep with the platform's crossover ratio r (Eq. 11), at least ``fit`` lengths (``sweep_lengths``)."""
        return sweep_lengths(self.d_used, self.d_kv_used, self.d_ffn_used, self.p_max, r, n, fit)

    def facts(self) -> dict:
        a = self.lm.arch
        return {"model": self.name, "role": self.role, "d": a.d, "L": a.L, "P": a.params, "vocab_size": a.vocab_size,
                "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "d_ffn": a.d_ffn, "tied": a.tied_embeddings,
                "d_used": self.d_used}


def reference_model(name: str, entry: dict, target: LoadedModel, seed: int) -> TimedModel:
    """A reference model of F: a real model ``{spec}`` (hub id, folder or .gguf; GPU profile), or a
    random-weight LLaMA of the given shape with the target's tokenizer and context length, on the
    target's device (both are timed on the same hardware)."""
    dtype = str(target.model.dtype).removeprefix("torch.")
    device = target.model.device.type
    if "spec" in entry:
        return at_true_shape(name, "reference", load_model(entry["spec"], dtype=dtype, device=device), entry["spec"])
    shape = shape_from_entry(entry, target.arch.vocab_size, target.arch.max_positions)
    lm = random_llama(shape, target.tokenizer, dtype, seed, name, device)
    return TimedModel(name, "reference", lm, shape.d, shape.d_kv, shape.d_ffn, shape.max_positions, synthetic=True)


def at_true_shape(name: str, role: str, lm: LoadedModel, spec: str) -> TimedModel:
    """``lm`` (loaded from ``spec``) swept by its own d, d_kv, d_ffn and context: a real reference model, or a
    target swept by its true ratios (an oracle, for benchmarks)."""
    a = lm.arch
    return TimedModel(name, role, lm, a.d, a.n_kv_heads * a.d / a.n_heads, a.d_ffn, a.max_positions, gguf_path(spec))


def target_model(model: dict, timing: dict, target: dict, d_hat: int) -> TimedModel:
    """The attacked model: its d_kv and d_ffn are unknown, so its sweep takes d_hat and the default ratios."""
    lm = load_model(model["spec"], dtype=model["dtype"], device=model["device"])
    return TimedModel(model["spec"], "target", lm, d_hat, timing["kv_ratio"] * d_hat, timing["ffn_ratio"] * d_hat,
                      target["p_max"], gguf_path(model["spec"]))


def platforms_of(model: TimedModel, timing: dict) -> list[str]:
    """The platforms timing ``model``: the target on all, a reference where its ``references`` lists it."""
    return [name for name, cfg in timing["platforms"].items()
            if model.role == "target" or cfg["references"] == "all" or model.name in cfg["references"]]


def _gguf_for(model: TimedModel, seed: int) -> Path:
    """The GGUF a llama.cpp server serves: the model's own file, or a random-weight reference written
    once (cached)."""
    if model.gguf is not None:
        return model.gguf
    if not model.synthetic:
        raise NVError(f"the llamacpp platform serves GGUF files; {model.lm.name} is not one")
    key = hashlib.sha256(json.dumps([model.facts(), seed]).encode()).hexdigest()[:12]
    path = default_cache_dir() / "reference-gguf" / f"{model.name}-{key}.gguf"
    if path.is_file():
        try:
            read_gguf(path)
        except NVError:  # written atomically, so cut short or damaged outside nv: written again
            path.unlink()
    if not path.is_file():
        cache_folder(path.parent)
        write_gguf(model.lm, embedded_gguf(), path)
    model.gguf = path
    return path


@contextmanager
def platform_oracle(platform: str, model: TimedModel, threads: int, n_ctx: int, seed: int,
                    prompt_cache: bool = False) -> Iterator[Oracle]:
    """An oracle serving ``model`` on ``platform`` with ``threads`` CPU threads (a llama.cpp server
    with an ``n_ctx`` context is started and stopped here). ``prompt_cache``: the in-process platform keeps the
    previous timed call's KV as a server does (llama.cpp's server always does: App. D's random prefixes defeat it)."""
    if platform == "inprocess":
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield Simulator(model.lm, template=True, batch_size=1, prompt_cache=prompt_cache)
        finally:
            torch.set_num_threads(before)
    elif platform == "llamacpp":
        from nv.models.llama_server import LlamaServer
        from nv.oracle.http import HTTPOracle

        # no log-probs: with them llama.cpp computes logits at every prompt position (~3x the prefill here)
        with LlamaServer(_gguf_for(model, seed), n_ctx=n_ctx, n_threads=threads, logprobs=False) as server:
            oracle = HTTPOracle(server.base_url, server.model_name)
            try:
                yield oracle
            finally:
                oracle.close()
    else:
        raise NVError(f"unknown timing platform {platform!r}")


def time_platform(model: TimedModel, platform: str, cfg: dict, lengths: np.ndarray, timing: dict, seed: int,
                  checkpoint: Path, progress: bool = True) -> dict:
    """``model`` timed on ``platform`` (its settings ``cfg``: r, trials, threads) at ``lengths`` with App. D's
    protocol, resumable from ``checkpoint``: the record (facts, raw trials, App. D summary)."""
    with platform_oracle(platform, model, cfg["threads"], int(lengths.max()) + 256, seed) as oracle:
        rows = collect_timings(oracle, lengths, cfg["trials"], timing["warmups"], seed, checkpoint,
                               run_key(model, platform, cfg), progress)
    return timing_record(model, platform, cfg, lengths, rows, timing["trim"])


def run_key(model: TimedModel, platform: str, cfg: dict) -> dict:
    """What keys a timing checkpoint: the model's facts, the platform and its settings."""
    return {**model.facts(), "platform": platform, **cfg}


def timing_record(model: TimedModel, platform: str, cfg: dict, lengths: np.ndarray, rows: list[LengthTimings],
                  trim: float) -> dict:
    """The record of ``model`` timed on ``platform``: its facts, the raw trials and App. D's summary."""
    stats = summarize(rows, trim)
    return {**model.facts(), "platform": platform, "r": cfg["r"], "lengths": lengths.tolist(), "trials": cfg["trials"],
            "rows": [r.record() for r in rows],
            "ell": stats["ell"].tolist(), "T": stats["T"].tolist(), "sigma": stats["sigma"].tolist(),
            "tokens": int(stats["tokens"])}


def time_model(model: TimedModel, timing: dict, seed: int, out_dir: Path, checkpoints: Path, progress: bool = True) -> dict:
    """Time ``model`` on each of its platforms over its App. D sweep; write ``<platform>.json`` per platform
    (``time_platform``'s record) to ``out_dir`` and return them by platform."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    if "llamacpp" in platforms_of(model, timing):  # a model that platform cannot serve fails before any platform is timed
        _gguf_for(model, seed)
    for platform in platforms_of(model, timing):
        cfg = timing["platforms"][platform]
        checkpoint = checkpoints / f"timing-{model.name}-{platform}.jsonl"
        lengths = model.lengths(cfg["r"], timing["n_lengths"], timing["discard"] + 2)
        record = time_platform(model, platform, cfg, lengths, timing, seed, checkpoint, progress)
        (out_dir / f"{platform}.json").write_text(json.dumps(record, indent=1))
        checkpoint.unlink()
        results[platform] = record
    return results


def target_d_hat(setting: str | int, metrics: Path) -> int:
    """The d_hat the target's sweep and fits use: phase 1's snapped estimate, or a given int."""
    if setting != "phase1":
        return int(setting)
    if not metrics.is_file():
        raise NVError(f"{metrics} is missing: run phase 1 (dvc repro spectrum) or set timing_target.d_hat to an int")
    record = read_json(metrics, "spectrum")
    if not record.get("d_hat"):
        raise NVError(f"phase 1 found no hidden dimension ({record.get('reason')}): raise its budget or set timing_target.d_hat")
    return int(record["d_hat"])
