"""A llama.cpp server (llama-cpp-python) on 127.0.0.1: the live endpoint of the tests and for users.

``python -m nv.models.llama_server [--model PATH|embedded] [--port P] [--n-ctx N]`` serves one GGUF
(default: the embedded SmolLM2-135M) through llama-cpp-python's OpenAI-compatible app, bound to
127.0.0.1 only, with ``logits_all`` on (llama.cpp returns log-probs only then: the T = 1
pre-sampling values). ``logits_all`` computes the |V| logits of every prompt position, which made
prefill ~3x slower here; ``--no-logprobs`` serves without it (timing runs need no log-probs).
Before the model is built, ``use_extra_bufts`` is switched off: on CPUs with AMX, ggml's
AMX/repack buffers segfault on the first decode (measured on this machine).

``LlamaServer`` binds the port itself and hands the listening socket to that entry as a child process (``--fd``:
nothing else can take the port while the model loads, and a port already in use is an error before the load),
waits until ``/v1/models`` answers and stops it by its PID, also when the wait is interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nv.errors import NVError, run_main

HOST = "127.0.0.1"


def _gguf(spec: str) -> Path:
    """The GGUF file of a packaged model name or a .gguf path (llama.cpp serves nothing else)."""
    from nv.models.loading import gguf_path

    path = gguf_path(spec)
    if path is None:
        raise NVError(f"llama.cpp serves GGUF files: give a .gguf path or a packaged model name, got {spec!r}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LlamaServer:
    """Context manager: a llama.cpp server for ``gguf_path`` ('embedded' or a file) on 127.0.0.1.

    ``base_url`` is the OpenAI base ("http://127.0.0.1:PORT/v1"); ``model_name`` the name it serves
    (the file name without ``.gguf``). ``logprobs=False`` serves without ``logits_all`` (faster
    prefill, no log-probs). A server that fails to come up raises a one-line NVError.
    """

    def __init__(self, gguf_path: str | Path = "embedded", n_ctx: int = 8192, port: int | None = None,
                 n_threads: int | None = None, logprobs: bool = True, startup_timeout: float = 120.0,
                 api_key: str | None = None) -> None:
        self.gguf = _gguf(str(gguf_path))
        self.n_ctx = n_ctx
        self.port, self._any_port = port or free_port(), port is None
        self.n_threads = n_threads
        self.logprobs = logprobs
        self.startup_timeout = startup_timeout
        if api_key is not None and not api_key:
            raise NVError("LlamaServer: an empty api_key would serve with no key at all; give a key or None")
        self.api_key = api_key  # the bearer key every /v1 route then requires (401 without it); passed in the environment
        self.model_name = self.gguf.name.removesuffix(".gguf")
        self.base_url = f"http://{HOST}:{self.port}/v1"
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def _listen(self) -> socket.socket:
        """The server's listening socket on 127.0.0.1, bound here (a port chosen by ``free_port`` and taken since: any
        free one)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            try:
                listener.bind((HOST, self.port))
            except OSError:
                if not self._any_port:
                    raise
                listener.bind((HOST, 0))
        except OSError as exc:
            listener.close()
            raise NVError(f"cannot serve on {HOST}:{self.port}: {exc.strerror}") from None
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self.base_url = f"http://{HOST}:{self.port}/v1"
        return listener

    def start(self) -> LlamaServer:
        listener = self._listen()
        cmd = [sys.executable, "-m", "nv.models.llama_server", "--model", str(self.gguf), "--fd", str(listener.fileno()),
               "--n-ctx", str(self.n_ctx), "--alias", self.model_name]
        if self.n_threads:
            cmd += ["--n-threads", str(self.n_threads)]
        if not self.logprobs:
            cmd += ["--no-logprobs"]
        env = None
        if self.api_key is not None:  # in the child's environment, not its command line, which any local user can read
            cmd += ["--api-key-env", API_KEY_ENV]
            env = os.environ | {API_KEY_ENV: self.api_key}
        fd, log_path = tempfile.mkstemp(prefix="nv-llama-server-", suffix=".log")
        self.log_path = Path(log_path)
        try:
            self.process = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            pass_fds=(listener.fileno(),), env=env)
        finally:
            os.close(fd)
            listener.close()  # the child holds its own copy
        try:
            self._wait()
        except BaseException:  # an error, Ctrl-C or SIGTERM while it loads: no server left behind
            self.stop()
            raise
        return self

    def _wait(self) -> None:
        """Until ``/v1/models`` answers (connections queue on the socket while the model loads)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NVError(f"llama.cpp server exited with status {self.process.returncode}: {self._last_log_line()}")
            try:
                headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
                if httpx.get(f"{self.base_url}/models", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise NVError(f"llama.cpp server did not answer on {self.base_url} within {self.startup_timeout:.0f} s")

    def _last_log_line(self) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "no output"

    def stop(self) -> None:
        """SIGTERM the server's PID, SIGKILL after 10 s; remove its log."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


