"""Is a GGUF's separate ``output.weight`` a real unembedding, or the token embedding written twice?

A converter can write a tied model's one matrix twice, quantised two ways; read by the tensor's presence (the GGUF
header's tensor list), the model would count V d parameters more than it was trained with.
``nv.models.packaged.tied_embeddings`` decides tying from the content on 256 rows (every row's cosine > 0.99); this
prints the evidence on more. Per packaged model: the quantisation of both matrices, the cosine between the same row
of each (``--rows`` random rows, dequantised) and V d, the parameters counted twice where it is a copy. Rows of two
trained matrices are unrelated (cosine ~0); a copy differs only by quantisation (cosine ~1). A model whose GGUF is
not assembled yet is assembled first. Run: python benchmarks/embedding_copy.py [--rows 2000]
"""

from __future__ import annotations

import argparse

import numpy as np

from nv.models.loading import gguf_path
from nv.models.packaged import COPY_COSINE, PACKAGED, embedding_row_cosines, read_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in PACKAGED:
        reader = read_gguf(gguf_path(name))
        cos = embedding_row_cosines(reader, args.rows, args.seed)
        if cos is None:
            print(f"{name}: no output.weight (tied in the file)")
            continue
        E, O = (next(t for t in reader.tensors if t.name == n) for n in ("token_embd.weight", "output.weight"))
        V, d = E.data.shape[0], PACKAGED[name].facts["d"]
        verdict = "a copy of the embedding" if cos.min() > COPY_COSINE else "its own matrix"
        print(f"{name}: token_embd {E.tensor_type.name}, output {O.tensor_type.name}; row cosine median "
              f"{np.median(cos):.4f}, min {cos.min():.4f}, max {cos.max():.4f} over {len(cos)} rows -> {verdict}; "
              f"V d = {V * d:,} parameters counted twice if a copy")


if __name__ == "__main__":
    main()
