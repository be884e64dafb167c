"""Simulator throughput (prompts/s, chat template) and the cost of drawing N = 10^6 samples.

Targets (issue 2): >= 60 prompts/s at batch 128 with prefix reuse on a 2-core CPU (bf16 compute);
N = 10^6 samples for one prompt in <= 5 ms. Prints figures and ratios against the naive paths.
"""

from __future__ import annotations

import time

import numpy as np

from nv.models.loading import load_model
from nv.oracle.multinomial import multinomial_counts
from nv.oracle import Simulator
from nv.oracle.simulator import log_softmax
from nv.phase1.search import random_prompts


def best_rate(sim: Simulator, prompts: list[str], repeats: int = 3) -> float:
    sim.logits(prompts[: sim.batch_size])  # warm-up (and the prefix cache)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        sim.logits(prompts)
        rates.append(len(prompts) / (time.perf_counter() - start))
    return max(rates)


def best_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    lm = load_model("embedded", dtype="bfloat16")
    prompts = random_prompts(np.random.default_rng(0), 256)
    print("simulator throughput, chat template, bf16 compute (best of 3):")
    for batch in (1, 32, 128):
        n = 32 if batch == 1 else 256
        reuse = best_rate(Simulator(lm, batch_size=batch, prefix_reuse=True), prompts[:n])
        plain = best_rate(Simulator(lm, batch_size=batch, prefix_reuse=False), prompts[:n])
        print(f"  batch {batch:>3}: {reuse:6.1f} prompts/s with prefix reuse, {plain:6.1f} without  (x{reuse / plain:.2f})")

    z = Simulator(lm).logits(prompts[:1])[0]
    p = np.exp(log_softmax(z / 2.0))
    rng = np.random.default_rng(0)
    n = 10**6
    ours = best_ms(lambda: multinomial_counts(rng, n, p))
    numpy_multinomial = best_ms(lambda: rng.multinomial(n, p / p.sum()))
    choice = best_ms(lambda: np.bincount(rng.choice(len(p), n, p=p / p.sum()), minlength=len(p)), repeats=3)
    print(f"N = 10^6 samples over |V| = {len(p)} for one prompt:")
    print(f"  nv.multinomial_counts {ours:7.2f} ms (target <= 5 ms)")
    print(f"  Generator.multinomial {numpy_multinomial:7.2f} ms  (x{numpy_multinomial / ours:.1f} slower)")
    print(f"  naive rng.choice      {choice:7.2f} ms  (x{choice / ours:.1f} slower)")


if __name__ == "__main__":
    main()
