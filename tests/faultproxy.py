"""A fault-injecting HTTP/1.1 proxy in front of a real OpenAI-compatible server (tests only).

Runs an asyncio server on 127.0.0.1 in a background thread and forwards every request upstream.
The POSTs (the paid calls) are numbered 0, 1, ... in arrival order; for the numbers listed in
``faults`` it injects one fault instead of (or on top of) forwarding:

- ``"429"``: answers 429 with ``Retry-After: <retry_after>`` (default "0"), not forwarded;
- ``"500"``: answers 500 (``Retry-After: 0``), not forwarded;
- ``"400"``: answers 400 Bad Request with an error message, not forwarded (a client error: never retried);
- ``"501"``: answers 501 with an HTML error page, as ``python -m http.server`` does to a POST (final: never retried);
- ``"timeout"``: never answers; the connection is dropped after ``hold`` seconds (past the client's timeout);
- ``"truncate"``: forwarded (so paid), then answered 200 with the first half of the JSON body;
- ``"reset"``: the connection is dropped with a TCP reset, not forwarded;
- ``"301"``: answers 301 Moved Permanently to another host, not forwarded (redirects are final: never followed);
- ``"gzip"``: forwarded (so paid), then answered 200 with ``Content-Encoding: gzip`` on a body that is not gzip;
- ``"nousage"``: forwarded (so paid), then answered 200 with ``usage.prompt_tokens`` null;
- ``"withhold"``: forwarded (so paid), then answered 200 with each sampled token's log-prob null (a provider's floor).

``mode="html"`` answers every request with an HTML page, ``mode="401post"`` every POST with 401 (a server whose model
list is open, as llama.cpp's own server with --api-key; the bundled one refuses every route, ``LlamaServer(api_key=)``), ``mode="301"`` every request with a
redirect to another host; ``mode="strip"`` removes ``logprobs`` from
every forwarded reply (a server without log-prob support); ``mode="n"`` gives the llama.cpp server the
``n`` it ignores: a POST asking for n > 1 choices becomes n upstream requests (seeds seed * 1000 + i)
merged into one reply of n choices, prompt tokens counted once (as vLLM bills one prefill). ``posts`` counts POSTs received and
``forwarded`` lists, in order, the JSON bodies of the POSTs the upstream server answered with 200 (paid);
``post_log`` lists (arrival time.monotonic(), path, fault or None) of every POST received; ``authorizations`` the
Authorization header of every request (None without one); ``in_flight`` counts requests being answered.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time

import httpx

FAULTS = ("400", "429", "500", "501", "timeout", "truncate", "reset", "301", "gzip", "nousage", "withhold")
REASONS = {200: "OK", 301: "Moved Permanently", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           501: "Not Implemented"}


class FaultProxy:
    def __init__(self, upstream: str, faults: dict[int, str] | None = None, mode: str | None = None, hold: float = 6.0,
                 retry_after: str = "0"):
        """``upstream``: the server's base URL ("http://127.0.0.1:PORT/v1"); paths are forwarded as they come;
        ``retry_after``: the Retry-After header value of an injected 429 (seconds)."""
        self.upstream = upstream.split("/v1")[0]
        self.faults = dict(faults or {})
        assert set(self.faults.values()) <= set(FAULTS), self.faults
        self.mode = mode
        self.hold = hold
        self.retry_after = retry_after
        self.posts = 0
        self.post_log: list[tuple[float, str, str | None]] = []
        self.forwarded: list[dict] = []
        self.authorizations: list[str | None] = []
        self.in_flight = 0
        self._handlers: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._client: httpx.AsyncClient | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_idle(self, timeout: float = 60) -> None:
        """Until no request is in flight (a killed client's requests still reach the server)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.in_flight, "proxy still busy"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _start(self) -> None:
        self._client = httpx.AsyncClient(timeout=120)
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        self._server.close()
        for task in self._handlers:  # a held request's handler ends here, not pending at the loop's close
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._client.aclose()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(task := asyncio.current_task())
        task.add_done_callback(self._handlers.discard)
        try:
            while True:  # keep-alive: one request after another on this connection
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head.decode().split("\r\n")[1:]
                                                     if ": " in line)}
                length = int(headers.get("content-length", 0))
                self.authorizations.append(headers.get("authorization"))
                body = await reader.readexactly(length) if length else b""
                self.in_flight += 1
                try:
                    if not await self._answer(method, path, body, writer):
                        return
                finally:
                    self.in_flight -= 1
        finally:
            if not writer.is_closing():
                writer.close()

    async def _answer(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is gone."""
        if self.mode == "html":
            return await self._send(writer, 200, b"<html><body>It works!</body></html>", "text/html")
        if self.mode == "401post" and method == "POST":
            return await self._send(writer, 401, b'{"error": {"message": "unauthorized"}}')
        if self.mode == "301":
            return await self._send(writer, 301, b"", extra=f"Location: https://example.invalid{path}\r\n")
        fault = None
        if method == "POST":
            fault = self.faults.get(self.posts)
            self.posts += 1
            self.post_log.append((time.monotonic(), path, fault))
        if fault in ("429", "500"):
            wait = self.retry_after if fault == "429" else "0"
            return await self._send(writer, int(fault), b'{"error": {"message": "injected"}}', extra=f"Retry-After: {wait}\r\n")
        if fault == "400":
            return await self._send(writer, 400, b'{"error": {"message": "injected: bad request"}}')
        if fault == "501":  # python -m http.server's answer to a POST
            return await self._send(writer, 501, b"<!DOCTYPE HTML>\n<html><head><title>Error response</title></head>"
                                    b"<body><h1>Error response</h1><p>Error code: 501</p><p>Message: Unsupported method "
                                    b"(&#x27;POST&#x27;).</p></body></html>\n", "text/html;charset=utf-8")
        if fault == "301":
            return await self._send(writer, 301, b"", extra=f"Location: https://example.invalid{path}\r\n")
        if fault == "timeout":
            await asyncio.sleep(self.hold)
            writer.close()
            return False
        if fault == "reset":
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if self.mode == "n" and method == "POST" and json.loads(body).get("n", 1) > 1:
            return await self._send(writer, 200, await self._expand_n(path, json.loads(body)))
        r = await self._client.request(method, self.upstream + path, content=body,
                                       headers={"content-type": "application/json"} if body else None)
        data = r.content
        if method == "POST" and r.status_code == 200:
            self.forwarded.append(json.loads(body))
            if self.mode == "strip":
                reply = r.json()
                for choice in reply.get("choices", []):
                    choice.pop("logprobs", None)
                data = json.dumps(reply).encode()
        if fault == "truncate":
            data = data[: len(data) // 2]
        if fault in ("nousage", "withhold"):
            reply = json.loads(data)
            if fault == "nousage":
                reply["usage"]["prompt_tokens"] = None
            for choice in reply["choices"] if fault == "withhold" else []:
                for entry in choice["logprobs"]["content"]:
                    entry["logprob"] = None
            data = json.dumps(reply).encode()
        extra = "Content-Encoding: gzip\r\n" if fault == "gzip" else ""
        return await self._send(writer, r.status_code, data, r.headers.get("content-type", "application/json"), extra)

    async def _expand_n(self, path: str, body: dict) -> bytes:
        self.forwarded.append(body)
        replies = []
        for i in range(body["n"]):
            one = {**body, "seed": body.get("seed", 0) * 1000 + i}
            del one["n"]
            replies.append((await self._client.post(self.upstream + path, json=one)).json())
        merged = replies[0]
        merged["choices"] = [{**r["choices"][0], "index": i} for i, r in enumerate(replies)]
        merged["usage"]["completion_tokens"] = sum(r["usage"]["completion_tokens"] for r in replies)
        return json.dumps(merged).encode()

    @staticmethod
    async def _send(writer, status: int, data: bytes, content_type: str = "application/json", extra: str = "") -> bool:
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(data)}\r\n{extra}\r\n")
        try:
            writer.write(head.encode() + data)
            await writer.drain()
        except ConnectionError:
            return False
        return True
