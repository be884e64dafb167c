"""White-box simulator of a restrictive API over a local transformers model.

One forward pass per prompt gives the exact next-token distribution; N API calls are then
one exact multinomial draw over the vocabulary, so N = 10^6 costs no more than N = 10, while
the cost counter is charged for N calls (§5).

Switches (App. B hyperparameters): ``logprobs`` is ``processed`` (log_softmax(z / tau), the
paper's assumption) or ``raw`` (log_softmax(z): vLLM's default, llama.cpp); ``logits`` is
``bfloat16`` (rounded before the softmax, as deployed models serve) or ``float32``; ``argmax_dtype`` is
the compute precision of the temperature-0 calls that score the prompt search (float32: the ranking of
near-tied prompts does not follow the last bits of a host's bf16 kernels; the weights are the same).

Batches are right-padded and share the chat-template prefix: its KV cache is computed once
and reused, so each prompt only runs its own ~6 suffix tokens.

Inside ``repeats()`` (the adaptive loop's rounds) each batch's logits (``sample``, ``logits``) are kept (2 bytes per vocabulary entry
per prompt in bf16), so a round after the first runs no forward pass: the same batches, the same logits.

``prompt_cache`` (timed calls only): a serving engine's prompt cache, as llama.cpp's server keeps per slot (and vLLM's
automatic prefix caching, which keeps more): a timed call reuses the KV of the longest token prefix it shares with
the previous timed call and computes only the rest (the attention probe of phase 2 needs it; App. D's protocol defeats it
with a fresh random prefix per trial).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from nv.errors import NVError
from nv.models.loading import LoadedModel, load_model
from nv.oracle.multinomial import multinomial_counts
from nv.oracle.base import LOGPROB_MODES, Oracle, Samples, TimedCall, check_sampling
from nv.oracle.prompts import PromptFormat

LOGIT_PRECISIONS = ("bfloat16", "float32")


def log_softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable log-softmax in float64."""
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


