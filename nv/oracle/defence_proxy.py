"""``nv defend``: the defence layer as an OpenAI-compatible reverse proxy on 127.0.0.1, in front of any server
(vLLM, llama.cpp, a provider), for providers who want to try a setting and for tests that attack a defended server.

Requests go to ``--upstream`` + the client's path. A POST to a completion route (a path ending in ``/completions``:
``/v1/completions``, ``/v1/chat/completions`` and their aliases) is defended with the same knobs and the same pure
functions as ``DefendedOracle`` (``nv.oracle.defence``):

- request side: ``max_temperature`` caps the request's temperature (an absent one is OpenAI's default, 1);
  ``top_k``/``top_p``/``min_p`` are set on it, or kept where the client asked for stricter truncation, and with
  them on the ``UNTRUNCATING`` fields (a logit bias, penalties, a grammar or schema, echo, prompt log-probs, beam
  search) are refused unless neutral: they would draw or read the tokens the truncation hides;
- reply side: with truncation on, a top list keeps only the tokens it could have drawn (``listed_survivors``);
  each returned log-prob (the sampled token's, ``top_logprobs``, vLLM's ``prompt_logprobs``) gets
  N(0, sigma^2) noise, one draw per (choice, position, token) and reply, so a token listed twice carries one value,
  clipped at 0; then ``round_format`` and ``round_decimals`` (``report_calls``, as ``DefendedOracle``); one whose
  value then lies below ``min_logprob`` is returned as null (the sampled token's) or left out (an entry of a top
  list or of ``prompt_logprobs``);
- timing: the reply waits out ``delay_uniform_ms`` / ``delay_exp_ms`` and then until the elapsed time is a
  multiple of ``latency_quantum_ms``.

What the proxy cannot defend it refuses instead of passing on: a streamed request (400), a request field outside
``REQUEST_FIELDS`` (400: llama.cpp's ``mirostat_*`` and ``samplers`` replace the truncation chain, ``dynatemp_*`` the
temperature, ``post_sampling_probs``/``n_probs`` return probabilities instead of log-probs), a POST to any other route
(403: it might return log-probs in a shape the proxy does not know), another method on a completion route (405), an
upstream reply to a completion that is not a JSON object (502). Its errors have OpenAI's shape (``message``, ``type``,
``param``, ``code``) and do not name the upstream; the proxy prints one line per request (status, time, and why it
refused or what the upstream answered). A defended reply keeps only the fields it knows (``REPLY_FIELDS``: llama.cpp's
``timings``, the server's own prefill time, would undo every timing knob) and only the headers in ``REPLY_HEADERS`` (a
provider's ``openai-processing-ms`` likewise, and the upstream's ``Date``); its ``created`` is the second it leaves
the proxy, after the delays. ``pad_to_tokens`` needs the served model's tokenizer, which a proxy does not have:
refused, as for the HTTP oracle. An upstream's error reply to a completion keeps the same headers and waits the same
delays, as does the proxy's 502 for a reply that is not a JSON object; a client error keeps its OpenAI fields (its
message says what to mend), a server error only its status (its body may hold a traceback with the upstream's paths).
GET requests to ``READABLE`` (the model list, health) pass through with the same headers kept (no reply carries a
``Server`` header, the upstream's or aiohttp's: each names a software stack); other routes are refused (403: a
server's ``/metrics`` counts prefill seconds, each request's own prefill time). Noise and delays come from the OS's
entropy (``nv defend --seed`` for a reproducible run).
Credentials in ``--upstream`` (``http://user:password@host``) go into the upstream requests' header only, never into
output.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from urllib.parse import unquote, urlsplit

import aiohttp
import numpy as np
from aiohttp import web
from multidict import CIMultiDict

from nv.errors import NVError
from nv.oracle.defence import REQUEST_FIELDS, Defence, check_untruncating, http_truncation_fields, listed_survivors, report_calls
from nv.oracle.http import split_credentials

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
# what a defended reply keeps (by level); every log-prob field among them is defended by defend_reply
REPLY_FIELDS = {
    "reply": {"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier", "prompt_logprobs"},
    "choice": {"index", "message", "text", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs"},
    "logprobs": {"content", "refusal", "tokens", "token_logprobs", "top_logprobs", "text_offset"},
    "entry": {"id", "token", "logprob", "bytes", "top_logprobs"},  # chat: content[i] and its top_logprobs[j]
}
# headers a defended reply keeps: these, and the rate-limit family (x-ratelimit-*); not Server-Timing or a provider's
# processing time (openai-processing-ms), which carry the upstream's own timing, nor its Date, written before the
# delays (the proxy's own is the time the reply leaves)
REPLY_HEADERS = {"content-type", "x-request-id", "retry-after"}  # not Server: it names the upstream's stack
PASSED = ("GET", "HEAD", "OPTIONS")
SESSION = web.AppKey("session", aiohttp.ClientSession)
NOTE = web.ResponseKey("nv_note", str)  # a reply's line in the proxy's log
# the stricter of the client's truncation and the provider's: fewer tokens, less mass, a higher floor (a top_k the
# server reads as off, 0 or -1, or not whole: llama.cpp truncates 0.5 to 0, which switches top-k off, is the provider's)
STRICTER = {"top_k": lambda mine, theirs: int(min(mine, theirs)) if math.isfinite(mine) and mine >= 1 and mine == int(mine)
            else theirs,
            "top_p": min, "min_p": max}
# the GET routes forwarded: the model list and health; not /metrics (vLLM's and llama.cpp's prefill-time counters
# give each request's own prefill time, around every timing knob), /slots or /props
READABLE = ("/models", "/v1/models", "/health", "/v1/health")


def check_upstream(url: str) -> tuple[str, dict]:
    """(the upstream root the client's paths are appended to, credentials removed; the header that carries them),
    or a one-line error."""
    public, auth = split_credentials(url)
    try:
        u = urlsplit(public)
        ok = u.scheme in ("http", "https") and u.hostname and u.port != 0  # .port checks the range
    except ValueError:  # e.g. an unclosed IPv6 bracket
        ok = False
    if not ok:
        raise NVError(f"--upstream must be an http(s) URL such as http://127.0.0.1:8080, got {public!r}")
    root = f"{u.scheme}://{u.netloc}{u.path.rstrip('/')}"
    if root.endswith("/v1"):
        raise NVError(f"--upstream is the server's root, without /v1 (the proxy appends the client's /v1/... path): "
                      f"give {root.removesuffix('/v1')}")
    return root, auth


def defend_request(body: dict, defence: Defence) -> dict:
    """The request as the provider serves it: the temperature capped (an absent one taken as OpenAI's default 1),
    the truncation fields set, or the client's kept where stricter; a field outside ``REQUEST_FIELDS`` is refused."""
    unknown = sorted(set(body) - REQUEST_FIELDS)
    if unknown:
        raise NVError(f"request field(s) {', '.join(map(repr, unknown))} not passed on: they could undo the defence "
                      "(a sampler chain, a temperature or a probability format the proxy does not control)")
    check_untruncating(body, defence)
    body = dict(body)
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t)):  # NaN passed the cap
        raise NVError(f"'temperature' must be a number, got {t!r}")
    if defence.max_temperature is not None and (1.0 if t is None else t) > defence.max_temperature:
        body["temperature"] = defence.max_temperature
    for key, value in http_truncation_fields(defence).items():
        mine = body.get(key)
        number = isinstance(mine, (int, float)) and not isinstance(mine, bool) and not math.isnan(mine)  # min/max keep a NaN
        body[key] = STRICTER[key](mine, value) if number else value
    return body


