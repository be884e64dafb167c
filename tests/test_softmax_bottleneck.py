"""The softmax bottleneck on the real model: full log-prob rows have rank d = 576 (row-centred)."""

import numpy as np

from nv.oracle import Simulator
from nv.phase1.search import random_prompts


def test_full_logprob_matrix_drops_at_the_hidden_dimension(lm32):
    prompts = random_prompts(np.random.default_rng(0), 700)
    Y = Simulator(lm32, logits="float32", batch_size=100).log_probs(prompts)  # 700 x 49152, white-box
    Y = Y - Y.mean(axis=1, keepdims=True)
    sigma = np.sqrt(np.clip(np.linalg.eigvalsh(Y @ Y.T)[::-1], 0, None))
    drops = np.log(sigma[:-1] / np.maximum(sigma[1:], 1e-300))
    assert int(np.argmax(drops[:690])) + 1 == 576  # 576 singular values before the largest drop
    assert sigma[575] / sigma[576] > 50
