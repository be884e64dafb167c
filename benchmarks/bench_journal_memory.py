"""Memory and disk per paid reply of the live attack's journal (``nv.oracle.journal``), the figures the dry run
prints (``nv.live.JOURNAL_BYTES``): the journal holds an index entry of every paid reply while the attack runs (the
reply itself is read back from its line when asked for), so its bytes per reply set how many requests an auditor's
machine can afford.

Replies shaped like a sampling call's: one sampled token (a token key of a typical token's length and its
log-prob, no alternatives), prompt and output tokens; keyed by ``request_key`` of a request body. Measured:
disk bytes per reply; resident bytes per reply held after writing them (the attack's steady state), the peak while
writing them and the peak while a resume reads them back, each above the resident set before; the time per reply of that read and of a
replay (``get`` of every key). Each byte figure is printed beside the dry run's,
MET when within it (machines are noisy); a wrong result (a reply read back other than it was written, a reply
missing) exits with status 1. Run: python benchmarks/bench_journal_memory.py [--replies 1048576]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import GIB, peak_rss, reset_peak_rss, verdict
from nv.live import JOURNAL_BYTES
from nv.oracle.journal import Journal, request_key


def rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS")) / GIB


def key_of(i: int) -> str:
    return request_key({"model": "m", "prompt": f"prompt {i % 3000}", "seed": i, "max_tokens": 1, "logprobs": 1})


def reply(i: int, rng: np.random.Generator) -> tuple[str, dict]:
    token = "s:" + "".join(rng.choice(list("abcdefghij"), size=5))
    return key_of(i), {"c": [[token, float(np.float32(-rng.exponential(3.0))), []]], "p": 40, "o": 1}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replies", type=int, default=1 << 20)  # 2^20: the last reply merges the whole index (its peak)
    n = ap.parse_args().replies
    rng = np.random.default_rng(0)
    wrong = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.jsonl"
        sample = {}
        gc.collect()
        before = rss()
        reset_peak_rss()
        j = Journal(path, {"b": 1})
        for i in range(n):
            key, record = reply(i, rng)
            j.put(key, record)
            if i % 9973 == 0:
                sample[key] = record
        j.sync()
        running = (peak_rss() - before) * GIB / n
        gc.collect()
        held = (rss() - before) * GIB / n
        j.close()
        disk = path.stat().st_size / n
        del j
        gc.collect()
        before = rss()
        reset_peak_rss()
        start = time.perf_counter()
        again = Journal(path, {"b": 1})
        read_s = time.perf_counter() - start
        loading = (peak_rss() - before) * GIB / n
        if again.requests != n:
            wrong.append(f"{again.requests} replies read back of {n}")
        wrong += [f"reply {k[:12]} read back as {again.get(k)}" for k, r in sample.items() if again.get(k) != r]
        keys = [key_of(i) for i in range(n)]
        start = time.perf_counter()
        missing = sum(again.get(k) is None for k in keys)
        replay_us = (time.perf_counter() - start) / n * 1e6
        if missing:
            wrong.append(f"{missing} of {n} replies not found")
        again.close()
    peak = max(running, loading)
    print(f"journal of {n:,} replies: {disk:.0f} bytes per reply on disk (dry run: {JOURNAL_BYTES['disk']}), "
          f"{held:.0f} held while the attack runs, {running:.0f} at its peak, {loading:.0f} at the peak of a resume's "
          f"read (dry run: {JOURNAL_BYTES['memory']}): {'MET' if peak <= JOURNAL_BYTES['memory'] * 1.1 else 'MISSED'}")
    print(f"a resume reads the journal in {read_s:.1f} s ({read_s / n * 1e6:.1f} us per reply) and replays a reply in "
          f"{replay_us:.1f} us")
    return verdict(wrong)


if __name__ == "__main__":
    sys.exit(main())
