"""What every benchmark shares: the process's peak resident set per step, the verdict line on wrong results, the
reference shapes of --shape, and a speed probe of the machine."""

import resource
import time

import numpy as np

from nv.models.reference_family import HEAD_DIM

GIB = 2.0**30


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM so the next reading is this step's peak
    except OSError:
        pass


def peak_rss() -> float:
    """Peak resident set in GiB since the last ``reset_peak_rss`` (Linux), else since the process started."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")) / GIB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def verdict(wrong: list[str]) -> int:
    """Print every wrong result and the summary line; the exit status (1 if any result is wrong)."""
    for w in wrong:
        print(f"WRONG RESULT: {w}")
    print("results: " + ("all correct" if not wrong else f"{len(wrong)} wrong"))
    return 1 if wrong else 0


def shape_references(shapes: list[list[int]], head_dim: int = HEAD_DIM) -> dict[str, dict]:
    """``--shape D L KV FFN`` arguments as random-weight reference entries (``timing_family``'s form), by name."""
    h = "" if head_dim == HEAD_DIM else f"-h{head_dim}"
    return {f"s-{d}x{L}-kv{kv}-f{ffn}{h}": {"d": d, "L": L, "n_kv_heads": kv, "d_ffn": ffn, "head_dim": head_dim}
            for d, L, kv, ffn in shapes}


def speed_probe(reps: int = 15) -> float:
    """Median seconds of one fixed bf16 matmul (1024 x 1024 by 1024 x 4096, a prefill's MLP-sized product) on the
    current torch threads: the machine's speed at that moment, to tell a timing run's drift from a model's own time."""
    import torch

    x, w = torch.ones(1024, 1024, dtype=torch.bfloat16), torch.ones(1024, 4096, dtype=torch.bfloat16)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - start)
    return float(np.median(times))
