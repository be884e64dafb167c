"""HTTP backend of the oracle layer: any OpenAI-compatible endpoint (vLLM, llama.cpp, SGLang, hosted).

One request is one chat completion (``chat=True``; the server applies the model's chat template
and default system prompt) or plain completion with ``max_tokens = 1``, temperature tau, and
``logprobs`` with ``top_logprobs = 0``: the sampled token and its log-probability y_q^(i), the
paper's threat model (§2, Alg. 1 line 2). ``n`` > 1 samples ride on one request (one prefill)
where the server honours ``n`` (``probe`` finds out). Requests are deterministic functions of
(prompt, sample index, seed): each carries its own ``seed``, so a resumed run asks exactly what an
uninterrupted one would, and every paid reply is journaled (``nv.oracle.journal``) before it is used.

Token identity: the token's ``bytes`` when the server sends them (OpenAI, vLLM), a vLLM
``token_id:N`` string, else its text (llama.cpp). Text that cannot identify a token (empty, or with
U+FFFD: partial UTF-8 byte tokens, which llama.cpp renders lossily) is counted but gets no column.
Token keys map to stable column indexes through the journal's column map, assigned in request
order, never arrival order.

Cost, two accountings: ``cost`` is the paper's §5 metric, (prompt + 1 output token) x samples, as
the Simulator charges; ``provider_cost`` is what a provider bills, prompt tokens once per request
plus the output tokens, from the server's ``usage``, over every paid reply in the journal. The
budget (tokens, calls, money) is checked against the provider's count before each request is sent,
with the request's cost reserved up front, so the attack stops before overspending.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import html
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import unquote, urlsplit

import httpx
import numpy as np
from tqdm.auto import tqdm

from nv.errors import NVError
from nv.oracle.journal import Journal, canonical, request_key
from nv.oracle.base import BudgetExhausted, Cost, Oracle, Samples, TimedCall, check_sampling

PROBE_PROMPT = "Hello"
PROBE_TEMPERATURE = 0.5  # far from 1, where processed and raw log-probs coincide
# HTTP statuses retried (with the other 5xx but 501 Not Implemented and 505, which no retry mends); other 4xx are final
TRANSIENT = (408, 425, 429)
NOTICE_EVERY = 10.0  # seconds between two lines about retries


def split_credentials(base_url: str) -> tuple[str, dict]:
    """(the base URL without ``user:password@``, the HTTP Basic ``Authorization`` header it carried, or {}):
    the URL goes into journals, reports and errors, the credentials only into request headers."""
    public = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@", r"\1", base_url)  # also where urlsplit fails on the rest
    cut = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)[/?#][^@]*@", base_url)
    # 'user:pa/ss@host': nothing removed, a ':' before the first '/' that no port explains ([IPv6] aside), an '@' after
    # it; an '@' in a path alone is a path's ('.../deployments/m@2024')
    if public == base_url and cut and re.search(r":(?!\d*$)", re.sub(r"\[[^\]]*\]", "", cut.group(1))):
        hidden = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://).*@", r"\1...@", base_url)
        raise NVError(f"base URL {hidden!r} has an '@' after its host: percent-encode a '/', '?' or '#' in its user or "
                      "password (%2F, %3F, %23)")
    try:
        parts = urlsplit(base_url)
        user, password = parts.username, parts.password
    except ValueError:  # HTTPOracle names what is wrong with the (public) URL
        return public, {}
    if user is None and password is None:
        return public, {}
    token = base64.b64encode(f"{unquote(user or '')}:{unquote(password or '')}".encode()).decode()
    return public, {"Authorization": f"Basic {token}"}


@dataclass(frozen=True)
class Limits:
    """Politeness: parallel requests, requests and tokens per minute (0: none), retries with
    exponential backoff (``backoff`` s doubled per attempt, plus up to as much uniform jitter, the
    wait at most ``backoff_max``), and the per-request timeout in seconds."""

    concurrency: int = 8
    rpm: float = 0
    tpm: float = 0
    retries: int = 8
    backoff: float = 0.5
    backoff_max: float = 60.0
    timeout: float = 120.0


@dataclass(frozen=True)
class Budget:
    """Hard caps on what the provider bills (None: no cap); money = billed tokens x price / 1e6."""

    tokens: int | None = None
    calls: int | None = None
    money: float | None = None
    price_per_mtok: float | None = None

    def money_of(self, tokens: int) -> float | None:
        return None if self.price_per_mtok is None else tokens * self.price_per_mtok / 1e6

    def passed(self, calls: int, tokens: int) -> tuple[str, float, float] | None:
        """The first cap that ``calls`` requests of ``tokens`` billed tokens in all pass, as (what, cap, amount), or
        None within every cap."""
        money = self.money_of(tokens)
        for what, cap, amount in (("calls", self.calls, calls), ("tokens", self.tokens, tokens), ("money", self.money, money)):
            if cap is not None and amount is not None and amount > cap:
                return what, cap, amount
        return None


class _Stopped(Exception):
    """The run was interrupted: a request not yet sent (or a retry not yet made) is not sent."""


class _Retry(Exception):
    """A transient failure: HTTP 408, 425, 429, 5xx but 501 and 505; a timeout, dropped connection, truncated or
    non-JSON reply."""

    def __init__(self, reason: str, retry_after: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


def token_key(entry: dict | None) -> str | None:
    """A token's identity in a logprobs entry, or None when the reply does not identify it."""
    if not isinstance(entry, dict):
        return None
    raw, text = entry.get("bytes"), entry.get("token")
    if isinstance(raw, list) and raw:
        if isinstance(text, str) and "\ufffd" in text and raw == list(text.encode("utf-8", "replace")):
            return None  # bytes re-encoded from lossy text (vLLM's): every partial UTF-8 token would share them
        return "b:" + bytes(raw).hex()  # ids that are not bytes raise here; parse_reply reports them
    if not isinstance(text, str) or text == "" or "\ufffd" in text:
        return None
    if text.startswith("token_id:"):
        return "id:" + text[len("token_id:") :]
    return "s:" + text


