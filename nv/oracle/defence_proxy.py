"""``nv defend``: the defence layer as an OpenAI-compatible reverse proxy on 127.0.0.1, in front of any server
(vLLM, llama.cpp, a provider), for providers who want to try a setting and for tests that attack a defended server.

Every request is forwarded upstream; ``/v1/chat/completions`` and ``/v1/completions`` are defended with the same
knobs and the same pure functions as ``DefendedOracle`` (``nv.oracle.defence``):

- request side: ``max_temperature`` caps the request's temperature; ``top_k``/``top_p``/``min_p`` are set on it
  (the server's own truncated sampling);
- reply side: each returned log-prob (the sampled token's and any ``top_logprobs``) gets fresh N(0, sigma^2)
  noise, then ``round_format`` and ``round_decimals``; one below ``min_logprob`` is returned as null;
- timing: the reply waits out ``delay_uniform_ms`` / ``delay_exp_ms`` and then until the elapsed time is a
  multiple of ``latency_quantum_ms``.

``pad_to_tokens`` needs the served model's tokenizer, which a proxy does not have: refused, as for the HTTP oracle.
Other paths (``/v1/models``, ``/health``) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from urllib.parse import urlparse

import aiohttp
import numpy as np
from aiohttp import web

from nv.errors import NVError
from nv.oracle.defence import Defence, http_truncation_fields, quantise

DEFENDED = ("/v1/chat/completions", "/v1/completions")
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def check_upstream(url: str) -> str:
    """The upstream base URL (scheme and host, no path), or a one-line error."""
    try:
        u = urlparse(url)
        ok = u.scheme in ("http", "https") and u.hostname and u.port != 0  # .port checks the range
    except ValueError:  # e.g. an unclosed IPv6 bracket
        ok = False
    if not ok:
        raise NVError(f"--upstream must be an http(s) URL such as http://127.0.0.1:8080, got {url!r}")
    return f"{u.scheme}://{u.netloc}"


def defend_request(body: dict, defence: Defence) -> dict:
    """The request as the provider serves it: temperature capped, the truncation fields set."""
    body = dict(body)
    if defence.max_temperature is not None and body.get("temperature", 1.0) > defence.max_temperature:
        body["temperature"] = defence.max_temperature
    return body | http_truncation_fields(defence)


def _value(y, defence: Defence, rng: np.random.Generator):
    if y is None:
        return None
    if defence.min_logprob is not None and y < defence.min_logprob:
        return None
    if defence.noise_sigma:
        y = y + defence.noise_sigma * rng.standard_normal()
    return float(quantise(np.array([y], dtype=np.float64), defence)[0])


def defend_reply(reply: dict, defence: Defence, rng: np.random.Generator) -> dict:
    """Every log-prob of a chat or completions reply, as the defended API returns it."""
    for choice in reply.get("choices", []):
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            continue
        for entry in lp.get("content") or []:  # chat: [{token, logprob, top_logprobs: [{token, logprob}]}]
            entry["logprob"] = _value(entry.get("logprob"), defence, rng)
            for top in entry.get("top_logprobs") or []:
                top["logprob"] = _value(top.get("logprob"), defence, rng)
        if lp.get("token_logprobs") is not None:  # completions: token_logprobs, top_logprobs [{token: logprob}]
            lp["token_logprobs"] = [_value(y, defence, rng) for y in lp["token_logprobs"]]
            lp["top_logprobs"] = [{t: _value(y, defence, rng) for t, y in (top or {}).items()} for top in lp.get("top_logprobs") or []]
    return reply


def added_delay_s(defence: Defence, rng: np.random.Generator) -> float:
    """The random delay a reply waits (seconds)."""
    ms = 0.0
    if defence.delay_uniform_ms is not None:
        ms += rng.uniform(0.0, defence.delay_uniform_ms)
    if defence.delay_exp_ms is not None:
        ms += rng.exponential(defence.delay_exp_ms)
    return ms / 1000.0


def make_app(upstream: str, defence: Defence, seed: int) -> web.Application:
    """The aiohttp application of the proxy (``serve`` runs it; tests run it in a thread)."""
    if defence.pad_to_tokens is not None:
        raise NVError("pad_to_tokens needs the served model's tokenizer: the proxy cannot honour it")
    base = check_upstream(upstream)
    rng = np.random.default_rng(seed)

    async def client(app):
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        data = await request.read()
        defended = request.method == "POST" and request.path in DEFENDED
        if defended:
            try:
                data = json.dumps(defend_request(json.loads(data), defence)).encode()
            except (json.JSONDecodeError, AttributeError, TypeError):
                return web.json_response({"error": {"message": "the request body is not a JSON object"}}, status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        try:
            async with request.app["session"].request(request.method, base + request.path_qs, data=data, headers=headers) as up:
                body, status = await up.read(), up.status
                kind = up.headers.get("Content-Type", "application/json")
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"upstream {base} unreachable: {exc}"}}, status=502)
        if defended and status == 200:
            body = json.dumps(defend_reply(json.loads(body), defence, rng)).encode()
            wait = added_delay_s(defence, rng)
            if defence.latency_quantum_ms is not None:
                q = defence.latency_quantum_ms / 1000.0
                elapsed = time.monotonic() - start + wait
                wait += math.ceil(elapsed / q) * q - elapsed
            await asyncio.sleep(wait)
        return web.Response(body=body, status=status, content_type=kind.split(";")[0])

    app = web.Application(client_max_size=64 * 2**20)
    app.cleanup_ctx.append(client)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def serve(upstream: str, port: int, defence: Defence, seed: int) -> None:
    """Run the proxy on 127.0.0.1:``port`` until interrupted."""
    if not 1 <= port <= 65535:
        raise NVError(f"--port must be in 1..65535, got {port}")
    app = make_app(upstream, defence, seed)
    active = {k: v for k, v in defence.as_dict().items() if v is not None}
    print(f"nv defend: http://127.0.0.1:{port} -> {check_upstream(upstream)}, defence {active or 'none'}", flush=True)
    try:
        web.run_app(app, host="127.0.0.1", port=port, print=None)
    except OSError as exc:
        raise NVError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
