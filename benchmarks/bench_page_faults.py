"""Page-fault cost of this machine, and what the Makefile's ``MALLOC_TOP_PAD_`` saves.

glibc hands a freed large block back to the kernel (``munmap``, or a trim of the heap's top), so the next array of
that size faults its pages in again. Where a fault is slow (a VM whose host reclaims memory: 15-40 us measured here
on a degraded machine, ~0.1 us on bare metal) that dominates numpy and torch loops that allocate per step. The loop
below (30 x two 100 MB arrays) runs in a child process with and without the pad, beside the child's numpy import
alone; printed: wall and system seconds of the loop (the import's subtracted), the cost of one page fault, and the
target (the pad at least halves the loop's system time where a fault costs more than 1 us).
Run: python benchmarks/bench_page_faults.py
"""

import os
import resource
import subprocess
import sys
import time

IMPORT = "import numpy as np\n"
LOOP = IMPORT + "for _ in range(30):\n    a = np.ones(12_500_000)\n    b = a * 2\n    del a, b\n"
PAD = str(2**30)


def run(code: str, pad: str | None) -> tuple[float, float]:
    """(wall, system) seconds of ``code`` in a child process, MALLOC_TOP_PAD_ set to ``pad`` or unset."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TOP_PAD_"} | ({"MALLOC_TOP_PAD_": pad} if pad else {})
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime - before


def main() -> int:
    base = run(IMPORT, None)
    plain, padded = ((w - base[0], s - base[1]) for w, s in (run(LOOP, None), run(LOOP, PAD)))
    per_fault_us = max(plain[1], 0.0) / (30 * 2 * 12_500_000 * 8 / 4096) * 1e6  # each array's pages, once
    print(f"allocation loop, no pad:          {plain[0]:6.2f} s wall, {plain[1]:6.2f} s system")
    print(f"allocation loop, MALLOC_TOP_PAD_: {padded[0]:6.2f} s wall, {padded[1]:6.2f} s system")
    print(f"page fault ~{per_fault_us:.2f} us; system time ratio {plain[1] / max(padded[1], 1e-3):.1f}x")
    if per_fault_us > 1:
        print(f"target: the pad halves system time: {'MET' if padded[1] <= plain[1] / 2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
