"""The timing attack's reference family F (§4.2, Fig. algo_timing): models of known d and L.

On a GPU the family is a list of real model ids. On this CPU machine it is LLaMA-style decoder
transformers (GQA, SwiGLU, RMSNorm, RoPE) built from configs with random weights: prefill time
depends on the shapes, not on the weight values. The same random model is also written as a GGUF
file (the embedded model's tokenizer and quantisation layout) so a llama.cpp server can time it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.models.loading import LoadedModel, architecture, float32_gemms

HEAD_DIM = 64


@dataclass(frozen=True)
class Shape:
    """A LLaMA-style architecture: hidden size d, depth L, heads, KV heads, FFN width, vocabulary."""

    d: int
    L: int
    n_heads: int
    n_kv_heads: int
    d_ffn: int
    vocab_size: int
    max_positions: int

    def __post_init__(self):
        if min(self.d, self.L, self.n_heads, self.n_kv_heads, self.d_ffn, self.vocab_size) < 1:
            raise NVError(f"every size of a reference model must be >= 1: {self}")
        if self.d % self.n_heads or self.n_heads % self.n_kv_heads:
            raise NVError(f"d must split into heads and heads into KV groups: {self}")

    @property
    def d_kv(self) -> float:
        """App. D: d_kv = n_kv d / n_heads."""
        return self.n_kv_heads * self.d / self.n_heads


def shape_from_entry(entry: dict, vocab_size: int, max_positions: int) -> Shape:
    """A params.yaml family entry {d, L, d_ffn, n_kv_heads[, head_dim]}: heads of head_dim dimensions (default 64),
    n_kv_heads of them shared keys and values."""
    d, head = int(entry["d"]), int(entry.get("head_dim", HEAD_DIM))
    if d % head:
        raise NVError(f"reference model d={d} must be a multiple of the head size {head}")
    return Shape(d, int(entry["L"]), d // head, int(entry["n_kv_heads"]), int(entry["d_ffn"]), vocab_size, max_positions)


def random_llama(shape: Shape, tokenizer, dtype: str, seed: int, name: str, device: str = "cpu") -> LoadedModel:
    """A randomly initialised ``LlamaForCausalLM`` of ``shape`` (untied embeddings, as in LLaMA) on ``device``
    (initialised on the CPU, so the weights depend on ``seed`` only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.d,
        intermediate_size=shape.d_ffn,
        num_hidden_layers=shape.L,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        rope_theta=100000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval().to(device)
    float32_gemms(model)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, arch=architecture(model))


# transformers parameter name -> GGUF tensor name (LLaMA layout)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    name = name.removesuffix(".weight")
    if name == "model.embed_tokens":
        return "token_embd.weight"
    if name == "model.norm":
        return "output_norm.weight"
    if name == "lm_head":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.weight"


def _role(gguf_name: str) -> str:
    """The template tensor whose quantisation a tensor takes: same role in layer 0; the untied
    output head takes the (tied) template's embedding type."""
    if gguf_name == "output.weight":
        return "token_embd.weight"
    parts = gguf_name.split(".")
    return ".".join(["blk", "0", *parts[2:]]) if parts[0] == "blk" else gguf_name


def write_gguf(lm: LoadedModel, template: Path, path: Path) -> Path:
    """Write ``lm`` as a LLaMA GGUF for llama.cpp, quantised like ``template`` (the embedded model:
    Q8_0 embeddings, Q4_1 matrices, F32 norms), with the template's tokenizer and chat template.

    Q/K rows are not permuted for llama.cpp's RoPE layout: the weights are random and only timed.
    Written to a temporary name and renamed, so a crash never leaves a truncated file behind.
    """
    import gguf

    reader = gguf.GGUFReader(str(template))
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    arch = lm.arch
    if arch.vocab_size != len(reader.fields["tokenizer.ggml.tokens"].data):
        raise NVError(f"a GGUF reference model must use the template's vocabulary ({arch.vocab_size:,} tokens against "
                      f"{len(reader.fields['tokenizer.ggml.tokens'].data):,}): time the references on the llamacpp "
                      "platform with the embedded model as model.spec, or drop llamacpp from timing.platforms")
    odd = [f"{k} = {v}" for k, v in (("d", arch.d), ("d_ffn", arch.d_ffn)) if v % 32]
    if odd:  # the template's Q4_1 / Q8_0 blocks hold 32 weights of a row
        raise NVError(f"reference {lm.name}: {', '.join(odd)} is not a multiple of 32, which llama.cpp's quantised "
                      "blocks need: give its timing_family entry multiples of 32")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # a process's own: two writing one reference do not share it
    writer = gguf.GGUFWriter(str(tmp), "llama")
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.", "general.quantization_version")):
            value = field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, kind, sub_type=sub)
    writer.add_name(lm.name)
    writer.add_context_length(arch.max_positions)
    writer.add_embedding_length(arch.d)
    writer.add_block_count(arch.L)
    writer.add_feed_forward_length(arch.d_ffn)
    writer.add_head_count(arch.n_heads)
    writer.add_head_count_kv(arch.n_kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(arch.d // arch.n_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(arch.vocab_size)
    for name, tensor in lm.model.state_dict().items():
        target = _gguf_name(name)
        data = tensor.float().numpy()
        kind = kinds.get(_role(target), gguf.GGMLQuantizationType.F32)
        if data.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, data.astype(np.float32))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, kind), raw_dtype=kind)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