API_KEY_ENV = "NV_LLAMA_SERVER_API_KEY"  # how LlamaServer hands its child the key


def _without_extra_buffers() -> None:
    """Model params with ``use_extra_bufts = False`` (the AMX segfault workaround)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def patched():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = patched


def serve(model: str, port: int, n_ctx: int, alias: str | None, n_threads: int | None, logprobs: bool = True,
          fd: int | None = None, api_key: str | None = None) -> None:
    """Run the server in this process until it is stopped (127.0.0.1 only): on ``port``, or on the listening socket
    ``fd`` a parent bound (``LlamaServer``); with ``api_key``, every route wants it as a bearer token."""
    try:
        import uvicorn
        from llama_cpp.server.app import create_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError:
        raise NVError("llama-cpp-python[server] is not installed: run `make server`") from None
    _without_extra_buffers()
    path = _gguf(model)
    settings = {"model": str(path), "model_alias": alias or path.name.removesuffix(".gguf"), "n_ctx": n_ctx,
                "logits_all": logprobs, "verbose": False}
    if n_threads:
        settings.update(n_threads=n_threads, n_threads_batch=n_threads)
    server, models = ServerSettings(host=HOST, port=port, api_key=api_key), [ModelSettings(**settings)]
    try:
        app = create_app(server_settings=server, model_settings=models)
    except ValueError as exc:  # llama.cpp's "Failed to load model from file ..." / "Failed to create llama_context"
        raise NVError(f"llama.cpp: {exc} (a file cut short or not a GGUF, an architecture it does not support, "
                      f"or too little memory for n_ctx = {n_ctx})") from None
    if fd is None:
        uvicorn.run(app, host=HOST, port=port, log_level="warning")
    else:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[socket.socket(fileno=fd)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nv.models.llama_server",
                                     description="Serve a GGUF with llama.cpp on 127.0.0.1 (OpenAI-compatible, log-probs on).")
    parser.add_argument("--model", default="embedded", help="a .gguf file, or 'embedded' (SmolLM2-135M-Instruct)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--fd", type=int, default=None, help="serve on this inherited listening socket instead of --port "
                        "(LlamaServer binds the port before the model loads)")
    parser.add_argument("--n-ctx", type=int, default=8192, help="context size in tokens")
    parser.add_argument("--n-threads", type=int, default=None, help="CPU threads (llama.cpp default when omitted)")
    parser.add_argument("--alias", default=None, help="model name the server answers to (default: the file name)")
    parser.add_argument("--no-logprobs", action="store_true", help="logits_all off: faster prefill, no log-probs")
    parser.add_argument("--api-key-env", default=None, metavar="VAR", help="answer only requests whose bearer token is "
                        "this environment variable's value (HTTP 401 otherwise; the key stays off the command line)")
    args = parser.parse_args(argv)

    def key() -> str | None:
        if args.api_key_env is None:
            return None
        if not os.environ.get(args.api_key_env):
            raise NVError(f"--api-key-env {args.api_key_env}: the variable is not set (or empty)")
        return os.environ.pop(args.api_key_env)  # read once, not left in the server's environment

    return run_main(lambda: serve(args.model, args.port, args.n_ctx, args.alias, args.n_threads, not args.no_logprobs,
                                  args.fd, key()))


if __name__ == "__main__":
    sys.exit(main())