class Simulator(Oracle):
    """Oracle backend over a local model (exact distributions, charged like a real API)."""

    def __init__(
        self,
        lm: LoadedModel,
        template: bool = True,
        logprobs: str = "processed",
        logits: str = "bfloat16",
        batch_size: int = 32,
        prefix_reuse: bool = True,
        argmax_dtype: str | None = None,
        prompt_cache: bool = False,
    ) -> None:
        super().__init__()
        if logprobs not in LOGPROB_MODES:
            raise NVError(f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")
        if logits not in LOGIT_PRECISIONS:
            raise NVError(f"logits must be one of {LOGIT_PRECISIONS}, got {logits!r}")
        if batch_size < 1:
            raise NVError(f"batch_size must be >= 1, got {batch_size}")
        if argmax_dtype not in (None, *LOGIT_PRECISIONS):
            raise NVError(f"argmax_dtype must be one of {LOGIT_PRECISIONS}, got {argmax_dtype!r}")
        self.lm = lm
        self.format = PromptFormat(lm.tokenizer, template)
        self.logprob_mode = logprobs
        self.logit_precision = logits
        self.batch_size = batch_size
        self.prefix_reuse = prefix_reuse
        self.argmax_dtype = argmax_dtype
        self._prefix_kv: dict[object, list] = {}  # per compute dtype
        self.prompt_cache = prompt_cache
        self._cached: tuple[list[int], object] = ([], None)  # the last timed call's ids and KV cache
        self._kept: dict[tuple[str, ...], tuple] | None = None  # inside repeats(): each batch's logits

    @classmethod
    def from_params(cls, model: dict, lm: LoadedModel | None = None) -> Simulator:
        """A simulator configured by params.yaml's ``model`` section (loads the model if needed)."""
        lm = lm or load_model(model["spec"], dtype=model["dtype"], device=model.get("device", "auto"))
        return cls(lm, model["template"], model["logprobs"], model["logits"], model["batch_size"],
                   argmax_dtype=model.get("argmax_dtype"))

    @property
    def vocab_size(self) -> int:
        return self.lm.model.get_output_embeddings().weight.shape[0]

    # -- white-box view -------------------------------------------------------------------

    def logits(self, prompts: Sequence[str]) -> np.ndarray:
        """Next-token logits z (len(prompts) x |V|, float64), rounded per ``logits`` switch."""
        return np.concatenate([self._forward(b, keep=True)[0] for b in self._batches(prompts)])

    def log_probs(self, prompts: Sequence[str], temperature: float = 1.0) -> np.ndarray:
        """Full log-probability rows y(tau) = log_softmax(z / tau) (white-box only)."""
        return log_softmax(self.logits(prompts) / temperature)

    # -- API view ---------------------------------------------------------------------------

    def sample(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence,
               law: Callable[[np.ndarray], np.ndarray] | None = None) -> list[Samples]:
        """``law`` maps the logits z to the log-probs the draws follow (default y(tau) = log_softmax(z / tau); a
        defence's truncated distribution: ``DefendedOracle``); the log-prob reported is y(tau) or the raw one."""
        check_sampling(n, temperature, prompts, seeds)
        out = []
        for batch, batch_seeds in zip(self._batches(prompts), self._batches(seeds)):
            for z, ell, seed in zip(*self._forward(batch, keep=True), batch_seeds):
                y_tau = log_softmax(z / temperature)
                counts = multinomial_counts(np.random.default_rng(seed), n, np.exp(y_tau if law is None else law(z)))
                idx = np.flatnonzero(counts)
                y = y_tau if self.logprob_mode == "processed" else log_softmax(z)
                out.append(Samples(idx, y[idx], counts[idx], ell))
                self.cost.charge(ell, calls=n)
        return out

    def argmax(self, prompts: Sequence[str]) -> list[Samples]:
        """Temperature-0 calls (forward pass in ``argmax_dtype``); the log-prob reported is the T = 1 value log_softmax(z)."""
        out = []
        with self._compute_dtype(self.argmax_dtype):
            for batch in self._batches(prompts):
                for z, ell in zip(*self._forward(batch)):
                    top = int(np.argmax(z))
                    out.append(Samples(np.array([top]), log_softmax(z)[[top]], np.array([1]), ell))
                    self.cost.charge(ell, calls=1)
        return out

    def time_request(self, prompt: str) -> TimedCall:
        """Wall time of one forward pass of ``prompt`` (prefill + the one output token); on a GPU the clock
        stops after the device has finished (CUDA kernels run asynchronously). With ``prompt_cache`` the
        pass starts after the longest prefix shared with the previous timed call (at least one token runs),
        the cache lookup inside the timed span, as a server's is."""
        import torch

        ids = self.format.ids(prompt)
        device = self.lm.model.device
        with torch.inference_mode():
            start = time.perf_counter()
            if self.prompt_cache:
                kept, cache = self._reuse(ids)
                self.lm.model(input_ids=torch.tensor([ids[kept:]], device=device), past_key_values=cache,
                              use_cache=True, logits_to_keep=1)
                self._cached = (ids, cache)
            else:
                self.lm.model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        self.cost.charge(len(ids), calls=1)
        return TimedCall(elapsed, len(ids))

    @contextmanager
    def repeats(self) -> Iterator[None]:
        """Keep each batch's logits (``sample``, ``logits``; not ``argmax``'s, computed in ``argmax_dtype``) until the span
        ends (``Oracle.repeats``)."""
        self._kept = {}
        try:
            yield
        finally:
            self._kept = None

    # -- internals --------------------------------------------------------------------------

    def _batches(self, items: Sequence) -> Iterator[Sequence]:
        for i in range(0, len(items), self.batch_size):
            yield items[i : i + self.batch_size]

    @contextmanager
    def _compute_dtype(self, dtype: str | None):
        """Run the model's parameters in ``dtype`` inside the block (None: as loaded). Only the parameters
        are cast, there and back (bf16 -> float32 -> bf16 is exact); buffers such as RoPE's float32
        inverse frequencies are left alone, so the model afterwards is bit-identical to before."""
        import torch

        loaded = self.lm.model.dtype
        wanted = loaded if dtype is None else getattr(torch, dtype)
        if wanted == loaded:
            yield
            return
        params = [p for p in self.lm.model.parameters() if p.dtype == loaded]
        for p in params:
            p.data = p.data.to(wanted)
        try:
            yield
        finally:
            for p in params:
                p.data = p.data.to(loaded)

    def _reuse(self, ids: list[int]) -> tuple[int, object]:
        """The prompt cache cut to the longest prefix ``ids`` shares with the previous timed call (one token
        short of all of ``ids``, which must run), and that prefix's length; a fresh cache when nothing is shared."""
        from transformers import DynamicCache

        last, cache = self._cached
        shared = 0
        for a, b in zip(last, ids[:-1]):
            if a != b:
                break
            shared += 1
        if not shared or cache is None:
            return 0, DynamicCache(config=self.lm.model.config)
        extra = cache.get_seq_length() - shared
        if extra > 0:
            cache.crop(-extra)
        return shared, cache

    def _prefix_cache(self) -> list:
        """Per-layer (keys, values) of the shared template prefix, computed once per compute dtype."""
        import torch

        dtype = self.lm.model.dtype
        if dtype not in self._prefix_kv:
            with torch.inference_mode():
                ids = torch.tensor([self.format.shared_prefix], device=self.lm.model.device)
                cache = self.lm.model.base_model(input_ids=ids, use_cache=True).past_key_values
            self._prefix_kv[dtype] = [(layer.keys, layer.values) for layer in cache.layers]
        return self._prefix_kv[dtype]

    def _prefix_len(self, ids: list[list[int]]) -> int:
        """Length of the template prefix if reused and every prompt extends it, else 0."""
        prefix = self.format.shared_prefix if self.prefix_reuse and self.format.template else ()
        if prefix and all(len(s) > len(prefix) and tuple(s[: len(prefix)]) == prefix for s in ids):
            return len(prefix)
        return 0

    def _forward(self, prompts: Sequence[str], keep: bool = False) -> tuple[np.ndarray, list[int]]:
        """Next-token logits z of one batch (float64, rounded per ``logits``) and each prompt's token count
        (the §5 charge); with ``keep`` inside ``repeats`` a batch seen before is answered from its kept logits."""
        key = tuple(prompts)
        if keep and self._kept is not None and key in self._kept:
            z, ells = self._kept[key]
        else:
            z, ells = self._logit_tensor(prompts)
            if keep and self._kept is not None:
                self._kept[key] = (z, ells)
        return z.float().numpy().astype(np.float64), ells

    def _logit_tensor(self, prompts: Sequence[str]) -> tuple:
        """``_forward``'s logits as a CPU tensor (bf16 when rounded, else the model's output dtype), from one
        tokenization per prompt."""
        import torch
        from transformers import DynamicCache

        ids = [self.format.ids(p) for p in prompts]
        P = self._prefix_len(ids)
        suffix = [s[P:] for s in ids]
        S = max(len(s) for s in suffix)
        pad = self.lm.tokenizer.pad_token_id
        device = self.lm.model.device
        input_ids = torch.tensor([s + [pad] * (S - len(s)) for s in suffix], device=device)
        mask = torch.tensor([[1] * (P + len(s)) + [0] * (S - len(s)) for s in suffix], device=device)
        kwargs = {}
        if P:
            cache = DynamicCache(config=self.lm.model.config)
            for layer, (k, v) in enumerate(self._prefix_cache()):
                cache.update(k.expand(len(ids), -1, -1, -1), v.expand(len(ids), -1, -1, -1), layer)
            kwargs["past_key_values"] = cache
        with torch.inference_mode():
            hidden = self.lm.model.base_model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=torch.arange(P, P + S, device=device).expand(len(ids), S),
                use_cache=bool(P),
                **kwargs,
            ).last_hidden_state
            last = hidden[torch.arange(len(ids), device=device), torch.tensor([len(s) - 1 for s in suffix], device=device)]
            z = self.lm.model.get_output_embeddings()(last)
        if self.logit_precision == "bfloat16":
            z = z.to(torch.bfloat16)
        return z.cpu(), [len(s) for s in ids]

    # -- logit-bias switch (simulator only) ------------------------------------------------

    def top1_logit_bias(
        self, prompts: Sequence[str], tokens: np.ndarray, bias: float = -1.0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Top-1 log-prob API with a logit bias, as Carlini et al.'s attack needs (§4.1 box, left).

        Per prompt q: the unbiased top token r_q, y_top = log p_r, and for every t in ``tokens`` the
        top log-prob y'_top of the call that adds ``bias`` to logit t alone (NaN where t = r_q: that
        call is never made). Closed form from one forward pass, in float64 on the rounded logits z
        (``logits`` switch): log Z'_t = log(Z - e^{z_t}(1 - e^bias)) = log Z + log1p(p_t (e^bias - 1)),
        y'_top = max(z_r, z_t + bias) - log Z'_t. Each prompt is charged 1 unbiased call plus one per
        biased token. Only the simulator has this switch: the HTTP backend, like the APIs of the
        paper's threat model, offers no logit bias.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise NVError("tokens must be a 1-D array of token ids")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise NVError(f"token ids must lie in [0, {self.vocab_size})")
        if not np.isfinite(bias):
            raise NVError(f"logit bias must be finite, got {bias}")
        top = np.empty(len(prompts), dtype=np.int64)
        y_top = np.empty(len(prompts))
        y_biased = np.empty((len(prompts), tokens.size))
        q = 0
        for batch in self._batches(prompts):
            for z, ell in zip(*self._forward(batch)):
                r = int(np.argmax(z))
                u = z[tokens] - z[r]  # logits relative to the top one, so log Z is near 0
                log_S = float(np.log(np.exp(z - z[r]).sum()))
                log_S_biased = log_S + np.log1p(np.exp(u - log_S) * np.expm1(bias))
                top[q], y_top[q] = r, -log_S
                y_biased[q] = np.where(tokens == r, np.nan, np.maximum(0.0, u + bias) - log_S_biased)
                self.cost.charge(ell, calls=1 + int(np.count_nonzero(tokens != r)))
                q += 1
        return top, y_top, y_biased