def usage_counts(usage) -> dict:
    """A reply's ``usage`` as the journal's {"p": prompt tokens >= 1, "o": output tokens >= 0}: whole numbers (a zero
    or negative count, or Infinity, would undercount the §5 cost and the caps, and fail the sample's checks after the
    run had paid for it)."""
    counts = {"p": usage["prompt_tokens"], "o": usage.get("completion_tokens") or 0}
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value) \
                or value < (1 if key == "p" else 0):
            raise NVError(f"reply's usage counts are not whole token counts (prompt_tokens >= 1, completion_tokens >= 0): "
                          f"{json.dumps(usage)[:200]}: its cost cannot be counted (a server that counts a cached prompt "
                          "as 0 tokens, as Ollama did before its fixes of 2024 and 2026, needs an upgrade)")
        counts[key] = int(value)
    return counts


def parse_reply(data, chat: bool, top_logprobs: int) -> dict:
    """The journal record of one reply: per choice [token key, log-prob, top entries], usage.

    A choice whose log-probs are present but empty (llama.cpp when the end-of-turn token is drawn)
    gives [None, None, []]. A reply without log-probs at all, or with malformed ones (not a finite number <= 0, a
    token that is not a string or bytes), raises NVError.
    """
    try:
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
        record = {"c": []} | usage_counts(data["usage"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise NVError(f"reply is not an OpenAI completion (no choices/usage): {canonical(data)[:200]}") from None
    for choice in choices:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lp, dict):
            raise NVError("the endpoint returned no log-probabilities (llama.cpp: logits_all on; vLLM: --max-logprobs >= 1; "
                          "hosted: a model with logprobs)")
        try:
            if chat:
                content = lp.get("content") or []
                first = content[0] if content else None
                top = (first or {}).get("top_logprobs") or []
                entries = [(token_key(t), t.get("logprob")) for t in top[:top_logprobs]]
            else:
                tokens = lp.get("tokens") or []
                first = {"token": tokens[0], "logprob": (lp.get("token_logprobs") or [None])[0]} if tokens else None
                top = ((lp.get("top_logprobs") or [None])[0] or {}) if tokens else {}
                entries = [(token_key({"token": t}), v) for t, v in list(top.items())[:top_logprobs]]
            value = None if first is None or first.get("logprob") is None else _logprob(first["logprob"])
            record["c"].append([token_key(first), value, [[k, _logprob(v)] for k, v in entries if k and v is not None]])
        except (AttributeError, TypeError, ValueError) as exc:
            raise NVError(f"the endpoint's log-probabilities are malformed ({exc}): {json.dumps(lp, default=str)[:200]}") from None
    return record


def _logprob(value) -> float:
    """A reply's log-probability: a finite number <= 0 (a rounding slack of 1e-4 above), else ValueError."""
    v = float(value)
    if not math.isfinite(v) or v > 1e-4:
        raise ValueError(f"log-probability {value!r} is not a finite number <= 0")
    return v


def request_seed(seed, index: int) -> int:
    """The per-request seed: a 31-bit hash of (the prompt's seed, the request's index)."""
    return int(hashlib.sha256(canonical([seed, index]).encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


class HTTPOracle(Oracle):
    """Oracle over an OpenAI-compatible endpoint (``base_url`` like "http://host:port/v1")."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        chat: bool = True,
        journal: Journal | None = None,
        n_per_request: int = 1,
        top_logprobs: int = 0,
        extra_body: dict | None = None,
        columns: int = 262144,
        prompt_tokens_estimate: int = 45,
        limits: Limits = Limits(),
        budget: Budget = Budget(),
        progress: bool = False,
    ) -> None:
        super().__init__()
        base_url, basic_auth = split_credentials(base_url)
        try:
            parts = urlsplit(base_url)
        except ValueError:  # preflight names what is wrong with it
            parts = None
        if parts and (parts.query or parts.fragment):
            raise NVError(f"base URL {base_url!r} must not carry a query or fragment: give e.g. http://127.0.0.1:8080/v1")
        try:
            port = parts.port if parts else None  # urllib checks the range; httpx would say "connection refused"
        except ValueError:
            port = 0
        if port == 0:
            raise NVError(f"base URL {base_url!r}: the port must be a number in 1-65535")
        if parts and parts.scheme not in ("http", "https"):
            raise NVError(f"base URL {base_url!r} must start with http:// or https://: give e.g. http://127.0.0.1:8080/v1")
        if parts and not parts.hostname:
            raise NVError(f"base URL {base_url!r} names no host: give e.g. http://127.0.0.1:8080/v1")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        self.journal = journal or Journal(None, {})
        self.n_per_request = n_per_request
        self.n_supported: bool | None = None
        self.top_logprobs = top_logprobs
        self.extra_body = dict(extra_body or {})
        self.columns = columns
        self.prompt_tokens_estimate = prompt_tokens_estimate
        self.limits = limits
        self.budget = budget
        self.progress = progress
        self.stats = {"sent": 0, "replayed": 0, "retries": 0}
        self.greedy: dict[str, tuple[int, float]] = {}  # prompt -> (column or -1, log-prob) of its T = 0 call
        self._probe_pairs: list[tuple[float, float]] = []  # (T = 0, T = 0.5) log-probs of the probe's argmax token
        key = os.environ.get(api_key_env)
        # httpx would raise UnicodeEncodeError at the first request, h11 an error that prints the header, the key in it
        if key and not (key.isascii() and key.isprintable() and key == key.strip()):
            raise NVError(f"${api_key_env} holds a character an HTTP header cannot carry (a space or line break at "
                          "either end, a control or non-ASCII character): check its value")
        self._key_env = (api_key_env, bool(key))
        self._basic_auth = bool(basic_auth)
        self._headers = basic_auth or ({"Authorization": f"Bearer {key}"} if key else {})
        self._prompt_len: dict[str, int] = {}
        self._longest = 0
        self._timed: dict[str, int] = {}
        self._reserved_calls = 0
        self._reserved_tokens = 0
        self._next_slot = 0.0
        self._stopping = False  # set on Ctrl-C: the requests in flight finish and are journaled, nothing new is sent
        self._quiet_until = 0.0  # the next _notice may be written from this time.monotonic() on
        self._client: httpx.AsyncClient | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nv-http", daemon=True)
        self._thread.start()

    @classmethod
    def from_params(cls, base_url: str, model: str, live: dict, journal: Journal | None, budget: Budget,
                    progress: bool = False) -> HTTPOracle:
        """An oracle configured by params.yaml's ``live`` section."""
        limits = Limits(live["concurrency"], live["rpm"], live["tpm"], live["retries"], live["backoff"],
                        timeout=live["timeout"])
        return cls(base_url, model, chat=live["chat"], journal=journal, n_per_request=live["n_per_request"],
                   top_logprobs=live["top_logprobs"], extra_body=live["extra_body"], columns=live["columns"],
                   prompt_tokens_estimate=live["prompt_tokens"], limits=limits, budget=budget, progress=progress)

    @property
    def vocab_size(self) -> int:
        """Columns of Y_hat: an upper bound on the distinct tokens (the target's |V| is unknown)."""
        return self.columns

    @property
    def provider_cost(self) -> Cost:
        """Provider accounting over every paid reply of this attack (the journal, all processes)."""
        j = self.journal
        return Cost(calls=j.requests, prompt_tokens=j.prompt_tokens, output_tokens=j.output_tokens)

    # -- set-up checks ----------------------------------------------------------------------

    def preflight(self) -> None:
        """Free check (GET /models): the endpoint answers JSON and serves ``model``; no retries."""
        url = f"{self.base_url}/models"
        try:
            r = httpx.get(url, headers=self._headers, timeout=min(self.limits.timeout, 30))
        except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:  # UnicodeError: a host name IDNA refuses
            raise NVError(f"cannot reach {url}: {type(exc).__name__} {exc}".strip()) from None
        if r.status_code in (401, 403):
            raise NVError(f"{url} refused the credentials (HTTP {r.status_code}): {self._credentials_fix()}")
        if 300 <= r.status_code < 400:
            raise NVError(f"{url} redirects (HTTP {r.status_code}) to {r.headers.get('location', '?')}: give the endpoint's "
                          "own URL as --base-url")
        if r.status_code >= 500:  # the server's own words: a URL hint would send the user after the wrong fault (a review)
            raise NVError(f"{url} failed: HTTP {r.status_code} {_detail(r)}".strip() + " (a server still loading, or down "
                          "behind a proxy, answers so: retry when it is up)")
        try:
            data = r.json()
            served = [str(m["id"]) for m in data["data"]]
        except (ValueError, KeyError, TypeError):
            kind = r.headers.get("content-type", "no content type")
            raise NVError(f"{url} did not answer an OpenAI model list (HTTP {r.status_code}, {kind}): "
                          "is this an OpenAI-compatible base URL ending in /v1?") from None
        if self.model not in served:
            raise NVError(f"model {self.model!r} is not served at {self.base_url} (it serves: {', '.join(served) or 'nothing'})")

    def _credentials_fix(self) -> str:
        """What to do about a refused key or password (HTTP 401/403)."""
        env, given = self._key_env
        return ("check the user and password in the URL" if self._basic_auth else
                f"${env} is set, but not to a key it accepts: check its value" if given else f"set the API key variable (${env})")

    def probe(self) -> None:
        """Two paid requests (journaled) on a low-entropy prompt: n = max(2, n_per_request) samples at
        T = PROBE_TEMPERATURE, whose reply must carry log-probs (else nothing more is sent), then one
        at T = 0. ``n`` is honoured if n choices come back; the argmax token, almost surely drawn at
        T = 0.5, shows raw log-probs (the same value at both temperatures) or processed ones."""
        n = max(2, self.n_per_request)
        bodies = [self._body(PROBE_PROMPT, PROBE_TEMPERATURE, n, 0, logprobs=True), self._body(PROBE_PROMPT, 0.0, 1, None, logprobs=True)]
        new = sum(request_key(body) not in self.journal for body in bodies)  # a rerun's are replayed, not sent
        if self.progress and new:
            tqdm.write(f"probe: {new} request{'s' * (new > 1)} to {self.base_url}: log-probs, n honoured, raw or processed "
                       f"(timeout {self.limits.timeout:g} s, {self.limits.retries} retries)", file=sys.stderr)
        (sampled,) = self._run(bodies[:1], 1)
        if not sampled["c"] or all(lp is None for _, lp, _ in sampled["c"]):
            raise NVError("the endpoint returned no log-probability for the sampled token")
        (greedy,) = self._run(bodies[1:], 1)
        self.n_supported = len(sampled["c"]) == n
        if not self.n_supported:
            self.n_per_request = 1
        key, lp, _ = greedy["c"][0] if greedy["c"] else (None, None, [])
        self._probe_pairs = [(lp, v) for k, v, _ in sampled["c"]
                             if key is not None and k == key and lp is not None and v is not None]

    # -- the Oracle interface -----------------------------------------------------------------

    def sample(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence) -> list[Samples]:
        """``n`` samples per prompt at ``temperature``; request j of prompt q is seeded by (seeds[q], j).

        Per prompt: the identified tokens, the log-prob of each from its first request (request order),
        and how many calls revealed it (with ``top_logprobs`` > 0 the top entries count as reveals too).
        """
        check_sampling(n, temperature, prompts, seeds)
        sizes = self._sizes(n)
        bodies = (self._sample_body(prompts, temperature, seeds, sizes, i) for i in range(len(prompts) * len(sizes)))
        seen: list[dict[str, list]] = [{} for _ in prompts]  # token key -> [log-prob at first sight, reveals]
        ell = [0] * len(prompts)

        def take(i: int, record: dict) -> None:  # records arrive out of order; i is the request order
            q, j = divmod(i, len(sizes))
            ell[q] = record["p"]
            for c, (key, lp, top) in enumerate(record["c"]):
                # the sampled token first, with its own value (a top entry of it, listed again, does not replace it)
                first = [] if lp is None else [(key, lp)]
                revealed = dict(first + [tuple(t) for t in top if lp is None or t[0] != key])
                for t, (k, v) in enumerate(revealed.items()):
                    if k is not None:
                        entry = seen[q].setdefault(k, [((j, c, t), v), 0])
                        entry[0] = min(entry[0], ((j, c, t), v))
                        entry[1] += 1

        self._run(bodies, len(prompts) * len(sizes), take)
        out = []
        for q, tokens in enumerate(seen):
            first = sorted(tokens, key=lambda k: tokens[k][0][0])  # columns are assigned in request order
            cols = np.array([self._column(k) for k in first], dtype=np.int64)
            order = np.argsort(cols)
            out.append(Samples(cols[order], np.array([tokens[k][0][1] for k in first])[order],
                               np.array([tokens[k][1] for k in first], dtype=np.int64)[order], ell[q]))
            self.cost.charge(ell[q], calls=n)
        self.journal.sync()  # the columns just assigned, durable before a shard can be written with them
        return out

    def argmax(self, prompts: Sequence[str]) -> list[Samples]:
        """One temperature-0 call per prompt. A token the reply does not identify gets column -1;
        an end-of-turn token reported without a log-prob counts as probability 1 (never kept); a token named
        with a null log-prob (a provider's ``min_logprob`` floor, ``nv defend``) is NaN: withheld, as
        ``DefendedOracle`` reports it."""
        records = self._run((self._body(p, 0.0, 1, None, logprobs=True) for p in prompts), len(prompts))
        out = []
        for prompt, record in zip(prompts, records):
            key, lp, _ = record["c"][0] if record["c"] else (None, None, [])
            col = -1 if key is None else self._column(key)
            lp = lp if lp is not None else 0.0 if key is None else math.nan
            self.greedy[prompt] = (col, lp)
            out.append(Samples(np.array([col]), np.array([lp]), np.array([1]), record["p"]))
            self.cost.charge(record["p"], calls=1)
        self.journal.sync()
        return out

    def time_request(self, prompt: str) -> TimedCall:
        """One greedy call with one output token, no log-probs (their computation would be timed too).

        Seconds: client-side, from sending the request to receiving the whole (non-streamed) reply,
        which with max_tokens = 1 is the arrival of the first token (App. D times whole requests
        the same way). The k-th timing of the same prompt is its own journal entry.
        """
        occurrence = self._timed.get(prompt, 0)
        self._timed[prompt] = occurrence + 1
        body = self._body(prompt, 0.0, 1, None, logprobs=False)
        (record,) = self._run([body], 1, key_extra={"timed": occurrence})
        self.cost.charge(record["p"], calls=1)
        return TimedCall(record["t"], record["p"])

    # -- report helpers -----------------------------------------------------------------------

    def logprob_mode(self, prompts: Sequence[str], sampled) -> dict:
        """Raw or processed log-probs: the T = 0 call of a prompt reports its argmax token's log-prob;
        where samples at T != 1 of that prompt (the probe's, and the attack's tau-samples) drew the same
        token, equal values (|diff| < 1e-3) mean raw log_softmax(z), different ones processed
        log_softmax(z / T)."""
        agree, compared = sum(abs(a - b) < 1e-3 for a, b in self._probe_pairs), len(self._probe_pairs)
        for q, prompt in enumerate(prompts):
            col, lp = self.greedy.get(prompt, (-1, 0.0))
            if col >= 0 and math.isfinite(lp) and sampled.counts[q, col] > 0:
                compared += 1
                agree += abs(float(sampled.logprobs[q, col]) - lp) < 1e-3
        mode = "unknown" if not compared else "raw" if agree == compared else "processed" if not agree else "mixed"
        return {"mode": mode, "compared": compared, "equal": agree}

    def __enter__(self) -> HTTPOracle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the request thread (the journal stays open)."""
        if self._thread.is_alive():
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    # -- requests ---------------------------------------------------------------------------

    def _body(self, prompt: str, temperature: float, n: int, seed: int | None, logprobs: bool) -> dict:
        body = {**self.extra_body, "model": self.model, "max_tokens": 1, "temperature": temperature}  # ours win
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            if logprobs:
                body.update(logprobs=True, top_logprobs=self.top_logprobs)
        else:
            body["prompt"] = prompt
            if logprobs:
                body["logprobs"] = self.top_logprobs
        if n > 1:
            body["n"] = n
        if seed is not None:
            body["seed"] = seed
        return body

    def _column(self, key: str) -> int:
        col = self.journal.column(key)
        if col >= self.columns:
            raise NVError(f"more than {self.columns} distinct tokens seen: raise live.columns")
        return col

    def _run(self, bodies: Iterable[dict], total: int, take: Callable[[int, dict], None] | None = None,
             key_extra: dict | None = None) -> list[dict]:
        """Send (or replay from the journal) every body, ``concurrency`` at a time; the bodies are
        consumed lazily. ``take(i, record)`` gets each record (i: request order) as it arrives;
        without ``take`` the records come back as a list in request order."""
        records: list[dict] = [{}] * total if take is None else []
        take = take or records.__setitem__
        bar = tqdm(total=total, desc="requests", unit="req", leave=False, position=1, disable=not self.progress or total < 2)
        self._stopping = False
        future = asyncio.run_coroutine_threadsafe(self._gather(enumerate(bodies), take, key_extra, bar), self._loop)
        try:
            future.result()
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, see run_main): the requests in flight are paid for already
            self._stopping = True  # no new request, no retry; wait for the replies in flight and journal them
            bar.close()
            print("interrupted: journaling the replies in flight (Ctrl-C again to abandon them)", file=sys.stderr)
            try:
                future.result()
            except (_Stopped, NVError):  # a request that fails after the interrupt: moot, the run stops anyway
                pass
            except KeyboardInterrupt:  # again: abandon them; the task, cancelled (perhaps before it started), ends here
                future.cancel()  # rather than pending to the interpreter's exit, which printed its frame (a review)
                asyncio.run_coroutine_threadsafe(_settled(), self._loop).result()
            raise
        finally:
            bar.close()
        return records

    async def _gather(self, jobs: Iterator[tuple[int, dict]], take, key_extra: dict | None, bar) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._headers, timeout=self.limits.timeout,
                                             limits=httpx.Limits(max_connections=self.limits.concurrency))
        errors: list[BaseException] = []

        async def worker():
            for i, body in jobs:
                if self._stopping:
                    return
                try:
                    take(i, await self._call(body, key_extra))
                except BaseException as exc:  # stop taking work; requests in flight finish and are journaled
                    errors.append(exc)
                if errors:
                    return
                bar.set_postfix_str(self._spend(), refresh=False)  # before the count, which redraws the line
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(self.limits.concurrency)))
        self.journal.sync()
        if errors:
            raise errors[0]

    def _spend(self) -> str:
        c = self.provider_cost
        money = self.budget.money_of(c.tokens)
        return f"{c.calls} calls, {c.tokens:,} tokens" + ("" if money is None else f", {money:.4g} spent")

    async def _call(self, body: dict, key_extra: dict | None) -> dict:
        key = request_key(body if key_extra is None else {"body": body, **key_extra})
        prompt = body.get("prompt") or body["messages"][0]["content"]
        record = self.journal.get(key)
        if record is not None:  # served free; its prompt's tokens are known as if it had been paid now (a resumed
            self._measured(prompt, record)  # run's budget checks use them)
            self.stats["replayed"] += 1
            return record
        # prompt tokens are known once the prompt has been answered; before that, twice the longest seen
        estimate = self._prompt_len.get(prompt, 2 * max(self.prompt_tokens_estimate, self._longest)) + body.get("n", 1)
        self._reserve(estimate)
        try:
            await self._pace(estimate)
            if self._stopping:
                raise _Stopped
            timed = "timed" in (key_extra or {})
            record = await self._post(body, timed)
        finally:
            self._reserved_calls -= 1
            self._reserved_tokens -= estimate
        self._measured(prompt, record)
        self.journal.put(key, record)
        self.stats["sent"] += 1
        return record

    def _measured(self, prompt: str, record: dict) -> None:
        self._prompt_len[prompt] = record["p"]
        self._longest = max(self._longest, record["p"])

    def _over(self, calls: int, tokens: int) -> tuple[str, float, float] | None:
        """The budget cap (``Budget.passed``) that ``calls`` more requests of ``tokens`` more billed tokens would pass,
        on top of what is spent and reserved; None within every cap."""
        spent = self.provider_cost
        return self.budget.passed(spent.calls + self._reserved_calls + calls, spent.tokens + self._reserved_tokens + tokens)

    def refuses(self, prompts: Sequence[str], n: int, temperature: float, seeds: Sequence,
                prompt_tokens: Sequence[int] | None = None) -> str | None:
        """The sample's requests not yet in the journal (a resumed run's are served free) against the caps."""
        if prompt_tokens is None:  # measured by this run's replies (the search's, for the first round), else estimated
            prompt_tokens = [self._prompt_len.get(p, max(self.prompt_tokens_estimate, self._longest)) for p in prompts]
        sizes = self._sizes(n)
        requests = tokens = 0
        for q, ell in enumerate(prompt_tokens):
            paid = self._journaled_prefix(lambda j: self._sample_body(prompts, temperature, seeds, sizes, q * len(sizes) + j),
                                          len(sizes))
            requests += len(sizes) - paid
            tokens += int(ell) * (len(sizes) - paid) + sum(sizes[paid:])
        over = self._over(requests, tokens) if requests else None  # nothing to pay passes no cap
        return None if over is None else (f"{requests:,} requests of ~{tokens:.3g} billed tokens would pass the "
                                          f"{over[0]} cap of {over[1]:,.6g} (spent so far: {self._spend()})")

    @contextmanager
    def holding(self, calls: int, tokens: int) -> Iterator[None]:
        """Keep ``calls`` requests and ``tokens`` billed tokens of the budget for later work (phase 2) while the work of
        this span (phase 1) spends: the caps and ``refuses`` count them as reserved. Entered and left with nothing in
        flight."""
        self._reserved_calls += calls
        self._reserved_tokens += tokens
        try:
            yield
        finally:
            self._reserved_calls -= calls
            self._reserved_tokens -= tokens

    def _journaled_prefix(self, body: Callable[[int], dict], total: int) -> int:
        """How many of one prompt's ``total`` requests (``body(j)``, in sending order) the journal already answers: a
        prefix (requests go out in order, and a larger N extends a prompt's requests past the ones paid), found by
        binary search. A request lost in flight at a kill -9 leaves a gap: the count is then off by the few requests
        around it, either way; the in-flight cap still holds the budget."""
        def paid(i: int) -> bool:
            return request_key(body(i)) in self.journal

        if total == 0 or not paid(0):
            return 0
        lo, hi = 1, total  # paid(lo - 1) holds; the first unpaid index lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if paid(mid) else (lo, mid)
        return lo

    def _sizes(self, n: int) -> list[int]:
        """Samples per request for ``n`` samples of one prompt: ``n_per_request`` each where the server honours n."""
        per = self.n_per_request
        return [min(per, n - j * per) for j in range(math.ceil(n / per))]

    def _sample_body(self, prompts: Sequence[str], temperature: float, seeds: Sequence, sizes: list[int], i: int) -> dict:
        """Request i of ``sample``: request j of prompt q, with i = q len(sizes) + j."""
        q, j = divmod(i, len(sizes))
        return self._body(prompts[q], temperature, sizes[j], request_seed(seeds[q], j), logprobs=True)

    def _reserve(self, tokens: int) -> None:
        over = self._over(1, tokens)
        if over:
            raise BudgetExhausted(f"budget reached: the next request would pass the {over[0]} cap of {over[1]} "
                                  f"(spent so far: {self._spend()}); paid work is in the journal: raise the budget "
                                  "and rerun the same command to resume")
        self._reserved_calls += 1
        self._reserved_tokens += tokens

    async def _pace(self, tokens: int) -> None:
        """Requests/tokens-per-minute limits: each request takes a time slot of its own."""
        rpm, tpm = self.limits.rpm, self.limits.tpm
        if not rpm and not tpm:
            return
        now = self._loop.time()
        start = max(now, self._next_slot)
        self._next_slot = start + max(60.0 / rpm if rpm else 0.0, 60.0 * tokens / tpm if tpm else 0.0)
        if start - now > NOTICE_EVERY:
            self._notice(f"pacing to live.rpm = {rpm:g}, live.tpm = {tpm:g}: the next request in {start - now:.0f} s")
        await self._sleep(start - now)

    async def _post(self, body: dict, timed: bool) -> dict:
        """POST with retries on transient failures; the parsed record (timed: seconds and usage)."""
        url = f"{self.base_url}/{'chat/completions' if self.chat else 'completions'}"
        last = ""
        for attempt in range(self.limits.retries + 1):
            if attempt and self._stopping:
                raise _Stopped
            if attempt:
                self.stats["retries"] += 1
            try:
                start = time.perf_counter()
                r = await self._client.post(url, json=body)
                seconds = time.perf_counter() - start
                status = f"HTTP {r.status_code} {_detail(r)}".strip() if r.status_code >= 400 else ""
                if r.status_code in TRANSIENT or (r.status_code >= 500 and r.status_code not in (501, 505)):
                    raise _Retry(status, r.headers.get("retry-after"))
                if r.status_code in (401, 403):  # a server may leave its model list open and guard its completions
                    raise NVError(f"{url} refused the credentials ({status}): {self._credentials_fix()}")
                if r.status_code >= 400:
                    raise NVError(f"{url} refused the request: {status}")
                if r.status_code >= 300:  # redirects are not followed: a POST's body would not survive all of them
                    raise NVError(f"{url} redirects (HTTP {r.status_code}) to {r.headers.get('location', '?')}: "
                                  "give the endpoint's own URL as --base-url")
                try:
                    data = r.json()
                except ValueError:
                    raise _Retry("truncated or non-JSON reply") from None
            except httpx.TimeoutException:
                last, wait = "timeout", None
            except httpx.DecodingError:  # a body its Content-Encoding cannot decode: as torn as a truncated one
                last, wait = "undecodable reply", None
            except httpx.TransportError as exc:
                last, wait = f"connection error ({type(exc).__name__})", None
            except _Retry as exc:
                last, wait = exc.reason, exc.retry_after
            else:
                if timed:
                    try:
                        return {"t": seconds} | usage_counts(data["usage"])
                    except (KeyError, TypeError, ValueError, AttributeError):
                        raise NVError(f"reply has no usage.prompt_tokens count: {canonical(data)[:200]}") from None
                return parse_reply(data, self.chat, self.top_logprobs)
            if self._stopping:  # interrupted: no retry, and no notice of one
                raise _Stopped
            if attempt < self.limits.retries:
                delay = self._backoff(attempt, wait)
                self._notice(f"{url}: {last}; retry {attempt + 1} of {self.limits.retries} in {delay:.1f} s "
                             f"({self.stats['retries'] + 1} retries in this run)")
                await self._sleep(delay)
        raise NVError(f"{url}: giving up after {self.limits.retries} retries (last: {last}); "
                      "paid work so far is in the journal and a rerun resumes from it")

    async def _sleep(self, seconds: float) -> None:
        """A pacing or back-off wait, cut short by Ctrl-C (then nothing more is sent: ``_Stopped``)."""
        end = self._loop.time() + seconds
        while (left := end - self._loop.time()) > 0:
            if self._stopping:
                raise _Stopped
            await asyncio.sleep(min(left, 0.2))
        if self._stopping:
            raise _Stopped

    def _notice(self, message: str) -> None:
        """A line on stderr about a slow or failing endpoint (not with --quiet), at most one per NOTICE_EVERY s."""
        now = time.monotonic()
        if self.progress and now >= self._quiet_until:
            self._quiet_until = now + NOTICE_EVERY
            tqdm.write(message[:300], file=sys.stderr)

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        base = min(self.limits.backoff_max, self.limits.backoff * 2**attempt)
        delay = min(self.limits.backoff_max, base + random.uniform(0, base))
        if retry_after:
            try:
                wait = float(retry_after)
            except ValueError:  # the header's other form, an HTTP date (RFC 9110)
                try:
                    when = email.utils.parsedate_to_datetime(retry_after)
                    wait = (when.replace(tzinfo=when.tzinfo or timezone.utc) - datetime.now(timezone.utc)).total_seconds()
                except (TypeError, ValueError):
                    wait = 0.0
            if math.isfinite(wait):
                delay = max(delay, min(wait, self.limits.backoff_max))
        return delay


async def _settled() -> None:
    """Until every other task on the running loop has ended (an abandoned ``_gather``'s, once cancelled)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others)


def _detail(r: httpx.Response) -> str:
    """The server's error message, one line, at most 200 characters."""
    try:
        data = r.json()
        msg = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        text = r.text
        if "html" in r.headers.get("content-type", "") or text.lstrip().startswith("<"):  # an HTML error page: its words
            text = html.unescape(re.sub(r"<(script|style)\b.*?</\1>|<[^>]*>", " ", text, flags=re.S | re.I))
    return " ".join(text.split())[:200]