def _known(obj, level: str):
    """``obj`` with only the ``REPLY_FIELDS[level]`` keys (anything else as it is)."""
    return {k: v for k, v in obj.items() if k in REPLY_FIELDS[level]} if isinstance(obj, dict) else obj


def _drawable(tops: list[tuple], sampled, defence: Defence) -> list[tuple]:
    """The (token, log-prob) pairs of a top list the truncation could have drawn (``listed_survivors``; the sampled
    token's own always), or all of them when nothing truncates."""
    if not defence.truncates:
        return tops
    y = [v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else -math.inf for _, v in tops]
    return [top for top, kept in zip(tops, listed_survivors(y, defence)) if kept or top[0] == sampled]


def _listed(top: dict) -> dict:
    """A completions top list without its withheld entries: a token listed with a null log-prob would still name it
    and its rank."""
    return {t: y for t, y in top.items() if y is not None}


def defend_reply(reply: dict, defence: Defence, rng: np.random.Generator) -> dict:
    """A chat or completions reply as the defended API returns it: only its known fields, every log-prob defended, a
    top list cut to the tokens the truncation could have drawn."""
    reply = _known(reply, "reply")
    noise: dict[str, float] = {}

    def value(y, key: tuple):
        """``report_calls``: noise (one draw per key and reply), clipped at 0, rounded; None where withheld."""
        if not isinstance(y, (int, float)) or isinstance(y, bool):
            return None  # missing, or a shape not known ("-1.2", true): dropped, not passed on undefended
        draw = noise.setdefault(repr(key), defence.noise_sigma * rng.standard_normal()) if defence.noise_sigma else None
        v = float(report_calls(np.array([y], dtype=np.float64), defence, None if draw is None else np.array([draw]))[0])
        return None if math.isnan(v) else v

    def prompt_logprobs(obj: dict, where: tuple) -> None:  # vLLM: [None | {token_id: {logprob, rank, decoded_token}}]
        positions = obj.get("prompt_logprobs")
        if positions is not None and not isinstance(positions, list):
            obj["prompt_logprobs"] = None  # a shape not known: dropped, not passed on undefended
        for i, top in enumerate(positions if isinstance(positions, list) else []):
            if not isinstance(top, dict):
                positions[i] = None
                continue
            for entry_token, entry in top.items():
                if isinstance(entry, dict):
                    entry["logprob"] = value(entry.get("logprob"), (*where, i, entry_token))
            # a withheld or malformed entry is left out, as in a top list: a null would still name the token and rank
            positions[i] = {t: e for t, e in top.items() if isinstance(e, dict) and e["logprob"] is not None}

    prompt_logprobs(reply, ("prompt",))
    if "choices" in reply and not isinstance(reply["choices"], list):
        reply["choices"] = None  # a shape not known: dropped
    choices = reply.get("choices") or []
    for c, choice in enumerate(choices):
        choice = choices[c] = _known(choice, "choice")
        if not isinstance(choice, dict):
            choices[c] = None
            continue
        prompt_logprobs(choice, ("prompt", c))
        if not isinstance(choice.get("logprobs"), dict):
            if "logprobs" in choice:
                choice["logprobs"] = None  # a shape not known: dropped, not passed on undefended
            continue
        lp = choice["logprobs"] = _known(choice["logprobs"], "logprobs")
        for part in ("content", "refusal"):  # chat: [{token, logprob, top_logprobs: [{token, logprob}]}]
            if part in lp and not isinstance(lp[part], list):
                lp[part] = None  # a shape not known: dropped
            if isinstance(lp.get(part), list):
                lp[part] = [_known(entry, "entry") for entry in lp[part] if isinstance(entry, dict)]
            for i, entry in enumerate(lp.get(part) or []):
                entry["logprob"] = value(entry.get("logprob"), (c, part, i, entry.get("id", entry.get("token"))))
                if "top_logprobs" in entry and not isinstance(entry["top_logprobs"], list):
                    entry["top_logprobs"] = None  # a shape not known
                if isinstance(entry.get("top_logprobs"), list):
                    tops = [_known(top, "entry") for top in entry["top_logprobs"] if isinstance(top, dict)]
                    same = "id" if "id" in entry else "token"  # a token's text may be shared; its id is not
                    own = next((j for j, top in enumerate(tops) if top.get(same) == entry.get(same)), None)
                    entry["top_logprobs"] = [tops[j] for j, _ in _drawable([(j, top.get("logprob")) for j, top in enumerate(tops)],
                                                                           own, defence)]
                for top in entry.get("top_logprobs") or []:  # a token's text may be shared (byte tokens); its id is not
                    top["logprob"] = value(top.get("logprob"), (c, part, i, top.get("id", top.get("token"))))
                if isinstance(entry.get("top_logprobs"), list):  # a withheld entry is left out: a null names the token
                    entry["top_logprobs"] = [top for top in entry["top_logprobs"] if top["logprob"] is not None]
        # completions: tokens, token_logprobs, top_logprobs [{token: logprob}]; a top list is defended whatever sits
        # beside it (with token_logprobs null, or under a chat reply), and one of another shape is dropped
        sampled = list(lp["tokens"]) if isinstance(lp.get("tokens"), (list, str)) else []
        if "token_logprobs" in lp:
            ys = lp["token_logprobs"] if isinstance(lp["token_logprobs"], list) else None
            names = sampled + [None] * len(ys or [])
            lp["token_logprobs"] = None if ys is None else [value(y, (c, "text", i, names[i])) for i, y in enumerate(ys)]
        if "top_logprobs" in lp:
            tops = lp["top_logprobs"] if isinstance(lp["top_logprobs"], list) else []
            sampled += [None] * len(tops)
            lp["top_logprobs"] = [_listed({t: value(y, (c, "text", i, t)) for t, y in _drawable(list(top.items()), sampled[i], defence)})
                                  if isinstance(top, dict) else None for i, top in enumerate(tops)] or None
    return reply


