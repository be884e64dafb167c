"""The attention probe: depth L from attention time alone, isolated with a server's prompt cache (our extension).

§4.2's estimators read L from a prefill sweep, T ~ beta L ell^2 d + alpha (Eq. 2). On a CPU, and for short sweeps
anywhere, most of that time is the projections and the MLP, linear in ell and proportional to the non-embedding
parameters P_ne, so a target whose MLP is wider than the references' reads as deeper (issue 13: the basic estimator
gives Qwen2.5-Coder-0.5B, MLP 5.4 d wide, +28 %). A serving engine's prompt cache removes that term: once a context
of ell_c tokens is cached, a call that extends it by s fresh tokens computes only those s tokens, which cost
c P_ne s (constant in ell_c) plus their attention over ell_c + s keys, 4 s (ell_c + s) d FLOPs per layer. So

    T(ell_c) = t_0 + g ell_c,    g = b s L d,

with t_0 the s tokens' projections, MLP and the call overhead, and the slope g carrying L d alone, whatever the MLP
width or KV ratio. References of known L, d timed the same way calibrate b on the platform (a line through the
origin of their rates g_i / s_i on L_i d_i); a target's L_hat = g / (s b d_hat). s is measured per model (the
backend's token counts): the same random words make more or fewer tokens under another tokenizer.

Protocol (``measure_cached``): per context length, one untimed call fills the cache with a context (a fresh random
prefix and App. D's passage), then K timed calls append K different suffixes (fresh random words, then the passage). The
server's cache keeps the context between them (each suffix differs from the last at its first token). Contexts run
in a seeded random order through ``collect_timings``' checkpointed loop. Statistic: per context the fastest trial
(interference only ever adds time: on a shared machine most trials can carry a stall of a second while the fastest
stays within a few ms of the undisturbed time), against the cached context length (the primed call's prompt
tokens), fitted by Theil-Sen (a context whose every trial stalled is an outlier the median of pairwise slopes
ignores). Needs a backend with a prompt cache: llama.cpp's server (it reuses the previous prompt's longest common
prefix by default), vLLM with automatic prefix caching, the simulator with ``prompt_cache=True``; without one every
timed call recomputes its context, g is the whole prefill's cost per token (~c P_ne), and the references' rates stop
following L d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nv.errors import NVError
from nv.models.reference_family import HEAD_DIM
from nv.oracle.base import Oracle
from nv.phase2.protocol import LengthTimings, TokenScale, timing_prompt


def measure_cached(oracle: Oracle, target: int, trials: int, seed: int, scale: TokenScale, suffix_tokens: int = 64) -> LengthTimings:
    """One context of ~``target`` tokens: cache it with one untimed call, then time ``trials`` calls that extend it by
    fresh random words and ~``suffix_tokens`` tokens of the passage (sized by the warm-ups' characters -> tokens, so s
    is alike under every tokenizer: the cost per new token was measured not to be the same at every s, README). The row's ``ell`` is the primed (cached) prompt's token count, once per trial; ``new`` the
    timed calls' extra prompt tokens."""
    rng = np.random.default_rng([seed, target, 1])
    context = timing_prompt(scale.chars_for(target), rng)
    primed = oracle.time_request(context)
    chars = round(suffix_tokens / scale.per_char)
    calls = [oracle.time_request(context + " " + timing_prompt(chars, rng)) for _ in range(trials)]
    return LengthTimings(target, [primed.prompt_tokens] * trials, [c.seconds for c in calls],
                         [c.prompt_tokens - primed.prompt_tokens for c in calls])


@dataclass(frozen=True)
class ProbeFit:
    """T(ell_c) = t0 + g ell_c on one model (seconds, tokens), with the new tokens s per timed call."""

    g: float
    g_se: float
    t0: float
    s: float

    @property
    def rate(self) -> float:
        """g / s: seconds per new token per cached context token, the quantity b L d predicts."""
        return self.g / self.s


def fit_probe(rows: list[LengthTimings]) -> ProbeFit:
    """The probe's line over one model's contexts: Theil-Sen of each context's fastest trial on its cached length;
    g_se from the slope's 90 % interval (half its width / 1.645)."""
    from scipy.stats import theilslopes

    if len(rows) < 3:
        raise NVError(f"the attention probe needs at least 3 context lengths, got {len(rows)}")
    if any(r.new is None for r in rows):
        raise NVError("these timing rows come from App. D's protocol, not the attention probe (no new-token counts)")
    fastest = np.array([min(r.seconds) for r in rows])
    ell_c = np.array([np.mean(r.ell) for r in rows], dtype=np.float64)
    g, t0, lo, hi = theilslopes(fastest, ell_c, alpha=0.90)
    return ProbeFit(float(g), float((hi - lo) / (2 * 1.645)), float(t0), float(np.mean([np.mean(r.new) for r in rows])))


def calibrate_probe(rate: np.ndarray, L: np.ndarray, d: np.ndarray) -> float:
    """b: least squares through the origin of the references' rates g_i / s_i on L_i d_i."""
    rate, x = np.asarray(rate, dtype=np.float64), np.asarray(L, dtype=np.float64) * np.asarray(d, dtype=np.float64)
    if len(rate) < 2 or not np.all(np.isfinite(rate)):
        raise NVError("the probe's calibration needs at least two references with a finite slope")
    b = float(np.sum(rate * x) / np.sum(x * x))
    if not b > 0:
        raise NVError(f"probe calibration b = {b:.3g}: the cached calls do not slow down with the context (no prompt cache?)")
    return b


def depth_probe(rate: float, b: float, d_hat: float) -> float:
    """L_hat = (g / s) / (b d_hat)."""
    if not b > 0 or not d_hat > 0:
        raise NVError(f"b and d_hat must be positive, got {b}, {d_hat}")
    return rate / (b * d_hat)


def matched_references(d_hat: int, depths: tuple[int, ...], kv_ratio: float, ffn_ratio: float) -> dict[str, dict]:
    """References at the target's own width: one random-weight shape {d, L, n_kv_heads, d_ffn} per depth in
    ``depths``, d = d_hat, heads of HEAD_DIM (the family's), n_kv the divisor of the head count nearest kv_ratio x heads and
    d_ffn = ffn_ratio x d_hat (the attacker's default ratios: the target's own are unknown). On this CPU b moves with d
    and n_kv, and by up to 30 % between runs of one shape (README: the attention probe); calibrating at d_hat removes
    the first of these only."""
    if d_hat <= 0 or d_hat % HEAD_DIM:
        raise NVError(f"d_hat must be a positive multiple of the head size {HEAD_DIM}, got {d_hat}")
    heads = d_hat // HEAD_DIM
    n_kv = min((k for k in range(1, heads + 1) if heads % k == 0), key=lambda k: (abs(k - kv_ratio * heads), k))
    return {f"m-{d_hat}x{L}": {"d": d_hat, "L": int(L), "n_kv_heads": n_kv, "d_ffn": int(round(ffn_ratio * d_hat))}
            for L in depths}


def leave_one_out(rate: np.ndarray, L: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Each reference's L_hat from the calibration of the others (the probe's own error on its family)."""
    rate, L, d = (np.asarray(v, dtype=np.float64) for v in (rate, L, d))
    keep = np.ones(len(rate), dtype=bool)
    out = np.empty(len(rate))
    for i in range(len(rate)):
        keep[i] = False
        out[i] = depth_probe(rate[i], calibrate_probe(rate[keep], L[keep], d[keep]), d[i])
        keep[i] = True
    return out
