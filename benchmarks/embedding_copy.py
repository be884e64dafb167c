"""Is a GGUF's separate ``output.weight`` a real unembedding, or the token embedding written twice?

The packaged table (``nv/models/packaged.py``) calls a model untied when its GGUF has an ``output.weight``
tensor, as the GGUF header says; a converter can write a tied model's one matrix twice, quantised two ways,
and the model then counts V d parameters more than it was trained with. Per packaged model: the quantisation
of both matrices, the cosine between the same row of each (``--rows`` random rows, dequantised), and V d, the
parameters counted twice where it is a copy. Rows of a real pair of
matrices are unrelated (cosine ~0); a copy differs only by quantisation (cosine ~1). A model whose GGUF is not
assembled yet is assembled first (``nv.models.packaged``). Run: python benchmarks/embedding_copy.py [--rows 2000]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf.quants import dequantize

from nv.models.loading import gguf_path
from nv.models.packaged import PACKAGED, gguf_facts, read_gguf


def row_cosines(path, rows: int, seed: int) -> tuple[str, str, np.ndarray] | None:
    """(embedding quant, output quant, cosines of ``rows`` random rows), None where the file has no output.weight."""
    tensors = {t.name: t for t in read_gguf(path).tensors}
    if "output.weight" not in tensors:
        return None
    E, O = tensors["token_embd.weight"], tensors["output.weight"]
    pick = np.sort(np.random.default_rng(seed).choice(E.data.shape[0], rows, replace=False))
    e = dequantize(E.data[pick], E.tensor_type).astype(np.float64)  # quantised blocks run along a row
    o = dequantize(O.data[pick], O.tensor_type).astype(np.float64)
    cos = (e * o).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(o, axis=1)
    return E.tensor_type.name, O.tensor_type.name, cos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in PACKAGED:
        path = gguf_path(name)
        facts = gguf_facts(path)
        found = row_cosines(path, args.rows, args.seed)
        if found is None:
            print(f"{name}: no output.weight (tied in the file)")
            continue
        e_q, o_q, cos = found
        V, d = facts["vocab_size"], facts["d"]
        print(f"{name}: token_embd {e_q}, output {o_q}; row cosine median {np.median(cos):.4f}, min {cos.min():.4f}, "
              f"max {cos.max():.4f} over {len(cos)} rows -> {'a copy of the embedding' if cos.min() > 0.9 else 'its own matrix'}; "
              f"V d = {V * d:,} parameters counted twice if a copy")


if __name__ == "__main__":
    main()