def added_delay_s(defence: Defence, rng: np.random.Generator) -> float:
    """The random delay a reply waits (seconds)."""
    ms = 0.0
    if defence.delay_uniform_ms is not None:
        ms += rng.uniform(0.0, defence.delay_uniform_ms)
    if defence.delay_exp_ms is not None:
        ms += rng.exponential(defence.delay_exp_ms)
    return ms / 1000.0


def _error(status: int, message: str, log: str = "", headers: dict | None = None) -> web.Response:
    """An OpenAI-shaped error reply; ``log`` (the proxy's own log line, not sent) may name what the client must not
    learn, such as the upstream's address."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    response = web.json_response({"error": {"message": f"nv defend: {message}", "type": kind, "param": None, "code": None}},
                                 status=status, headers=headers)
    response[NOTE] = log or message
    return response


def _upstream_error(body: bytes, status: int) -> bytes:
    """An upstream's error reply to a completion as the client gets it: a client error's OpenAI fields (its message
    tells the client what to mend), a server error's status alone (its body may carry a traceback with the upstream's
    paths)."""
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        error = None
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status >= 500 or not isinstance(error, (dict, str)):
        error = {"message": f"nv defend: the upstream failed (HTTP {status})"}
    elif isinstance(error, str):
        error = {"message": error}
    return json.dumps({"error": {"message": error.get("message"), "type": error.get("type") or kind,
                                 "param": error.get("param"), "code": error.get("code")}}).encode()


def make_app(upstream: str, defence: Defence, seed: int | None, timeout_s: float = 600.0) -> web.Application:
    """The aiohttp application of the proxy (``serve`` runs it; the tests run it beside a fake upstream). Its noise and
    delays are drawn from ``seed``, or from the OS's entropy with None (a served defence: an attacker who knows the
    seed, params.yaml's 0, replays the draws and subtracts them)."""
    if defence.pad_to_tokens is not None:
        raise NVError("pad_to_tokens needs the served model's tokenizer: the proxy cannot honour it")
    base, auth = check_upstream(upstream)
    rng = np.random.default_rng(seed)

    async def client(app):
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        start = time.monotonic()  # after the body: a client holding it back would otherwise pick where the quantum falls
        defended = request.method not in PASSED
        segments = unquote(request.raw_path.split("?")[0]).split("/")
        if "." in segments or ".." in segments:  # the upstream would resolve them: /v1/models/../../metrics is /metrics
            return _error(400, f"a path with '.' or '..' segments is not forwarded: {request.path}")
        if any(c in request.path for c in "%?#"):  # decoded again on the way up: %252E%252E is '..', %3F a query
            return _error(400, f"a path with an escaped '%', '?' or '#' is not forwarded: {request.raw_path}")
        model = request.path.startswith(("/v1/models/", "/models/")) and request.path.rstrip("/").count("/") <= 3
        completion = request.path.rstrip("/").endswith("/completions")
        if completion and request.method != "POST":
            return _error(405, f"{request.path} takes POST, not {request.method}", headers={"Allow": "POST"})
        if not defended and request.path.rstrip("/") not in READABLE and not model:
            return _error(403, f"only {', '.join(READABLE)} are readable through the proxy, not {request.method} "
                               f"{request.path}: a server's /metrics gives each request's own prefill time")
        if defended:
            if not completion:
                return _error(403, f"only completion routes (POST .../completions) are forwarded, not {request.method} "
                                   f"{request.path}: another route could return log-probs undefended")
            try:
                body = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return _error(400, "the request body is not JSON")
            if not isinstance(body, dict):
                return _error(400, "the request body is not a JSON object")
            if body.get("stream"):
                return _error(400, "streamed replies are not defended: send \"stream\": false")
            try:
                data = json.dumps(defend_request(body, defence)).encode()
            except NVError as exc:
                return _error(400, str(exc))
        dropped = HOP | ({"authorization"} if auth else set())  # credentials from --upstream replace the client's
        headers = {k: v for k, v in request.headers.items() if k.lower() not in dropped}
        try:
            path = request.path.rstrip("/") if defended else request.path  # no redirect for a trailing slash
            url = base + path + (f"?{request.query_string}" if request.query_string else "")
            async with request.app[SESSION].request(request.method, url, data=data, headers=headers | auth) as up:
                body, status = await up.read(), up.status
                passed = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in HOP)
        except asyncio.TimeoutError:
            return _error(504, f"the upstream did not answer within {timeout_s:g} s",
                          f"upstream {base} did not answer within {timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return _error(502, "the upstream is unreachable", f"upstream {base} unreachable: {exc or type(exc).__name__}")
        # every reply keeps only REPLY_HEADERS: the upstream's Server names its stack, Server-Timing its own timing
        passed = CIMultiDict((k, v) for k, v in passed.items()
                             if k.lower() in REPLY_HEADERS or k.lower().startswith("x-ratelimit-"))
        ok = 200 <= status < 300
        if not defended:
            return web.Response(body=body, status=status, headers=passed)
        # a defended route's every reply, an error's too, waits the delays: its time may carry the upstream's
        reply = None
        if ok:
            try:
                reply = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass
            if isinstance(reply, dict):
                reply = defend_reply(reply, defence, rng)
        wait = added_delay_s(defence, rng)
        if defence.latency_quantum_ms is not None:
            q = defence.latency_quantum_ms / 1000.0
            elapsed = time.monotonic() - start + wait
            wait += math.ceil(elapsed / q) * q - elapsed
        await asyncio.sleep(wait)
        if ok and not isinstance(reply, dict):
            return _error(502, f"the upstream answered {request.path} with something other than a JSON object: "
                               "not passed on undefended")
        passed["Content-Type"] = "application/json"
        if not ok:
            response = web.Response(body=_upstream_error(body, status), status=status, headers=passed)
            response[NOTE] = f"the upstream's HTTP {status}: {body[:300].decode(errors='replace')!r}"  # one line
            return response
        if "created" in reply:  # stamped when it leaves: the upstream's second, read against the client's own clock,
            reply["created"] = int(time.time())  # dated its reply before every delay (a review, 2026-12-07)
        return web.Response(body=json.dumps(reply).encode(), status=status, headers=passed)

    async def logged(request: web.Request) -> web.StreamResponse:
        """``forward``, and one line of the proxy's log per request: its status, time and, for a refusal, why."""
        start = time.monotonic()
        response = await forward(request)
        note = response.get(NOTE)
        print(f"nv defend: {response.status} {request.method} {request.path} {1000 * (time.monotonic() - start):.0f} ms"
              + (f": {note}" if note else ""), flush=True)
        return response

    async def anonymous(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.popall("Server", None)  # aiohttp's own "Python/3.x aiohttp/3.x" names the proxy

    app = web.Application(client_max_size=64 * 2**20)
    app.on_response_prepare.append(anonymous)
    app.cleanup_ctx.append(client)
    app.router.add_route("*", "/{tail:.*}", logged)
    return app


def serve(upstream: str, port: int, defence: Defence, seed: int | None, timeout_s: float = 600.0) -> None:
    """Run the proxy on 127.0.0.1:``port`` until interrupted."""
    if not 1 <= port <= 65535:
        raise NVError(f"--port must be in 1..65535, got {port}")
    app = make_app(upstream, defence, seed, timeout_s)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's own sites: a port in TIME_WAIT is free
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise NVError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    active = {k: v for k, v in defence.as_dict().items() if v is not None}
    what = active or "none: it passes every reply on undefended (switch one on with --defence KEY=VALUE or params.yaml's defence)"
    print(f"nv defend: http://127.0.0.1:{port} -> {check_upstream(upstream)[0]}, defence {what}", flush=True)
    web.run_app(app, sock=sock, print=None)
