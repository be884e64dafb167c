"""``nv defend`` (nv.oracle.defence_proxy) between a client and a fake upstream, both real aiohttp servers on
127.0.0.1: which routes are defended, what is refused rather than passed on undefended, the request rewriting, the
reply's log-probs in every shape the proxy knows, credentials, timeouts and headers. The fake upstream stands in
for reply shapes the bundled llama.cpp server does not produce (vLLM's prompt_logprobs, a broken reply, a hang);
tests/test_live_endpoint.py puts the proxy in front of the real server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from yarl import URL

from nv.cli import defence_overrides
from nv.errors import NVError
from nv.models.llama_server import free_port
from nv.oracle.defence import Defence
from nv.oracle.defence_proxy import check_upstream, defend_reply, defend_request, make_app

RAW = -1.533190369606018
CHAT = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": RAW, "top_logprobs": [
    {"token": "a", "logprob": RAW}, {"token": "b", "logprob": -2.25}]}]}}]}
TEXT = {"choices": [{"prompt_logprobs": [None, {"17": {"logprob": -3.14159, "rank": 1, "decoded_token": "x"}}],
                     "logprobs": {"tokens": ["a"], "token_logprobs": [RAW], "top_logprobs": [{"a": RAW, "b": -2.25}]}}]}


def upstream_app(seen: list) -> web.Application:
    """Records every request; answers by path: completions and chat replies, a non-JSON or list 200, a 429 with
    Retry-After, a reply after 2 s."""
    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append({"method": request.method, "path": request.path, "headers": dict(request.headers),
                     "json": json.loads(body) if body else None})
        path = request.path
        if path.endswith("/broken/completions"):
            return web.Response(text="<html>oops</html>", content_type="text/html")
        if path.endswith("/list/completions"):
            return web.json_response([1, 2])
        if path.endswith("/crash/completions"):  # llama-cpp-python's 500 for a bad field: a traceback with its paths
            return web.Response(text='{"error": {"message": "Traceback:\\n  File \\"/srv/venv/llama_cpp/server/app.py\\""}}\n',
                                status=500, content_type="application/json", headers={"Server": "uvicorn"})
        if path.endswith("/long/completions"):
            return web.json_response({"error": {"message": "the prompt is too long", "type": "invalid_request_error",
                                                "param": "prompt", "code": "context_length_exceeded", "trace": "/srv"}},
                                     status=400)
        if path.endswith("/busy/completions"):
            return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": "7", "Server-Timing": "q;dur=3"})
        if path.endswith("/slow/completions"):
            await asyncio.sleep(2)
        if path.endswith("/models"):
            return web.json_response({"data": [{"id": "m"}]}, headers={"Server": "uvicorn", "Server-Timing": "q;dur=1"})
        if path.endswith("/stamped/completions"):  # the upstream's clock, in the reply and in its Date header
            return web.json_response(TEXT | {"created": int(time.time())}, headers={"Date": "Mon, 01 Jan 2001 00:00:00 GMT"})
        if path.endswith("/leaky/chat/completions"):  # llama.cpp's prefill time and post-sampling probabilities
            reply = json.loads(json.dumps(CHAT))
            reply["timings"] = {"prompt_ms": 43.2, "prompt_per_token_ms": 0.64}
            reply["choices"][0]["logprobs"]["content"][0] |= {"prob": 0.2158, "top_probs": [{"token": "a", "prob": 0.2158}]}
            return web.json_response(reply, headers={"openai-processing-ms": "43", "Server-Timing": "prefill;dur=43.2",
                                                     "x-ratelimit-remaining-requests": "99", "Server": "uvicorn"})
        return web.json_response(json.loads(json.dumps(CHAT if "chat" in path else TEXT)))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


@contextlib.asynccontextmanager
async def proxied(defence: Defence, seen: list, prefix: str = "", credentials: str = "", timeout_s: float = 30.0,
                  seed: int | None = 0):
    """The fake upstream (recording into ``seen``) and the proxy in front of it, both serving; yields the proxy's port."""
    up_port, proxy_port = free_port(), free_port()
    runners = []
    try:
        for app, port in ((upstream_app(seen), up_port),
                          (make_app(f"http://{credentials}127.0.0.1:{up_port}{prefix}", defence, seed, timeout_s), proxy_port)):
            runner = web.AppRunner(app)
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        yield proxy_port
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def exchange(defence: Defence, requests: list[tuple[str, str, object]], prefix: str = "", credentials: str = "",
             timeout_s: float = 30.0, seed: int | None = 0, elapsed: list | None = None) -> tuple[list, list]:
    """Start the fake upstream and the proxy in front of it, send ``requests`` (method, path, JSON body or raw
    bytes) through the proxy; returns the (status, headers, body) replies and what the upstream saw, and appends
    each request's own round trip in seconds to ``elapsed`` when given."""
    seen: list = []

    async def main():
        replies = []
        async with proxied(defence, seen, prefix, credentials, timeout_s, seed) as proxy_port, aiohttp.ClientSession() as client:
            for method, path, body in requests:
                kwargs = {"data": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
                start = time.monotonic()
                # the path as given, dot segments and escapes kept (a client such as curl --path-as-is sends them)
                async with client.request(method, URL(f"http://127.0.0.1:{proxy_port}{path}", encoded=True), **kwargs) as r:
                    text = await r.text()
                    try:
                        payload = json.loads(text)
                    except json.JSONDecodeError:
                        payload = text
                    replies.append((r.status, dict(r.headers), payload))
                if elapsed is not None:
                    elapsed.append(time.monotonic() - start)
        return replies

    return asyncio.run(main()), seen


def test_every_completion_route_is_defended_and_any_other_post_is_refused():
    """The aliases and the trailing slash that used to pass raw log-probs are defended (the trailing slash reaches the
    upstream without it: no redirect around the proxy); a POST elsewhere is refused; GET passes through."""
    paths = ["/v1/completions", "/v1/completions/", "/v1/engines/copilot-codex/completions"]
    replies, seen = exchange(Defence(round_decimals=1), [("POST", p, {"prompt": "x"}) for p in paths]
                             + [("POST", "/v1/chat/completions", {"messages": []}), ("POST", "/tokenize", {"content": "x"}),
                                ("GET", "/v1/models", None)])
    for status, _, body in replies[:3]:
        lp = body["choices"][0]["logprobs"]
        assert status == 200 and lp["token_logprobs"] == [-1.5] and lp["top_logprobs"] == [{"a": -1.5, "b": -2.2}]
        assert body["choices"][0]["prompt_logprobs"][1]["17"] == {"logprob": -3.1, "rank": 1, "decoded_token": "x"}
    status, _, chat = replies[3]
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert status == 200 and entry["logprob"] == -1.5 and [t["logprob"] for t in entry["top_logprobs"]] == [-1.5, -2.2]
    status, _, refused = replies[4]
    assert status == 403 and "only completion routes" in refused["error"]["message"]
    assert replies[5][0] == 200 and replies[5][2] == {"data": [{"id": "m"}]}
    assert [s["path"] for s in seen] == ["/v1/completions", "/v1/completions", "/v1/engines/copilot-codex/completions",
                                         "/v1/chat/completions", "/v1/models"]  # the refused POST never left the proxy


def test_only_the_model_list_and_health_are_readable():
    """GET passes to the model list and health only: a server's /metrics (vLLM's request_prefill_time_seconds, llama.cpp's
    prompt_seconds_total) read before and after a request gives its own prefill time, around every timing knob; it
    used to pass, as did /slots and /props."""
    readable = ["/v1/models", "/models", "/health", "/v1/models/m"]
    around = ["/v1/models/../../metrics", "/v1/models/%2e%2e/%2e%2e/metrics", "/v1/models/a/b"]  # the upstream resolves dots
    replies, seen = exchange(Defence(latency_quantum_ms=1000),
                             [("GET", p, None) for p in readable + ["/metrics", "/slots", "/props"] + around])
    assert [r[0] for r in replies] == [200] * 4 + [403] * 3 + [400, 400, 403]
    assert "a server's /metrics gives each request's own prefill time" in replies[4][2]["error"]["message"]
    assert [s["path"] for s in seen] == readable
    # escapes decoded twice on the way up: %252E%252E reached /metrics, an escaped '?' POSTed to /slots/0 (a review)
    twice = [("GET", "/models/%252E%252E/metrics", None), ("POST", "/slots/0%3Faction=erase%26x=/completions", {"prompt": "x"}),
             ("POST", "/v1/completions%23/x/completions", {"prompt": "x"})]
    replies, seen = exchange(Defence(latency_quantum_ms=1000, top_k=2), twice)
    assert [r[0] for r in replies] == [400] * 3 and seen == []
    assert "an escaped '%', '?' or '#' is not forwarded" in replies[0][2]["error"]["message"]


def test_what_cannot_be_defended_is_refused_with_a_message():
    cases = [("/v1/completions", {"prompt": "x", "stream": True}, 400, "streamed replies are not defended"),
             ("/v1/completions", ["abc"], 400, "not a JSON object"),
             ("/v1/completions", b"{not json", 400, "not JSON"),
             ("/v1/completions", {"prompt": "x", "temperature": "2"}, 400, "'temperature' must be a number, got '2'"),
             ("/v1/broken/completions", {"prompt": "x"}, 502, "something other than a JSON object"),
             ("/v1/list/completions", {"prompt": "x"}, 502, "something other than a JSON object")]
    replies, seen = exchange(Defence(round_decimals=1), [("POST", path, body) for path, body, _, _ in cases])
    for (status, _, body), (path, _, want, message) in zip(replies, cases):
        assert status == want and message in body["error"]["message"] and body["error"]["message"].startswith("nv defend: "), path
    assert len(seen) == 2  # only the two the upstream had to answer


def test_fields_and_headers_that_would_undo_the_defence_are_refused_or_dropped():
    """A request field the proxy does not control is refused before it reaches the upstream (llama.cpp's mirostat
    and samplers replace its truncation chain, post_sampling_probs returns unrounded probabilities); a defended reply
    loses llama.cpp's timings (the server's own prefill time), the post-sampling probabilities and the timing headers,
    and keeps its log-probs (defended) and rate-limit headers."""
    requests = [("POST", "/v1/chat/completions", {"messages": [], extra: value})
                for extra, value in (("mirostat_mode", 2), ("samplers", ["temperature"]), ("post_sampling_probs", True))]
    replies, seen = exchange(Defence(top_k=5, latency_quantum_ms=200), requests + [
        ("POST", "/v1/leaky/chat/completions", {"messages": [], "logprobs": True, "top_logprobs": 2})])
    for (status, _, body), (_, _, request) in zip(replies[:3], requests):
        (field,) = set(request) - {"messages"}
        assert status == 400 and f"request field(s) '{field}' not passed on" in body["error"]["message"]
    status, headers, reply = replies[3]
    entry = reply["choices"][0]["logprobs"]["content"][0]
    assert status == 200 and "timings" not in reply and set(entry) == {"token", "logprob", "top_logprobs"}
    assert "openai-processing-ms" not in headers and "Server-Timing" not in headers
    assert headers["x-ratelimit-remaining-requests"] == "99" and "uvicorn" not in headers.get("Server", "")
    assert [s["path"] for s in seen] == ["/v1/leaky/chat/completions"] and seen[0]["json"]["top_k"] == 5


def test_request_rewriting_caps_the_temperature_and_keeps_the_stricter_truncation():
    defence = Defence(max_temperature=0.5, top_k=50, top_p=0.9, min_p=0.05)
    assert defend_request({}, defence) == {"temperature": 0.5, "top_k": 50, "top_p": 0.9, "min_p": 0.05}  # absent: 1, capped
    assert defend_request({"temperature": None}, defence)["temperature"] == 0.5
    assert defend_request({"temperature": 0.3}, defence)["temperature"] == 0.3  # under the cap: the client's
    strict = defend_request({"temperature": 2, "top_k": 1, "top_p": 0.5, "min_p": 0.2}, defence)
    assert strict == {"temperature": 0.5, "top_k": 1, "top_p": 0.5, "min_p": 0.2}  # the client's stricter truncation kept
    loose = defend_request({"top_k": 0, "top_p": 1.0, "min_p": 0.0}, defence)  # top_k 0: off (llama.cpp, vLLM -1)
    assert (loose["top_k"], loose["top_p"], loose["min_p"]) == (50, 0.9, 0.05)
    assert defend_request({"top_k": 100}, Defence(top_k=50))["top_k"] == 50
    # a top_k the server reads as off is the provider's: llama.cpp truncates 0.5 to 0, and 0 switches top-k off (it
    # was kept as the "stricter" one); a whole value is sent as an int
    for mine, sent in ((0.5, 2), (0.99, 2), (1.5, 2), (-1, 2), (1, 1), (1.0, 1), (3.0, 2), (float("inf"), 2)):
        assert defend_request({"top_k": mine}, Defence(top_k=2))["top_k"] == sent and type(sent) is int, mine
    assert defend_request({"temperature": 0.8}, Defence()) == {"temperature": 0.8}  # no knob: untouched
    # a NaN passed min/max and reached the server in place of the provider's cut (a review, 2026-12-07)
    nan = defend_request({"top_k": float("nan"), "top_p": float("nan"), "min_p": float("nan")}, defence)
    assert (nan["top_k"], nan["top_p"], nan["min_p"]) == (50, 0.9, 0.05)
    for bad in (True, float("nan")):  # a NaN passed the cap (NaN > cap is false): a tail token every draw (a review)
        with pytest.raises(NVError, match=f"'temperature' must be a number, got {bad}"):
            defend_request({"temperature": bad}, defence)


def test_truncation_closes_the_ways_around_it():
    """With top_k/top_p/min_p on, a client must not draw or read what the truncation hides: a logit bias or a
    penalty (moving a tail token into the kept set), echo, prompt_logprobs and beam search are refused unless
    neutral (the attack's own repeat_penalty 1 passes), and a reply's top list (chat and completions) is cut to the
    tokens the sampler could have drawn, the sampled one always kept; with no truncation they pass as they are."""
    top2 = Defence(top_k=2)
    for field, value in (("logit_bias", {"12869": 100}), ("echo", True), ("prompt_logprobs", 1), ("use_beam_search", True),
                         ("presence_penalty", -2), ("frequency_penalty", 0.5), ("repetition_penalty", 0.5), ("repeat_penalty", 2),
                         ("response_format", {"type": "json_schema", "json_schema": {"schema": {"enum": ["zebra"]}}}),
                         ("tools", [{"type": "function", "function": {"name": "f"}}]), ("ignore_eos", True), ("min_tokens", 1)):
        with pytest.raises(NVError, match=f"'{field}' not passed on while top_k/top_p/min_p is on"):
            defend_request({"prompt": "x", field: value}, top2)
        assert defend_request({"prompt": "x", field: value}, Defence(round_decimals=1))[field] == value
    neutral = {"prompt": "x", "logit_bias": {}, "echo": False, "repeat_penalty": 1.0, "presence_penalty": 0}
    assert defend_request(neutral, top2) == neutral | {"top_k": 2}

    p = [0.5, 0.2, 0.1, 0.05, 0.01]
    chat = {"choices": [{"logprobs": {"content": [{"token": "d", "logprob": float(np.log(0.05)), "top_logprobs": [
        {"token": t, "logprob": float(np.log(q))} for t, q in zip("abcde", p)]}]}}]}
    text = {"choices": [{"logprobs": {"tokens": ["d"], "token_logprobs": [float(np.log(0.05))],
                                      "top_logprobs": [{t: float(np.log(q)) for t, q in zip("abcde", p)}]}}]}

    def listed(reply: dict, defence: Defence) -> list[str]:
        lp = defend_reply(json.loads(json.dumps(reply)), defence, np.random.default_rng(0))["choices"][0]["logprobs"]
        return [t["token"] for t in lp["content"][0]["top_logprobs"]] if "content" in lp else list(lp["top_logprobs"][0])

    for reply in (chat, text):
        assert listed(reply, top2) == ["a", "b", "d"]  # the top two, and the sampled token
        assert listed(reply, Defence(top_p=0.75)) == ["a", "b", "c", "d"]  # mass before c: 0.7 < 0.75
        assert listed(reply, Defence(min_p=0.5)) == ["a", "d"]  # p >= 0.25
        assert listed(reply, Defence(round_decimals=1)) == list("abcde")

    # a missing or NaN value is never kept and does not wipe the list; a sampled token absent from it adds nothing;
    # a token text listed twice (two ids) keeps the sampled id's entry; an entry that is not an object is dropped
    odd = {"choices": [{"logprobs": {"content": [{"token": "z", "id": 9, "logprob": -9.0, "top_logprobs": [
        {"token": "a", "id": 1, "logprob": float(np.log(0.5))}, {"token": "n", "id": 2, "logprob": None}, "junk",
        {"token": "a", "id": 3, "logprob": float(np.log(0.3))}, {"token": "x", "id": 4, "logprob": float("nan")}]}]}}]}
    top = defend_reply(json.loads(json.dumps(odd)), Defence(top_p=0.9), np.random.default_rng(0))
    assert [t["id"] for t in top["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == [1, 3]
    odd["choices"][0]["logprobs"]["content"][0] |= {"token": "a", "id": 3}  # the sampled id 3 is kept past top-k 1
    top = defend_reply(json.loads(json.dumps(odd)), Defence(top_k=1), np.random.default_rng(0))
    assert [t["id"] for t in top["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == [1, 3]
    plain = defend_reply(json.loads(json.dumps(odd)), Defence(round_decimals=1), np.random.default_rng(0))
    assert [t["id"] for t in plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == [1, 3]  # no null entries
    joined = defend_reply({"choices": [{"logprobs": {"tokens": "ab", "token_logprobs": [-0.1, -0.2],
                                                     "top_logprobs": [{"a": -0.1}, {"b": -0.2}]}}]}, Defence(), np.random.default_rng(0))
    assert joined["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1}, {"b": -0.2}]  # tokens as one string: as before


def test_noise_is_one_draw_per_token_and_reply():
    """The sampled token is also in top_logprobs: both carry one noisy value (two independent draws would halve the
    noise's variance for an attacker averaging them); other tokens and the next reply get fresh draws."""
    replies, _ = exchange(Defence(noise_sigma=0.5), [("POST", "/v1/chat/completions", {"messages": []})] * 2
                          + [("POST", "/v1/completions", {"prompt": "x"})])
    values = []
    for _, _, body in replies[:2]:
        entry = body["choices"][0]["logprobs"]["content"][0]
        top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
        assert entry["logprob"] == top["a"] != RAW and top["b"] != -2.25
        values.append(entry["logprob"])
    assert values[0] != values[1]
    lp = replies[2][2]["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] == lp["top_logprobs"][0]["a"] != RAW


def test_noise_is_drawn_per_token_id_and_from_the_os_unless_seeded():
    """Two tokens of one text (byte-fallback tokens render alike) get their own draws, keyed by id (they shared one,
    so their difference came back exact); a served proxy's draws come from the OS's entropy (from params.yaml's seed
    0 an attacker replayed them), a seeded one's are the same every run."""
    same_text = {"choices": [{"logprobs": {"content": [{"token": "", "id": 10, "logprob": -1.0, "top_logprobs": [
        {"token": "", "id": 10, "logprob": -1.0}, {"token": "", "id": 11, "logprob": -1.0}]}]}}]}
    entry = defend_reply(same_text, Defence(noise_sigma=1.0), np.random.default_rng(0))["choices"][0]["logprobs"]["content"][0]
    tops = [t["logprob"] for t in entry["top_logprobs"]]
    assert entry["logprob"] == tops[0] != tops[1]
    first = [exchange(Defence(noise_sigma=0.5), [("POST", "/v1/completions", {"prompt": "x"})], seed=seed)[0][0][2]
             for seed in (None, None, 3, 3)]
    values = [r["choices"][0]["logprobs"]["token_logprobs"][0] for r in first]
    assert values[0] != values[1] and values[2] == values[3]


def test_log_probs_of_a_shape_not_known_are_dropped_not_passed():
    """A choice's logprobs that is not an object, a prompt_logprobs entry that is a bare number, a chat entry's top
    list that is an object, and every other shape not known: dropped (they passed raw, or were a 500)."""
    defence, rng = Defence(round_decimals=1, noise_sigma=0.5), np.random.default_rng(0)
    odd = defend_reply({"choices": [{"logprobs": [{"token": "a", "logprob": -1.23456789}]}]}, defence, rng)
    assert odd["choices"][0]["logprobs"] is None
    odd = defend_reply({"prompt_logprobs": [None, {"17": -3.14159265}, 2.5], "choices": [{"prompt_logprobs": {"17": -3.1}}]},
                       defence, rng)
    assert odd["prompt_logprobs"] == [None, {}, None] and odd["choices"][0]["prompt_logprobs"] is None
    chat = json.loads(json.dumps(CHAT))
    chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"] = {"a": RAW}
    entry = defend_reply(chat, defence, rng)["choices"][0]["logprobs"]["content"][0]
    assert entry["top_logprobs"] is None and entry["logprob"] != RAW
    # chat content that is no list or holds no objects, choices that are no list or no objects, a log-prob that is no
    # number, a token that is no text (each was an AttributeError or TypeError, the proxy's 500; a review)
    content = defend_reply({"choices": [{"logprobs": {"content": {"token": "a", "logprob": RAW}}}]}, defence, rng)
    assert content["choices"][0]["logprobs"]["content"] is None
    content = defend_reply({"choices": [{"logprobs": {"content": [None, ["a", RAW], {"token": "a", "logprob": RAW}]}}]},
                           defence, rng)["choices"][0]["logprobs"]["content"]
    assert len(content) == 1 and content[0]["logprob"] != RAW
    assert defend_reply({"choices": {"0": {}}}, defence, rng)["choices"] is None
    assert defend_reply({"choices": ["a", None]}, defence, rng)["choices"] == [None, None]
    text = defend_reply({"choices": [{"logprobs": {"tokens": 5, "token_logprobs": [RAW, "-1.2", True],
                                                   "top_logprobs": [{"a": RAW}]}}]}, defence, rng)["choices"][0]["logprobs"]
    assert text["token_logprobs"][0] != RAW and text["token_logprobs"][1:] == [None, None] and text["top_logprobs"][0]["a"] != RAW
    odd_id = {"choices": [{"logprobs": {"content": [{"token": "a", "id": {"x": 1}, "logprob": RAW,
                                                     "top_logprobs": [{"token": "a", "id": [1], "logprob": RAW}]}]}}]}
    assert defend_reply(odd_id, defence, rng)["choices"][0]["logprobs"]["content"][0]["logprob"] != RAW


def test_the_quantum_counts_from_the_requests_last_byte():
    """A client holding the body back chose where the quantum fell (the reply came q - u + L after its last byte,
    so bisecting u read L through any q; a review): the reply now comes a whole quantum after the last byte.
    The old placement would answer after 0.8 s + L and 0.4 s + L here. The bounds leave room for a loaded machine's
    late wake-up of the proxy's sleep (0.105 s measured in CI beside the pipeline test), not for a second quantum."""
    quantum, held = 1.0, (0.2, 0.6)

    async def main():
        after = []
        async with proxied(Defence(latency_quantum_ms=quantum * 1000), []) as proxy_port:
            for u in held:
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
                body = json.dumps({"prompt": "x"}).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
                await writer.drain()
                await asyncio.sleep(u)
                writer.write(body)
                await writer.drain()
                last = time.monotonic()
                status = await reader.readline()
                after.append((status, time.monotonic() - last))
                writer.close()
        return after

    for status, seconds in asyncio.run(main()):
        assert b" 200 " in status and quantum - 0.02 < seconds < 2 * quantum - 0.3, seconds


def test_the_upstreams_clock_does_not_pass_the_delays():
    """The upstream's Date header and the reply's ``created``, written before the proxy's delays, passed through: a
    client timing its requests against their second read the undefended latency through any quantum or delay (a
    review, 2026-12-07: 0.3 s behind a 5 s quantum). The reply leaves with the proxy's own Date and second."""
    sent = time.time()
    (status, headers, reply), = exchange(Defence(latency_quantum_ms=2000), [("POST", "/stamped/completions", {"prompt": "x"})])[0]
    assert status == 200 and reply["created"] >= int(sent) + 1  # stamped after the 2 s quantum, not at the upstream
    assert "2001" not in headers["Date"]


def test_every_top_list_is_defended_whatever_sits_beside_it():
    """A completions top list beside a null token_logprobs, or one under a chat reply's logprobs, passed raw; a top
    entry of another shape is dropped, not passed."""
    null = {"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": None, "top_logprobs": [{"a": -0.123456, "zz": -9.87654}]}}]}
    lp = defend_reply(null, Defence(round_decimals=1, top_k=1), np.random.default_rng(0))["choices"][0]["logprobs"]
    assert lp["token_logprobs"] is None and lp["top_logprobs"] == [{"a": -0.1}]
    chat = json.loads(json.dumps(CHAT))
    chat["choices"][0]["logprobs"]["top_logprobs"] = [{"a": -0.123456}, ["odd"]]
    lp = defend_reply(chat, Defence(round_decimals=1), np.random.default_rng(0))["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"a": -0.1}, None] and lp["content"][0]["logprob"] == -1.5


def test_credentials_prefix_timeout_and_headers():
    """Credentials in --upstream reach the upstream as a Basic header and no reply; a path prefix is kept; a hang
    ends in a 504 after the timeout; a 429's Retry-After reaches the client."""
    replies, seen = exchange(Defence(round_decimals=1), [("POST", "/v1/completions", {"prompt": "x"}),
                                                         ("POST", "/v1/busy/completions", {"prompt": "x"}),
                                                         ("POST", "/v1/slow/completions", {"prompt": "x"})],
                             prefix="/openai", credentials="user:s3cret@", timeout_s=0.5)
    token = base64.b64encode(b"user:s3cret").decode()
    assert seen[0]["path"] == "/openai/v1/completions" and seen[0]["headers"]["Authorization"] == f"Basic {token}"
    assert replies[0][0] == 200
    assert replies[1][0] == 429 and replies[1][1]["Retry-After"] == "7"
    assert "Server-Timing" not in replies[1][1]  # an error's headers are a defended reply's too, and its time
    assert replies[2][0] == 504 and "did not answer within 0.5 s" in replies[2][2]["error"]["message"]
    assert all("s3cret" not in json.dumps(r[2]) for r in replies)
    # the upstream's 429 comes back at once; the proxy holds it, as any reply, until the 600 ms quantum
    elapsed: list = []
    busy, _ = exchange(Defence(latency_quantum_ms=600), [("POST", "/v1/busy/completions", {"prompt": "x"}),
                                                          ("POST", "/v1/broken/completions", {"prompt": "x"})], elapsed=elapsed)
    assert busy[0][0] == 429 and elapsed[0] >= 0.6
    assert busy[1][0] == 502 and elapsed[1] >= 0.6  # the proxy's own 502 for a broken reply waited nothing until 2026-12-07
    assert check_upstream("http://u:pw@127.0.0.1:9/openai/") == ("http://127.0.0.1:9/openai", {"Authorization": "Basic dTpwdw=="})
    with pytest.raises(NVError, match="without /v1.*give http://127.0.0.1:9$"):
        check_upstream("http://127.0.0.1:9/v1")
    with pytest.raises(NVError, match="got 'ftp://x'") as info:
        check_upstream("ftp://u:pw@x")
    assert "pw" not in str(info.value)


@contextlib.asynccontextmanager
async def dead_upstream(credentials: str = ""):
    """The proxy in front of a port nothing listens on; yields its base URL."""
    port = free_port()
    runner = web.AppRunner(make_app(f"http://{credentials}127.0.0.1:{free_port()}", Defence(round_decimals=1), 0))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def test_unreachable_upstream_is_a_502_without_credentials():
    async def main():
        async with dead_upstream("user:s3cret@") as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}/completions", json={"prompt": "x"}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(main())
    assert status == 502 and "unreachable" in body["error"]["message"] and "s3cret" not in json.dumps(body)
    assert "127.0.0.1" not in json.dumps(body)  # the upstream's address is the proxy's log's, not the client's


def test_errors_have_a_providers_shape_and_carry_nothing_of_the_upstream(capsys):
    """A review (2026-12-07) found the upstream's traceback (its install paths) in a 500, the upstream's address in
    the proxy's own 502 and 504, its Server header, an error shape without OpenAI's type, param and code, and a 403 or
    400 for a completion route called with another method. Each request is one line of the proxy's log."""
    replies, seen = exchange(Defence(round_decimals=1), [("POST", "/v1/crash/completions", {"prompt": "x"}),
                                                         ("POST", "/v1/long/completions", {"prompt": "x"}),
                                                         ("GET", "/v1/chat/completions", None),
                                                         ("DELETE", "/v1/completions", None),
                                                         ("POST", "/v1/completions", {"prompt": "x", "stream": True}),
                                                         ("POST", "/v1/busy/completions", {"prompt": "x"}),
                                                         ("GET", "/v1/models", None)])
    (crash, long, get, delete, stream, busy, models) = replies
    assert crash[0] == 500 and crash[2] == {"error": {"message": "nv defend: the upstream failed (HTTP 500)",
                                                      "type": "server_error", "param": None, "code": None}}
    assert "uvicorn" not in crash[1].get("Server", "")
    assert long[0] == 400 and long[2] == {"error": {"message": "the prompt is too long", "type": "invalid_request_error",
                                                    "param": "prompt", "code": "context_length_exceeded"}}
    for status, headers, body in (get, delete):
        assert status == 405 and headers["Allow"] == "POST" and "takes POST" in body["error"]["message"]
    assert set(stream[2]["error"]) == {"message", "type", "param", "code"} and stream[2]["error"]["type"] == "invalid_request_error"
    assert busy[2] == {"error": {"message": "slow down", "type": "invalid_request_error", "param": None, "code": None}}
    assert models[0] == 200 and "Server-Timing" not in models[1]
    assert all("Server" not in headers for _, headers, _ in replies)  # neither the upstream's nor aiohttp's own
    assert [s["path"] for s in seen] == ["/v1/crash/completions", "/v1/long/completions", "/v1/busy/completions", "/v1/models"]
    out = capsys.readouterr().out.splitlines()
    log = [line for line in out if line.startswith("nv defend: ")]
    assert len(log) == len(out) == 7 and log[0].startswith("nv defend: 500 POST /v1/crash/completions") and "app.py" in log[0]
    assert log[2].startswith("nv defend: 405 GET /v1/chat/completions") and "streamed replies" in log[4]


def test_a_reported_log_prob_is_a_possible_one_and_a_withheld_one_names_nothing():
    """Behind noise a log-prob came back above 0 (a probability of 2.04) and one under min_logprob came back, the
    threshold having seen the value before the noise; a top list kept a withheld token with a null, naming it and
    its rank (a review, 2026-12-07). Each value is now clipped at 0 and thresholded as reported; a withheld top entry
    is left out, the sampled token's own log-prob null."""
    defence = Defence(noise_sigma=0.5, min_logprob=-2.0)
    rng = np.random.default_rng(1)
    sampled, tops = [], []
    for _ in range(400):
        reply = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": -1.95, "top_logprobs": [
            {"token": "a", "logprob": -1.95}, {"token": "b", "logprob": -0.05}, {"token": "c", "logprob": -6.0}]}]}}]}
        entry = defend_reply(reply, defence, rng)["choices"][0]["logprobs"]["content"][0]
        sampled.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry["top_logprobs"]})
    shown = [v for v in sampled if v is not None]
    assert 100 < len(shown) < 300 and min(shown) >= -2.0  # -1.95 + N(0, 0.25) falls below -2 in 46 % of replies
    assert all(v is not None for top in tops for v in top.values()) and not any("c" in top for top in tops)
    assert max(top["b"] for top in tops) == 0.0 and all(("a" in top) == (s is not None) for top, s in zip(tops, sampled))


