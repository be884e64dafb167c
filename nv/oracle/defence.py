"""Defences an API provider can switch on, as an oracle wrapper the attack code never sees.

``DefendedOracle(oracle, Defence(...), seed)`` serves the §2 threat-model API of any backend with
what a provider would deploy against NightVision: coarser or noisier log-probs (against the
common-set matrix of §4.1), truncated sampling (the tail is never drawn, so the common set shrinks),
a temperature cap, and coarser or padded timing (against the prefill fit of §4.2, App. D). Every call
is still charged by the wrapped backend with the §5 metric. ``sampling_price`` and
``mean_added_latency_ms`` are what each defence costs the provider's honest users.

Log-prob side, in the order applied (``y`` is the log-prob the backend reports):

- ``max_temperature``: a request above the cap is served at the cap; ``y`` follows the served temperature.
- ``noise_sigma``: each call's log-prob gets fresh Gaussian noise, clipped at 0 (a log-prob: unclipped, noise would
  report probabilities above 1); then ``round_format`` (fp16, bf16 or fp8_e4m3, round to nearest even, single
  rounding from float64; fp8_e4m3 saturates at +-448 like torch's float8_e4m3fn) and ``round_decimals`` (k decimals)
  round each call's value.
- ``min_logprob``: a call whose reported value (after noise and rounding: the threshold sees what would be
  returned, so a withheld value tells only that the noisy value fell below it) lies below the threshold comes back
  without a log-prob. ``Samples`` holds one log-prob per distinct token, the mean of its calls' reported values,
  exactly what an attacker averaging its N calls holds (y + N(0, sigma^2 / count) without rounding or clipping; with
  rounding the per-call values are rounded before the mean, so noise dithers the rounding away); a token none of
  whose calls was reported tells the attacker nothing for Y_hat, so ``sample`` drops its entry (token, count,
  log-prob; the calls stay charged and ``Samples.n`` falls below ``n``); ``argmax``, whose one call must return its
  token, reports NaN. The noise of prompt q is seeded by (seed, seeds[q]): the same request returns the same reply,
  as a seeded API does.

Sampling side (``top_k``, ``top_p``, ``min_p``): the simulator applies them after the temperature, in
vLLM V1's order (its sampler: temperature, min-p, then top-k and top-p): min-p (p_i >= min_p * p_max),
top-k, then top-p on the renormalised survivors (the smallest most-likely prefix of mass >= top_p).
Only the simulator (white-box distributions, sampled here) and the HTTP client (the server's own
``top_k``/``top_p``/``min_p`` request fields) can honour them; a server applies its own order, and
llama.cpp's (its C++ server's default chain and llama-cpp-python's) truncates *before* the temperature,
so at tau > 1 the same knob keeps fewer tokens there than here. The log-prob reported for a draw stays
the backend's untruncated value (as llama.cpp reports).

Timing side: ``pad_to_tokens`` times the prompt padded to the next multiple of the bucket (a real
call, through the backend; the padding is the provider's and is not billed), then ``delay_uniform_ms``
(U(0, a)) and ``delay_exp_ms`` (exponential of mean b) are added to the reported latency and
``latency_quantum_ms`` rounds it up to a multiple of q.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from nv.errors import NVError
from nv.oracle.base import Oracle, Samples, TimedCall, check_sampling
from nv.oracle.http import HTTPOracle
from nv.oracle.simulator import Simulator, log_softmax
from nv.params import REQUEST_FIELDS as ATTACK_FIELDS
from nv.params import check_section

# float formats: explicit mantissa bits, smallest normal exponent, largest finite value and whether it saturates
FORMATS = {
    "fp16": (10, -14, 65504.0, False),
    "bf16": (7, -126, (2 - 2.0**-7) * 2.0**127, False),
    "fp8_e4m3": (3, -6, 448.0, True),
}
TIMING_KNOBS = ("latency_quantum_ms", "delay_uniform_ms", "delay_exp_ms", "pad_to_tokens")  # act on timed calls only
PAD_FILLER = " ."
_NOISE, _ARGMAX, _TIMING = 0, 1, 2  # seed streams


@dataclass(frozen=True)
class Defence:
    """The provider's knobs; None switches a knob off (the default: no defence)."""

    round_decimals: int | None = None
    round_format: str | None = None
    noise_sigma: float | None = None
    min_logprob: float | None = None
    max_temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    latency_quantum_ms: float | None = None
    delay_uniform_ms: float | None = None
    delay_exp_ms: float | None = None
    pad_to_tokens: int | None = None

    def __post_init__(self) -> None:
        check_section("defence", asdict(self))  # the one schema: params.yaml's defence section

    @property
    def active(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    @property
    def truncates(self) -> bool:
        return any(v is not None for v in (self.top_k, self.top_p, self.min_p))

    def as_dict(self) -> dict:
        return asdict(self)


# -- pure transformations --------------------------------------------------------------------------

def format_quantum(x: np.ndarray, fmt: str) -> np.ndarray:
    """The spacing of the float format ``fmt``'s grid at each value of ``x`` (subnormals included), as float64."""
    if fmt not in FORMATS:
        raise NVError(f"round_format must be one of {tuple(FORMATS)}, got {fmt!r}")
    mantissa, emin, _, _ = FORMATS[fmt]
    _, e = np.frexp(np.asarray(x, dtype=np.float64))  # |x| in [2^(e-1), 2^e)
    return np.ldexp(1.0, np.maximum(e - 1, emin) - mantissa)


def round_to_format(x: np.ndarray, fmt: str) -> np.ndarray:
    """``x`` rounded to the float format ``fmt`` (round to nearest even, subnormals included), as float64."""
    quantum = format_quantum(x, fmt)
    _, _, largest, saturates = FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    r = np.rint(x / quantum) * quantum
    if saturates:
        return np.clip(r, -largest, largest)
    return np.where(np.abs(r) > largest, np.copysign(np.inf, r), r)


def quantise(y: np.ndarray, defence: Defence) -> np.ndarray:
    """Each reported value rounded as the API serialises it: to ``round_format``, then ``round_decimals``."""
    if defence.round_format is not None:
        y = round_to_format(y, defence.round_format)
    if defence.round_decimals is not None:
        y = np.round(y, defence.round_decimals)
    return y


def report_calls(y: np.ndarray, defence: Defence, noise: np.ndarray | None = None) -> np.ndarray:
    """Each call's reported log-prob for calls of true log-prob ``y``: plus its ``noise`` (each call's N(0, sigma^2)
    draw; None without noise) clipped at 0, then ``quantise``; NaN (withheld) where that value lies below
    ``min_logprob``."""
    v = np.asarray(y, dtype=np.float64)
    if noise is not None:
        v = np.minimum(v + noise, 0.0)
    v = quantise(v, defence)
    if defence.min_logprob is not None:
        v = np.where(v < defence.min_logprob, np.nan, v)
    return v


def reported_logprobs(y: np.ndarray, counts: np.ndarray, defence: Defence,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct token of true log-prob ``y`` drawn ``counts`` times: the mean of its calls' reported values
    (``report_calls``; NaN where none was reported) and how many of its calls were reported. Without noise every call
    of a token reports the same value."""
    y, counts = np.asarray(y, dtype=np.float64), np.asarray(counts, dtype=np.int64)
    if not defence.noise_sigma or y.size == 0:
        v = report_calls(y, defence)
        return v, np.where(np.isnan(v), 0, counts)
    calls = int(counts.sum())
    per_call = report_calls(np.repeat(y, counts), defence, defence.noise_sigma * rng.standard_normal(calls))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    reported = np.add.reduceat(~np.isnan(per_call), starts)
    total = np.add.reduceat(np.nan_to_num(per_call), starts)
    with np.errstate(invalid="ignore"):
        return np.where(reported > 0, total / reported, np.nan), reported


def truncation_mask(p: np.ndarray, top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None, unlisted: float = 0.0) -> np.ndarray:
    """Tokens that survive min-p, top-k, then top-p on the renormalised survivors (vLLM V1's order).

    ``unlisted``: the probability mass of tokens outside ``p``, each less likely than any in it (``p`` a server's top
    list, see ``listed_survivors``). It joins top-p's renormaliser only where neither min-p nor top-k is on; with
    either, how much of it survives them is unknown and it is left out: exact where ``p`` holds all their survivors,
    else fewer listed tokens kept, never more."""
    p = np.asarray(p, dtype=np.float64)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    keep = np.ones(p.size, dtype=bool)
    if min_p is not None:
        keep &= ps >= min_p * ps[0]
    if top_k is not None:
        keep[top_k:] = False
    if top_p is not None:
        rest = unlisted if min_p is None and top_k is None else 0.0
        kept = np.where(keep, ps, 0.0) / (ps[keep].sum() + rest)
        keep &= np.cumsum(kept) - kept < top_p  # mass before the token: the crossing token is kept
    mask = np.empty_like(keep)
    mask[order] = keep
    return mask


def listed_survivors(y: Sequence[float], defence: Defence) -> np.ndarray:
    """Which entries of a reply's top list (log-probs ``y`` of the server's most likely tokens, any order; -inf for a
    missing value) the truncation could have drawn: ``truncation_mask`` over their probabilities, the list's missing
    mass 1 - sum(p) ``unlisted``. Read off the reported values: exact where the server truncates the distribution it
    reports (llama.cpp: the T = 1 one, truncated before the temperature); a server that truncates after the
    temperature (vLLM) draws from more tokens at tau > 1 and fewer at tau < 1, so the list keeps fewer or more."""
    p = np.exp(np.asarray(y, dtype=np.float64))
    if p.size == 0:
        return np.zeros(0, dtype=bool)
    unlisted = max(0.0, 1.0 - float(p.sum()))
    return truncation_mask(p, defence.top_k, defence.top_p, defence.min_p, unlisted=unlisted) & (p > 0)


# request fields passed on to a defended endpoint: OpenAI's, and vLLM's and llama.cpp's that leave the temperature, the
# truncation, the log-probs' form and the timing to the defence (the attack's own, nv.params.REQUEST_FIELDS, among
# them); others (llama.cpp's samplers and mirostat_* replace the truncation chain, dynatemp_* the temperature,
# n_probs / post_sampling_probs return probabilities) could undo it
REQUEST_FIELDS = ATTACK_FIELDS | {
    "suffix", "top_k", "top_p", "min_p", "stop", "stop_token_ids", "user", "prompt_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "repeat_penalty", "repeat_last_n", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "chat_template", "chat_template_kwargs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "length_penalty", "metadata", "store", "service_tier", "reasoning_effort", "modalities"}

# request fields with which a client could draw or read the tokens a truncation hides (a logit bias, a penalty, a
# grammar or schema, or a ban of EOS moves a tail token into the kept set or forces it; echo, prompt log-probs and
# beam search report tokens the sampler did not draw), and their neutral values (the attack's own repeat_penalty 1)
UNTRUNCATING = {"logit_bias": ({}, None), "presence_penalty": (0, None), "frequency_penalty": (0, None),
                "repetition_penalty": (1, None), "repeat_penalty": (1, None), "response_format": (None, {"type": "text"}),
                "tools": (None, []), "ignore_eos": (False, None), "min_tokens": (0, None),
                "echo": (False, None), "prompt_logprobs": (None,), "use_beam_search": (False, None)}


def check_untruncating(body: dict, defence: Defence) -> None:
    """With top_k, top_p or min_p on, refuse a request whose ``UNTRUNCATING`` fields are not neutral."""
    if defence.truncates:
        undoing = [k for k, neutral in UNTRUNCATING.items() if k in body and body[k] not in neutral]
        if undoing:
            raise NVError(f"request field(s) {', '.join(map(repr, undoing))} not passed on while top_k/top_p/min_p is on: "
                          "they let a client draw or read the tokens the truncation hides")


def served_log_probs(y: np.ndarray, temperature: float, defence: Defence) -> np.ndarray:
    """log q: the next-token distribution the provider samples from for a request at ``temperature``,
    given a T = 1 log-prob (or logit) vector ``y``: temperature cap, then truncation, renormalised."""
    served = min(temperature, defence.max_temperature or math.inf)
    log_q = log_softmax(np.asarray(y, dtype=np.float64) / served)
    if not defence.truncates:
        return log_q
    mask = truncation_mask(np.exp(log_q), defence.top_k, defence.top_p, defence.min_p)
    return np.where(mask, log_q - np.log(np.exp(log_q[mask]).sum()), -np.inf)


def sampling_price(y: np.ndarray, temperature: float, defence: Defence) -> dict[str, float]:
    """The provider's price of the sampling-side defences on one prompt: KL(q || p) and TV(q, p) of the
    served distribution q from the undefended p = softmax(y / temperature), ``y`` a T = 1 log-prob vector.
    Truncation alone keeps mass M: KL = -log M, TV = 1 - M."""
    log_p = log_softmax(np.asarray(y, dtype=np.float64) / temperature)
    log_q = served_log_probs(y, temperature, defence)
    q = np.exp(log_q)
    on = q > 0
    return {"kl": float(np.sum(q[on] * (log_q[on] - log_p[on]))), "tv": float(0.5 * np.abs(q - np.exp(log_p)).sum())}


def mean_added_latency_ms(defence: Defence, prompt_tokens: Sequence[int], latency: Callable[[np.ndarray], np.ndarray],
                          seed: int = 0, draws: int = 4096) -> float:
    """Mean latency (ms) the timing defences add to honest calls of ``prompt_tokens`` each, ``latency`` (prompt tokens
    -> seconds) the undefended one: the prompt padded to the next multiple of the bucket (timed at the padded length),
    then the delays U(0, a) and Exp(b), then the reply held until a multiple of the quantum q, as ``DefendedOracle``
    times a call; the delays' expectation over ``draws`` seeded draws per call. (Latencies and lengths taken as
    uniform modulo q and the bucket, the added mean would be q / 2 and (bucket - 1) / 2 tokens; short calls are far
    from that: a 73 ms call pays 427 ms of a 500 ms quantum.)"""
    ell = np.asarray(prompt_tokens, dtype=np.int64)[:, None]
    T = np.asarray(latency(ell), dtype=np.float64)
    served = T.copy()
    if defence.pad_to_tokens is not None:
        served = np.asarray(latency(ell + (-ell % defence.pad_to_tokens)), dtype=np.float64)
    rng = np.random.default_rng([seed, _TIMING])
    if defence.delay_uniform_ms is not None:
        served = served + rng.uniform(0.0, defence.delay_uniform_ms / 1000.0, (len(T), draws))
    if defence.delay_exp_ms is not None:
        served = served + rng.exponential(defence.delay_exp_ms / 1000.0, (len(T), draws))
    if defence.latency_quantum_ms is not None:
        served = np.vectorize(quantise_latency)(served, defence.latency_quantum_ms)
    return float(1000.0 * np.mean(served - T))


def quantise_latency(seconds: float, quantum_ms: float) -> float:
    """``seconds`` rounded up to a multiple of ``quantum_ms`` milliseconds (never below ``seconds``)."""
    k = math.ceil(seconds * 1000.0 / quantum_ms)
    while k * quantum_ms / 1000.0 < seconds:  # float rounding of the division
        k += 1
    return k * quantum_ms / 1000.0


def pad_prompt(prompt: str, target: int, count: Callable[[str], int], filler: str = PAD_FILLER) -> str:
    """``prompt`` extended with ``filler`` until ``count`` (its tokens) is exactly ``target``."""
    k = target - count(prompt)
    for _ in range(16):
        padded = prompt + filler * k
        missing = target - count(padded)
        if missing == 0:
            return padded
        k = max(k + missing, 0)
    raise NVError(f"cannot pad the prompt to exactly {target} tokens with {filler!r}")


def http_truncation_fields(defence: Defence) -> dict:
    """The request fields (llama.cpp, vLLM) that make the server truncate its own sampling."""
    return {k: v for k, v in (("top_k", defence.top_k), ("top_p", defence.top_p), ("min_p", defence.min_p)) if v is not None}


_DEFENCE_KEY = 2**32 - 1  # leads every defence stream's spawn key: no spawn counter of a row stream reaches it


def _seed_sequence(seed: int, stream: int, request_seed=()) -> np.random.SeedSequence:
    """The defence's own stream: (``_DEFENCE_KEY``, stream, request seed) as a spawn key, so it equals neither a plain
    entropy list such as the simulator's row stream default_rng((seed, q)) (SeedSequence([seed, 1]) was prompt 1's
    draws) nor a child that row stream spawns (``multinomial_counts``: spawn keys (0,) and (1,))."""
    request = np.atleast_1d(np.asarray(request_seed, dtype=np.int64)).tolist()
    return np.random.SeedSequence(seed, spawn_key=(_DEFENCE_KEY, stream, *request))


# -- the wrapper -------------------------------------------------------------------------------------

class DefendedOracle(Oracle):
    """``oracle`` behind ``defence``: the same interface, the same §5 cost counter (``cost`` is the
    wrapped backend's), every random step seeded from ``seed``.

    Truncation is drawn by the simulator from its white-box distributions truncated here (``Simulator.sample``'s
    ``law``), or sent to an HTTP endpoint as its own request fields (set on the wrapped client, so every request
    carries them); any other backend, or padding without the simulator's tokenizer, is refused.
    """

    def __init__(self, oracle: Oracle, defence: Defence, seed: int) -> None:
        # no Oracle.__init__: the cost counter is the wrapped backend's
        if defence.truncates and not isinstance(oracle, (Simulator, HTTPOracle)):
            raise NVError(f"top_k/top_p/min_p need the true distribution: {type(oracle).__name__} cannot honour them "
                          "(only the simulator and an HTTP endpoint can)")
        if defence.pad_to_tokens is not None and not isinstance(oracle, Simulator):
            raise NVError(f"pad_to_tokens needs the target's tokenizer: {type(oracle).__name__} cannot honour it "
                          "(only the simulator can)")
        unknown = sorted(set(oracle.extra_body) - REQUEST_FIELDS) if isinstance(oracle, HTTPOracle) else []
        if unknown:
            raise NVError(f"live.extra_body field(s) {', '.join(map(repr, unknown))} "
                          "with a defence: they could undo it (a sampler chain, a temperature or a probability format "
                          "the defence does not control), as `nv defend` refuses them")
        if defence.truncates and isinstance(oracle, HTTPOracle):
            check_untruncating(oracle.extra_body, defence)  # live.extra_body
            if oracle.top_logprobs:
                raise NVError("top_k/top_p/min_p with live.top_logprobs > 0: an endpoint's top list is not truncated by "
                              "its sampler; put `nv defend` in front of it, which filters the list, or set top_logprobs 0")
            oracle.extra_body = {**oracle.extra_body, **http_truncation_fields(defence)}
        self.inner = oracle
        self.defence = defence
        self.seed = seed
        self._argmax_rng = np.random.default_rng(_seed_sequence(seed, _ARGMAX))
        self._timing_rng = np.random.default_rng(_seed_sequence(seed, _TIMING))

    @property
    def cost(self):
        return self.inner.cost

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def served_temperature(self, temperature: float) -> float:
        return min(temperature, self.defence.max_temperature or math.inf)

    def sample(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence) -> list[Samples]:
        check_sampling(n, temperature, prompts, seeds)
        served = self.served_temperature(temperature)
        if self.defence.truncates and isinstance(self.inner, Simulator):  # drawn from the truncated distribution
            raw = self.inner.sample(prompts, n, served, seeds, law=lambda z: served_log_probs(z, served, self.defence))
        else:
            raw = self.inner.sample(prompts, n, served, seeds)
        return [self._report(s, np.random.default_rng(_seed_sequence(self.seed, _NOISE, seed)))
                for s, seed in zip(raw, seeds)]

    def argmax(self, prompts: Sequence[str]) -> list[Samples]:
        return [self._report(s, self._argmax_rng, withheld="nan") for s in self.inner.argmax(prompts)]

    def repeats(self):
        return self.inner.repeats()

    def refuses(self, prompts, n: int, temperature: float, seeds, prompt_tokens=None) -> str | None:
        return self.inner.refuses(prompts, n, self.served_temperature(temperature), seeds, prompt_tokens)

    def time_request(self, prompt: str) -> TimedCall:
        d = self.defence
        if d.pad_to_tokens is None:
            call = self.inner.time_request(prompt)
        else:
            own = self.inner.format.prompt_tokens(prompt)
            target = -(-own // d.pad_to_tokens) * d.pad_to_tokens
            padded = self.inner.time_request(pad_prompt(prompt, target, self.inner.format.prompt_tokens))
            self.cost.prompt_tokens -= padded.prompt_tokens - own  # the padding is the provider's, not billed
            call = TimedCall(padded.seconds, own)
        seconds = call.seconds
        if d.delay_uniform_ms is not None:
            seconds += self._timing_rng.uniform(0.0, d.delay_uniform_ms) / 1000.0
        if d.delay_exp_ms is not None:
            seconds += self._timing_rng.exponential(d.delay_exp_ms) / 1000.0
        if d.latency_quantum_ms is not None:
            seconds = quantise_latency(seconds, d.latency_quantum_ms)
        return TimedCall(seconds, call.prompt_tokens)

    # -- internals ---------------------------------------------------------------------------------

    def _report(self, s: Samples, rng: np.random.Generator, withheld: str = "drop") -> Samples:
        """The log-prob side of one prompt's reply (``reported_logprobs``): a token none of whose calls was reported
        dropped, or with ``withheld="nan"`` kept with a NaN log-prob."""
        y, reported = reported_logprobs(s.logprobs, s.counts, self.defence, rng)
        if withheld == "nan" or reported.all():
            return Samples(s.token_ids, y, s.counts, s.prompt_tokens)
        keep = reported > 0
        return Samples(s.token_ids[keep], y[keep], s.counts[keep], s.prompt_tokens)