def test_the_attacks_free_check_names_a_failing_upstream():
    """The attack's model-list check through the proxy, its upstream down: the server's own 502 message, not the hint
    of a wrong base URL it gave every non-JSON reply before (a review, 2026-12-07)."""
    from nv.oracle.http import HTTPOracle

    async def main():
        async with dead_upstream() as url:
            with HTTPOracle(url, "m") as oracle:
                await asyncio.to_thread(oracle.preflight)

    with pytest.raises(NVError, match=r"/v1/models failed: HTTP 502 nv defend: the upstream is unreachable") as err:
        asyncio.run(main())
    assert "ending in /v1" not in str(err.value) and "\n" not in str(err.value)


def test_defence_values_on_the_command_line():
    section = {k: None for k in Defence().as_dict()}
    got = defence_overrides(section, ["min_p=1e-5", "noise_sigma=3e-2", "latency_quantum_ms=1e3", "round_format=bf16",
                                      "top_k=5", "top_p=null"])
    assert (got["min_p"], got["noise_sigma"], got["latency_quantum_ms"]) == (1e-5, 0.03, 1000.0)
    assert (got["round_format"], got["top_k"], got["top_p"]) == ("bf16", 5, None) and isinstance(got["top_k"], int)
    with pytest.raises(NVError, match="--defence round_decimals= needs a value"):
        defence_overrides(section, ["round_decimals="])
    assert Defence(**got).min_p == pytest.approx(1e-5) and np.isfinite(got["noise_sigma"])
