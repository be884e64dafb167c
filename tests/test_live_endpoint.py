"""The live endpoint (issue 6) against a real llama.cpp server on 127.0.0.1 serving the embedded GGUF:
the HTTP oracle agrees with the simulator, `nv attack --base-url` runs end to end, faults and a
kill -9 change nothing in the result, nothing completed is paid twice, bad input costs nothing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from faultproxy import FaultProxy
from nv.cli import main
from nv.errors import NVError
from nv.oracle import journal as journal_module
from nv.oracle.journal import Journal, request_key
from nv.live import UNBOUND, binding
from nv.models.llama_server import LlamaServer, free_port
from nv.oracle.http import Budget, HTTPOracle, Limits, parse_reply, split_credentials

NV = [sys.executable, "-m", "nv.cli", "attack"]
ROOT = Path(__file__).resolve().parent.parent
TINY_LIVE = {"search": {"D": 4, "rounds": 1, "batch_size": 4}, "sampling": {"N": 8, "chunk": 2},
             "live": {"concurrency": 2, "timeout": 30, "backoff": 0.05, "retries": 6}}
REQUESTS = 2 + 4 + 4 * 8  # probe + search + D x N, one sample per request (llama.cpp ignores n)


@pytest.fixture(scope="module")
def server():
    with LlamaServer("embedded", n_ctx=512, n_threads=1) as s:  # one core per `make test` worker
        yield s


def write_params(root: Path, dest: Path, name: str = "params.yaml", **live) -> Path:
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in TINY_LIVE.items():
        params[section].update(values)
    params["live"].update(live)
    path = dest / name
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    return path


def attack_args(url: str, model: str, params: Path, out: Path, *extra: str) -> list[str]:
    return ["--base-url", url, "--model", model, "--params", str(params), "--out", str(out), "--quiet", *extra]


def run_attack(args: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
    """``nv attack``; the timeout only guards against a hang (the phase-2 attack ran past 400 s on a degraded machine
    beside another test run)."""
    return subprocess.run(NV + args, capture_output=True, text=True, timeout=timeout)


def result(report: dict) -> dict:
    """The attack's result: everything but the proxy's URL and this process's traffic counters."""
    return {k: v for k, v in report.items() if k not in ("endpoint", "http")}


def journal_keys(path: Path) -> list[str]:
    keys = []
    for line in path.read_bytes().split(b"\n")[1:]:
        try:
            keys += [json.loads(line)["r"]]
        except (ValueError, KeyError):
            pass  # column entries, or a torn last line
    return keys


@pytest.fixture(scope="module")
def baseline(server, root, tmp_path_factory):
    """One uninterrupted tiny attack through a fault-free proxy: the reference result."""
    tmp = tmp_path_factory.mktemp("baseline")
    params = write_params(root, tmp)
    with FaultProxy(server.base_url) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, params, tmp / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp / "out" / "report.json").read_text())
    return {"report": report, "forwarded": proxy.forwarded, "out": tmp / "out", "params": params, "stdout": proc.stdout}


# -- the oracle against the simulator ------------------------------------------------------------


def _token_ids_by_text(tokenizer) -> dict[str, int]:
    """Token text as llama.cpp renders it (the token's bytes, invalid UTF-8 dropped) -> id, unique texts only."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ids: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        piece = tokenizer.convert_ids_to_tokens(i)
        raw = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
        ids.setdefault(raw.decode("utf-8", errors="ignore"), []).append(i)
    return {text: v[0] for text, v in ids.items() if len(v) == 1}


def test_sampled_logprobs_agree_with_the_simulator(server, lm32):
    """llama.cpp returns T = 1 log-probs of the Q4_1 weights; transformers dequantises the same weights.

    Measured here (8 prompts, 166 tokens): |diff| median 0.076, 95th percentile 0.27, max 0.47, mean
    signed diff 0.001, slope 0.994: unbiased noise from llama.cpp's 8-bit activation quantisation
    over 30 layers. Processed log-probs at T = 2 would halve the slope; a wrong template or token
    map would scatter by nats. Tolerances: median < 0.15, max < 1, |bias| < 0.05, slope 1 +- 0.05.
    """
    from nv.oracle import Simulator

    sim = Simulator(lm32, template=True, logprobs="raw", logits="float32")
    prompts = ["⠓ꦂ🜁ᚠ∰", "What is the capital of France?", "ЖΩ中ب⣿", "Tell me a story", "ab"]
    oracle = HTTPOracle(server.base_url, server.model_name, top_logprobs=10,
                        extra_body={"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0})
    try:
        samples = oracle.sample(prompts, 4, 2.0, seeds=[(0, q) for q in range(len(prompts))])
        greedy = oracle.argmax(prompts)
    finally:
        oracle.close()
    text_of = {col: key[2:] for key, col in oracle.journal.columns.items()}
    id_of = _token_ids_by_text(lm32.tokenizer)
    y = sim.log_probs(prompts, 1.0)
    served, simulated = [], []
    for q, s in enumerate(samples):
        assert s.prompt_tokens == sim.format.prompt_tokens(prompts[q])  # the same chat template and system prompt
        assert s.counts.sum() > 4 * 3  # the top-10 entries count as reveals (those whose text identifies them)
        for col, lp in zip(s.token_ids, s.logprobs):
            if text_of[col] in id_of:
                served.append(lp)
                simulated.append(y[q, id_of[text_of[col]]])
    for q, g in enumerate(greedy):
        assert abs(g.logprobs[0] - y[q].max()) < 0.3  # the T = 0 call reports the top log-prob
    served, simulated = np.array(served), np.array(simulated)
    diff = np.abs(served - simulated)
    slope = np.polyfit(simulated, served, 1)[0]
    print(f"log-prob agreement, {diff.size} tokens: |diff| median {np.median(diff):.3f}, max {diff.max():.3f}, "
          f"bias {np.mean(served - simulated):+.4f}, slope {slope:.3f}")
    assert diff.size >= 40
    assert np.median(diff) < 0.15 and diff.max() < 1.0 and abs(np.mean(served - simulated)) < 0.05
    assert abs(slope - 1) < 0.05


def test_time_request_is_journaled_and_replayed(server, tmp_path):
    """Each timing of a prompt is its own paid call; a rerun on the journal replays them, sends nothing."""
    path = tmp_path / "j.jsonl"
    with FaultProxy(server.base_url) as proxy:
        oracle = HTTPOracle(proxy.url, server.model_name, journal=Journal(path, {"t": 1}))
        first = [oracle.time_request("Count to three."), oracle.time_request("Count to three.")]
        oracle.close()
        oracle.journal.close()
        assert proxy.posts == 2 and all(t.seconds > 0 and t.prompt_tokens > 30 for t in first)
        assert "logprobs" not in proxy.forwarded[0]  # their computation would be timed too
        again = HTTPOracle(proxy.url, server.model_name, journal=Journal(path, {"t": 1}))
        assert [again.time_request("Count to three."), again.time_request("Count to three.")] == first
        again.close()
        again.journal.close()
        assert proxy.posts == 2


def test_the_probe_says_what_it_sends(server, tmp_path, capsys):
    """The probe's line names the requests it sends; a rerun replays both from the journal and says nothing (it
    announced 2 requests that were never sent; a review)."""
    path = tmp_path / "j.jsonl"
    for sent in (2, 0):
        with FaultProxy(server.base_url) as proxy:
            oracle = HTTPOracle(proxy.url, server.model_name, journal=Journal(path, {"t": 1}), progress=True)
            oracle.probe()
            oracle.close()
            oracle.journal.close()
        err = capsys.readouterr().err
        assert proxy.posts == sent and ("probe: 2 requests to" in err) == (sent == 2) and (err == "") == (sent == 0), err


def test_completions_path_sends_the_raw_prompt(server, lm32):
    """`live.chat: false`: plain completions on /v1/completions with the raw prompt (no chat template, no system
    prompt), for real on the llama.cpp server. The server's prompt-token counts are the tokenizer's for the bare
    text (not the ~30-token template), and its T = 1 log-probs agree with the simulator's on the untemplated prompt
    (tolerances of the chat test above: llama.cpp quantises activations)."""
    from nv.oracle import Simulator

    live = yaml.safe_load((ROOT / "params.yaml").read_text())["live"] | {"chat": False, "top_logprobs": 10}
    prompts = ["The capital of France is", "ЖΩ中ب⣿", "1, 2, 3, 4,"]
    with FaultProxy(server.base_url) as proxy, HTTPOracle.from_params(proxy.url, server.model_name, live, None, Budget()) as oracle:
        assert oracle.chat is False
        samples = oracle.sample(prompts, 4, 2.0, seeds=[(0, q) for q in range(len(prompts))])
        greedy = oracle.argmax(prompts)
        timed = oracle.time_request(prompts[0])
    assert {path for _, path, _ in proxy.post_log} == {"/v1/completions"} and len(proxy.post_log) == 4 * 3 + 3 + 1
    for body in proxy.forwarded:
        assert "messages" not in body and body["prompt"] in prompts and body["max_tokens"] == 1
    assert [b["logprobs"] for b in proxy.forwarded[:12]] == [10] * 12 and "logprobs" not in proxy.forwarded[-1]
    sim = Simulator(lm32, template=False, logprobs="raw", logits="float32")
    raw_counts = [len(lm32.tokenizer(p)["input_ids"]) for p in prompts]
    assert [s.prompt_tokens for s in samples] == [g.prompt_tokens for g in greedy] == raw_counts
    assert max(raw_counts) < 15 < Simulator(lm32).format.prompt_tokens(prompts[0])  # the template is not applied
    assert timed.prompt_tokens == raw_counts[0] and timed.seconds > 0
    text_of = {col: key[2:] for key, col in oracle.journal.columns.items()}
    id_of = _token_ids_by_text(lm32.tokenizer)
    y = sim.log_probs(prompts, 1.0)
    served, simulated = [], []
    for q, s in enumerate(samples):
        for col, lp in zip(s.token_ids, s.logprobs):
            if text_of[col] in id_of:
                served.append(lp)
                simulated.append(y[q, id_of[text_of[col]]])
    served, simulated = np.array(served), np.array(simulated)
    diff = np.abs(served - simulated)
    assert diff.size >= 20 and np.median(diff) < 0.15 and diff.max() < 1.0
    assert all(abs(g.logprobs[0] - y[q].max()) < 0.3 for q, g in enumerate(greedy))


def test_client_errors_are_not_retried_and_server_errors_are(server, capsys):
    """A 4xx other than 408/425/429, or a 501 (a server that does not implement the call), is final: one line
    (an HTML error page reduced to its words), no retry, nothing paid; a 500 is retried, and said so on stderr
    unless the run is quiet."""

    limits = Limits(retries=3, backoff=0.01)
    for fault, message in (("400", r"refused the request: HTTP 400 injected: bad request$"),
                           ("501", r"refused the request: HTTP 501 Error response Error response Error code: 501 Message: "
                                   r"Unsupported method \('POST'\)\.$")):
        with FaultProxy(server.base_url, {0: fault}) as proxy, HTTPOracle(proxy.url, server.model_name, limits=limits) as oracle:
            with pytest.raises(NVError, match=r"chat/completions " + message):
                oracle.argmax(["Hello"])
            assert proxy.posts == 1 and oracle.stats["retries"] == 0 and not proxy.forwarded
            assert oracle.journal.requests == 0 and oracle.cost.calls == 0
    for progress in (False, True):
        with FaultProxy(server.base_url, {0: "500"}) as proxy, \
                HTTPOracle(proxy.url, server.model_name, limits=limits, progress=progress) as oracle:
            (reply,) = oracle.argmax(["Hello"])
            assert proxy.posts == 2 and oracle.stats["retries"] == 1 and len(proxy.forwarded) == 1 and reply.prompt_tokens > 0
        err = capsys.readouterr().err
        assert ("chat/completions: HTTP 500 injected; retry 1 of 3 in " in err) is progress, err
    # a redirect is final (its POST body would not follow it); a body its Content-Encoding cannot decode is retried
    # as a truncated one is; a timed reply without a prompt-token count is one line, not a TypeError
    with FaultProxy(server.base_url, {0: "301", 1: "gzip", 3: "nousage"}) as proxy, \
            HTTPOracle(proxy.url, server.model_name, limits=limits) as oracle:
        with pytest.raises(NVError, match=r"redirects \(HTTP 301\) to https://example.invalid/v1/chat/completions: give"):
            oracle.argmax(["Hello"])
        assert proxy.posts == 1 and oracle.stats["retries"] == 0
        (reply,) = oracle.argmax(["Hello"])
        assert proxy.posts == 3 and oracle.stats["retries"] == 1 and reply.prompt_tokens > 0
        with pytest.raises(NVError, match=r"^reply's usage counts are not whole token counts .*: its cost cannot be counted"):
            oracle.time_request("Hello")
    # a greedy token named with a null log-prob was withheld (nv defend's min_logprob): NaN, as DefendedOracle gives
    with FaultProxy(server.base_url, {0: "withhold"}) as proxy, HTTPOracle(proxy.url, server.model_name) as oracle:
        (withheld,), (shown,) = oracle.argmax(["Hello"]), oracle.argmax(["Hello there"])
    assert withheld.token_ids[0] >= 0 and np.isnan(withheld.logprobs[0]) and -20 < shown.logprobs[0] <= 0


# The wait the client chose, as its notice prints it, tells each case from the wait it must not make (60 s, 100 s);
# the measured gap between the two posts is at least that sleep (no upper bound on the clock: a loaded machine).
@pytest.mark.parametrize("retry_after, backoff_max, chosen, low", [
    ("0", 60.0, "0.0", 0.0),      # no wait asked: only the 0.01 s backoff (+ jitter)
    ("1.5", 60.0, "1.5", 1.5),    # Retry-After: 1.5 s honoured although the backoff is 0.01 s
    ("100", 0.6, "0.6", 0.6),     # ... but never beyond live.backoff_max
])
def test_retry_after_is_honoured(server, capsys, retry_after, backoff_max, chosen, low):

    limits = Limits(retries=2, backoff=0.01, backoff_max=backoff_max)
    with FaultProxy(server.base_url, {0: "429"}, retry_after=retry_after) as proxy, \
            HTTPOracle(proxy.url, server.model_name, limits=limits, progress=True) as oracle:
        oracle.argmax(["Hello"])
    (first, _, fault), (second, _, again) = proxy.post_log
    assert (fault, again, oracle.stats["retries"]) == ("429", None, 1)
    err = capsys.readouterr().err
    assert f"; retry 1 of 2 in {chosen} s " in err, err
    assert second - first >= low, second - first


def test_call_and_money_caps_stop_the_run_before_they_are_passed(server):
    """At run time (no plan involved: the oracle itself), each request's cost is reserved before it is sent, so with
    8 requests in flight at once the calls cap lets exactly 5 through and the money cap stops below its amount;
    every paid reply is journaled."""
    from nv.oracle.base import BudgetExhausted

    limits = Limits(concurrency=8, retries=0)
    with FaultProxy(server.base_url) as proxy, \
            HTTPOracle(proxy.url, server.model_name, limits=limits, budget=Budget(calls=5)) as oracle:
        with pytest.raises(BudgetExhausted, match=r"^budget reached: the next request would pass the calls cap of 5 "):
            oracle.sample(["ЖΩ中ب⣿"], 12, 2.0, seeds=[(0, 0)])
        proxy.wait_idle()
        assert proxy.posts == len(proxy.forwarded) == oracle.journal.requests == oracle.provider_cost.calls == 5
    price = 1000.0  # per million billed tokens: a ~40-token request costs ~0.04
    for concurrency in (1, 8):
        with FaultProxy(server.base_url) as proxy, HTTPOracle(proxy.url, server.model_name, limits=Limits(concurrency, retries=0),
                                                              budget=Budget(money=0.25, price_per_mtok=price)) as oracle:
            with pytest.raises(BudgetExhausted, match=r"^budget reached: the next request would pass the money cap of 0.25 "):
                oracle.sample(["ЖΩ中ب⣿"], 12, 2.0, seeds=[(0, 0)])
            proxy.wait_idle()
            spent = oracle.provider_cost.tokens * price / 1e6
            per_request = spent / oracle.provider_cost.calls
            assert 0 < proxy.posts == len(proxy.forwarded) == oracle.journal.requests and spent <= 0.25
            if concurrency == 1:  # one request at a time: it stops only when the next one would not fit
                assert 0.25 - per_request < spent, (spent, per_request)
            # (8 at a time, the first requests reserve twice the planning estimate each: it may stop well short)


# -- nv attack --base-url ---------------------------------------------------------------------


def test_attack_end_to_end_reports_not_saturated_at_a_tiny_budget(baseline, server):
    report = baseline["report"]
    assert report["model"] == server.model_name and report["D"] == 4 and report["N"] == 8
    assert not report["saturated"] and report["reason"] == "not saturated"
    assert report["d_hat"] is None and report["d_hat_raw"] is None and report["lower_bound"] >= 0
    assert report["calls"] == 4 * 8 + 4  # D x N samples + the search's D T = 0 calls (probes are not §5 calls)
    assert report["logprob_mode"]["mode"] == "raw" and report["logprob_mode"]["compared"] >= 1
    assert report["n_honoured"] is False and report["n_per_request"] == 1
    provider = report["cost"]["provider"]
    assert provider["calls"] == REQUESTS == len(baseline["forwarded"])
    keys = [request_key(b) for b in baseline["forwarded"]]
    records = {}
    for line in (baseline["out"] / "journal.jsonl").read_bytes().splitlines()[1:]:
        entry = json.loads(line)
        records.update({entry["r"]: entry["d"]} if "r" in entry else {})
    probe_prompt_tokens = sum(records[k]["p"] for k in keys[:2])  # the probe goes first, one request at a time
    # §5 tokens from the server's own usage of every paid non-probe request: (prompt + 1 output token) each
    paper = {"calls": REQUESTS - 2, "tokens": sum(records[k]["p"] + 1 for k in keys[2:])}
    assert {"calls": report["calls"], "tokens": report["tokens"]} == report["cost"]["paper"] == paper
    # one sample per request: prompt tokens once per request (provider) = once per sample (§5), probe aside
    assert provider["prompt_tokens"] == report["tokens"] - report["calls"] + probe_prompt_tokens
    assert len(set(keys)) == len(keys)  # no request sent twice
    assert sorted(journal_keys(baseline["out"] / "journal.jsonl")) == sorted(keys)  # every paid reply journaled
    assert all(b["max_tokens"] == 1 and b["logprobs"] is True and b["top_logprobs"] == 0 for b in baseline["forwarded"])
    assert (baseline["out"] / "spectrum.png").stat().st_size > 10_000
    assert json.loads(baseline["stdout"].strip().splitlines()[-1])["saturated"] is False
    # not saturated: the interval is the bound and above; the caps it ran under (none) are in the report
    assert report["d_interval"] == [report["lower_bound"], None] and report["cost"]["caps"] == dict.fromkeys(("tokens", "calls", "money"))


def test_dry_run_plans_the_calls_the_attack_made_and_bills_nothing(baseline, server, root, tmp_path):
    with FaultProxy(server.base_url) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, baseline["params"], tmp_path / "o", "--dry-run"))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["requests"] == REQUESTS and plan["sampling_calls"] == 32 and proxy.posts == 0
    assert "tokens (§5)" in proc.stdout and not (tmp_path / "o").exists()
    # the free GET /models went through: the endpoint answers and serves the model (no paid request: no POST)
    assert plan["endpoint_error"] is None and f"GET /models (free): serves {server.model_name}" in proc.stdout
    wrong = run_attack(attack_args(server.base_url, "no-such-model", baseline["params"], tmp_path / "o", "--dry-run"))
    assert wrong.returncode == 0 and "model 'no-such-model' is not served at" in json.loads(wrong.stdout.strip().splitlines()[-1])["endpoint_error"]
    # over the baseline's output folder: its journal's paid replies are shown, and one of another endpoint is refused
    endpoint = baseline["report"]["endpoint"]
    again = run_attack(attack_args(endpoint, server.model_name, baseline["params"], baseline["out"], "--dry-run"))
    assert again.returncode == 0, again.stderr[-2000:]
    paid = json.loads(again.stdout.strip().splitlines()[-1])["paid"]
    assert paid["requests"] == REQUESTS == baseline["report"]["cost"]["provider"]["calls"]
    assert f"already paid      {REQUESTS:,} requests" in again.stdout
    # a cap the journal's spend alone passes is said beside it (it read "the totals above include them"; a review)
    capped = run_attack(attack_args(endpoint, server.model_name, baseline["params"], baseline["out"], "--dry-run",
                                    "--budget-calls", str(REQUESTS - 1)))
    assert capped.returncode == 2 and f"these alone pass the calls cap, {REQUESTS:,.6g} > {REQUESTS - 1:,.6g}" in capped.stdout
    other = run_attack(attack_args(server.base_url, server.model_name, baseline["params"], baseline["out"], "--dry-run"))
    assert other.returncode == 2 and "belongs to another attack (endpoint was" in other.stderr


def test_faults_change_nothing_in_the_result(baseline, server, root, tmp_path):
    faults = {3: "429", 6: "500", 9: "timeout", 12: "truncate", 15: "reset", 24: "500", 25: "429"}
    # the client gives up after 15 s, the "timeout" fault holds 16 s, so a real reply slowed by a loaded machine is not
    # taken for the injected fault (with 5 s the test failed once beside the pipeline's stages, two workers of 2 threads)
    params = write_params(root, tmp_path, timeout=15)
    with FaultProxy(server.base_url, faults, hold=16) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, params, tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert result(report) == result(baseline["report"])
    assert report["http"]["retries"] >= len(faults) and report["http"]["sent"] == REQUESTS
    keys = [request_key(b) for b in proxy.forwarded]
    assert set(keys) == {request_key(b) for b in baseline["forwarded"]}  # the same questions, only retried


def kill_after(args: list[str], journal: Path, paid: int) -> set[str]:
    """Start `nv attack ARGS`, SIGKILL it once its journal holds ``paid`` replies; the keys it had journaled."""
    proc = subprocess.Popen(NV + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (not journal.exists() or len(journal_keys(journal)) < paid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    return set(journal_keys(journal))


def test_kill_minus_9_then_resume_pays_nothing_twice(baseline, server, tmp_path):
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, baseline["params"], out)
        done = kill_after(args, journal, 20)
        assert 20 <= len(done) < REQUESTS and not (out / "report.json").exists()
        proxy.wait_idle()  # the killed run's last requests are answered to nobody: paid, never completed
        before = len(proxy.forwarded)
        rerun = run_attack(args)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        resent = [request_key(b) for b in proxy.forwarded[before:]]
    assert not done & set(resent)  # no completed paid call is sent again
    assert len(resent) == len(set(resent)) == REQUESTS - len(done)  # the rest, exactly once
    report = json.loads((out / "report.json").read_text())
    assert result(report) == result(baseline["report"])


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_journals_the_replies_in_flight(baseline, server, root, tmp_path, sig, status):
    """Ctrl-C (or a SIGTERM, a job scheduler's stop) with four requests in flight: they are paid already, so the run
    sends nothing new, waits for them and journals them before it exits (they used to be dropped: billed, then sent
    again by the resume, and missing from its cost). Every request the server answered is in the journal, and the
    resume sends only the others, once each. Paced at 5 requests/s (live.rpm), so the run outlasts the poll for its
    12th reply on a loaded machine (unpaced it finished first once, in CI), and the interrupt also meets requests
    waiting for their slot: they are not sent."""
    params = write_params(root, tmp_path, concurrency=4, rpm=300)
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, params, out)
        # Ctrl-C's default disposition for the attack: a process that ignores SIGINT passes that on to its children
        # (a shell's background job does, and so may a test worker), and the attack then ran on to exit 0 (twice in
        # CI); reset here, the attack gets Python's KeyboardInterrupt whatever started the tests
        proc = subprocess.Popen(NV + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 300
        while (not journal.exists() or len(journal_keys(journal)) < 12) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=120)[1]
        assert proc.returncode == status, stderr[-2000:]
        assert "rerun the same command to resume" in stderr and "Traceback" not in stderr and "destroyed" not in stderr
        proxy.wait_idle()
        answered = {request_key(b) for b in proxy.forwarded}
        done = set(journal_keys(journal))
        assert answered == done and 12 <= len(done) < REQUESTS  # every answered request journaled, nothing else
        before = len(proxy.forwarded)
        rerun = run_attack(args)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        resent = [request_key(b) for b in proxy.forwarded[before:]]
    assert not done & set(resent) and len(resent) == len(set(resent)) == REQUESTS - len(done)
    report = json.loads((out / "report.json").read_text())
    assert result(report) == result(baseline["report"])
    assert report["cost"]["provider"]["calls"] == REQUESTS  # the resumed run's cost is everything paid


def test_a_second_ctrl_c_abandons_the_replies_in_flight_cleanly(server):
    """Ctrl-C, then Ctrl-C again while both requests in flight hang (the proxy holds them for 40 s): the second one
    returns at once and leaves no task running on the request thread. The task used to stay pending there to the
    interpreter's exit, which printed "Task was destroyed but it is pending!" with its coroutine's frame after the
    attack's own lines (a review, 2026-12-07: `nv attack` behind `nv defend`'s random delays, with progress bars)."""
    async def running():
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's own, whatever started the tests
    try:
        with FaultProxy(server.base_url, faults={0: "timeout", 1: "timeout"}, hold=40) as proxy, \
                HTTPOracle(proxy.url, server.model_name, limits=Limits(concurrency=2, retries=0, timeout=60)) as oracle:
            for delay in (1.0, 2.0):
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()  # a real signal wakes the wait
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                oracle.sample(["Hello", "World"], 1, 1.0, [0, 1])
            assert time.monotonic() - start < 20 and proxy.posts == 2  # not the 40 s hold
            assert asyncio.run_coroutine_threadsafe(running(), oracle._loop).result() == []
    finally:
        signal.signal(signal.SIGINT, previous)


def test_budget_cap_stops_before_overspending_and_a_raised_budget_resumes(baseline, server, root, tmp_path):
    """The plan under-estimates prompt tokens (live.prompt_tokens: 1) and passes the budget check; the prompt search
    then measures them, and the sampling that would pass the cap is refused before any of it is sent (it used to be
    started on the estimate and stopped by the in-flight cap, which
    ``test_call_and_money_caps_stop_the_run_before_they_are_passed`` tests)."""
    params = write_params(root, tmp_path, prompt_tokens=1)
    cap = baseline["report"]["cost"]["provider"]["tokens"] // 2
    out = tmp_path / "out"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, params, out)
        stopped = run_attack(args + ["--budget-tokens", str(cap)])
        assert stopped.returncode == 2 and stopped.stderr.startswith("error: budget reached before sampling 8 calls per prompt: ")
        assert "would pass the tokens cap" in stopped.stderr and "Traceback" not in stopped.stderr
        assert len(stopped.stderr.strip().splitlines()) == 1
        journal = Journal(out / "journal.jsonl", binding(proxy.url, server.model_name, _load(params)))
        spent, requests = journal.prompt_tokens + journal.output_tokens, journal.requests
        journal.close()
        assert spent <= cap and requests == len(proxy.forwarded) == 2 + 4  # the probe and the search: no sample sent
        resumed = run_attack(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(proxy.forwarded) == REQUESTS  # nothing paid twice across the two runs
    assert result(json.loads((out / "report.json").read_text())) == result(baseline["report"])


def test_a_pilot_drawn_elsewhere_is_flagged():
    """``--pilot`` from another endpoint, model or chat mode, or from a simulated model, was taken silently, its prompt
    tokens per call replacing the estimate: the plan now names where it was drawn and flags a different target."""
    from nv.live import pilot_source

    live = {"chat": True}
    drawn = {"endpoint": "http://127.0.0.1:8080/v1", "model": "m", "chat": True}
    assert pilot_source(drawn, live, ("http://user:pw@127.0.0.1:8080/v1/", "m")) == {
        "source": "http://127.0.0.1:8080/v1, model 'm'", "elsewhere": None}
    assert pilot_source(drawn, live, ("https://api.other.example/v1", "gpt-x"))["elsewhere"] == "another endpoint and model"
    assert pilot_source(drawn, {"chat": False}, ("http://127.0.0.1:8080/v1", "m"))["elsewhere"] == "another chat mode (live.chat)"
    assert pilot_source({"spec": "embedded"}, live, ("http://127.0.0.1:8080/v1", "m")) == {
        "source": "simulated model 'embedded'", "elsewhere": "a simulated model"}
    # an adaptive run's merged draws do not name their target: said, not taken for a simulated model
    assert pilot_source(None, live, ("http://127.0.0.1:8080/v1", "m")) == {
        "source": "an unrecorded target", "elsewhere": "an unrecorded target"}


def test_credentials_in_the_url_go_into_headers_only(baseline, server, tmp_path, monkeypatch):
    """http://user:password@host/v1 (a server behind a proxy that asks for Basic credentials): every request carries
    them, and no file the attack writes, nor its output, holds them."""
    out = tmp_path / "out"
    with FaultProxy(server.base_url) as proxy:
        url = proxy.url.replace("http://", "http://auditor:s3cret%21@")
        proc = run_attack(attack_args(url, server.model_name, baseline["params"], out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(proxy.authorizations) == {"Basic " + base64.b64encode(b"auditor:s3cret!").decode()}
    written = [f for f in out.rglob("*") if f.is_file()]
    assert len(written) > 5 and not [f for f in written if b"s3cret" in f.read_bytes() or b"auditor" in f.read_bytes()]
    assert "s3cret" not in proc.stdout + proc.stderr
    assert json.loads((out / "report.json").read_text())["endpoint"] == proxy.url
    # refused by a real llama.cpp server that wants a key on every route: the hint points at what was used
    with LlamaServer("embedded", n_ctx=256, n_threads=1, logprobs=False, api_key="sk-right") as refusing:
        assert "sk-right" not in " ".join(refusing.process.args)  # the key stays off the command line
        monkeypatch.setenv("NV_TEST_KEY", "sk-wrong")
        monkeypatch.setenv("NV_TEST_RIGHT_KEY", "sk-right")
        for url, env, fix in ((refusing.base_url.replace("http://", "http://auditor:wrong@"), "OPENAI_API_KEY",
                               "check the user and password in the URL"),
                              (refusing.base_url, "NV_TEST_UNSET_KEY", "set the API key variable ($NV_TEST_UNSET_KEY)"),
                              (refusing.base_url, "NV_TEST_KEY", "$NV_TEST_KEY is set, but not to a key it accepts")):
            with HTTPOracle(url, refusing.model_name, api_key_env=env) as oracle, \
                    pytest.raises(NVError, match=re.escape(fix)) as err:
                oracle.preflight()
            assert "wrong" not in str(err.value) and "refused the credentials (HTTP 401)" in str(err.value)
        with HTTPOracle(refusing.base_url, refusing.model_name, api_key_env="NV_TEST_RIGHT_KEY") as oracle:
            oracle.preflight()  # the right key is let in


def test_refusals_redirects_and_malformed_urls_say_what_they_are(server, monkeypatch):
    """A server whose model list is open but whose completions want a key (llama.cpp with --api-key) names the unset
    variable at the first paid call; a base URL that redirects names where to (it read as "not an OpenAI model
    list"); a host name IDNA refuses and a password with an unescaped '/' are one-line errors, the latter without
    echoing the password (it reached the journal's first line and the error). All four from a review."""
    with FaultProxy(server.base_url, mode="401post") as proxy, \
            HTTPOracle(proxy.url, server.model_name, api_key_env="NV_TEST_UNSET_KEY", limits=Limits(retries=0)) as oracle:
        oracle.preflight()
        with pytest.raises(NVError, match=re.escape("set the API key variable ($NV_TEST_UNSET_KEY)")) as err:
            oracle.argmax(["Hello"])
        assert "refused the credentials (HTTP 401" in str(err.value)
    with FaultProxy(server.base_url, mode="301") as proxy, HTTPOracle(proxy.url, server.model_name) as oracle, \
            pytest.raises(NVError, match=re.escape("redirects (HTTP 301) to https://example.invalid/v1/models")):
        oracle.preflight()
    for host in ("a..b", "x" * 64 + ".com"):
        with HTTPOracle(f"http://{host}/v1", "m") as oracle, pytest.raises(NVError, match="cannot reach") as err:
            oracle.preflight()
        assert "\n" not in str(err.value)
    with pytest.raises(NVError, match="percent-encode a '/', '[?]' or '#'") as err:
        split_credentials("http://auditor:s3cr/et@127.0.0.1:18777/ok/v1")
    assert "s3cr" not in str(err.value) and "auditor" not in str(err.value)


def test_an_at_sign_in_a_path_is_the_path_s():
    """RFC 3986 allows '@' in a path: such a base URL is served as given (it was refused as a password's unescaped
    '/', a review), with or without credentials before the host; a '?' in a password is refused like a '/'."""
    for url, public, header in [("https://host/v1/deployments/m@2024/v1", "https://host/v1/deployments/m@2024/v1", False),
                                ("http://u:p@host:8080/v1@x", "http://host:8080/v1@x", True),
                                ("http://[::1]:8080/m@1/v1", "http://[::1]:8080/m@1/v1", False)]:
        assert split_credentials(url)[0] == public and bool(split_credentials(url)[1]) == header
    with pytest.raises(NVError, match="percent-encode a '/', '[?]' or '#'") as err:
        split_credentials("http://auditor:s3cr?et@127.0.0.1:18777/v1")
    assert "s3cr" not in str(err.value) and "auditor" not in str(err.value)


def test_retry_after_as_an_http_date():
    """Retry-After's date form (RFC 9110) was dropped: the client waited its 0.01 s backoff instead of 30 s."""
    from email.utils import format_datetime

    with HTTPOracle("http://127.0.0.1:9/v1", "m", limits=Limits(backoff=0.01, backoff_max=60.0)) as oracle:
        ahead = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
        assert 27.0 < oracle._backoff(0, ahead) <= 30.0
        assert oracle._backoff(0, format_datetime(datetime.now(timezone.utc) + timedelta(hours=1), usegmt=True)) == 60.0
        assert oracle._backoff(0, "not a date") <= 0.02


def test_a_larger_budget_on_the_same_journal_reuses_every_paid_reply(baseline, server, root, tmp_path):
    """N and live.columns are not bound to the journal: they change how many requests the attack makes and how
    the draws are stored, not what a request asks; raised after a run, only the new calls are paid."""
    out = tmp_path / "out"
    with FaultProxy(server.base_url) as proxy:
        first = run_attack(attack_args(proxy.url, server.model_name, baseline["params"], out))
        assert first.returncode == 0 and len(proxy.forwarded) == REQUESTS, first.stderr[-3000:]
        paid = {request_key(b) for b in proxy.forwarded}
        more = write_params(root, tmp_path, name="more.yaml", columns=300_000)
        more.write_text(more.read_text().replace("  N: 8\n", "  N: 12\n"))
        second = run_attack(attack_args(proxy.url, server.model_name, more, out))
        assert second.returncode == 0, second.stderr[-3000:]
        new = [request_key(b) for b in proxy.forwarded[REQUESTS:]]
    assert not paid & set(new) and len(new) == len(set(new)) == 4 * (12 - 8)  # D x the 4 new samples, nothing twice
    report = json.loads((out / "report.json").read_text())
    assert report["calls"] == 4 * 12 + 4 and report["cost"]["provider"]["calls"] == REQUESTS + len(new)


def _load(params: Path) -> dict:
    from nv.cli import PHASE1_SECTIONS
    from nv.params import load_params

    return load_params(params, PHASE1_SECTIONS + ["live"])


# -- bad input: one line, exit 2, nothing paid ----------------------------------------------------


def _error(capsys, argv: list[str]) -> str:
    code = main(["attack", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_costs_nothing(server, root, tmp_path, capsys, monkeypatch):
    params = write_params(root, tmp_path)
    name = server.model_name
    cases = [  # (proxy mode, model, extra args, expected message, POSTs allowed)
        (None, "no-such-model", [], "is not served", 0),
        ("html", name, [], "did not answer an OpenAI model list", 0),
        (None, name, ["--budget-tokens", "100"], "budget too small", 0),
        (None, name, ["--budget-calls", "10"], "budget too small", 0),
        (None, name, ["--budget-money", "1"], "needs --price-per-mtok", 0),
        (None, name, ["--out", "/proc/nv-out"], "not writable", 0),
        ("strip", name, [], "no log-probabilities", 1),  # only a reply can show that: the first one
    ]
    for i, (mode, model, extra, message, posts) in enumerate(cases):
        with FaultProxy(server.base_url, mode=mode) as proxy:
            err = _error(capsys, attack_args(proxy.url, model, params, tmp_path / f"out{i}") + extra)
            assert message in err and proxy.posts == posts, (err, proxy.posts)
    err = _error(capsys, attack_args(f"http://127.0.0.1:{free_port()}/v1", name, params, tmp_path / "o"))
    assert "cannot reach" in err
    # a key no HTTP header can carry: httpx's UnicodeEncodeError (a traceback), or h11's error naming the header, the
    # key in it, in "cannot reach" (a key pasted with its line break)
    for key in ("sk-\u00fcber", "sk-secret\n", "sk-secret ", "sk-se\x07cret"):
        with monkeypatch.context() as env:
            env.setenv("OPENAI_API_KEY", key)
            err = _error(capsys, attack_args(server.base_url, name, params, tmp_path / "o-key", "--dry-run"))
            assert err.startswith("error: $OPENAI_API_KEY holds a character an HTTP header cannot carry") and "secret" not in err
    with LlamaServer("embedded", n_ctx=256, logprobs=False) as plain, FaultProxy(plain.base_url) as proxy:
        few = write_params(root, tmp_path, name="few-retries.yaml", retries=1)
        err = _error(capsys, attack_args(proxy.url, plain.model_name, few, tmp_path / "o-plain"))
        assert "logprobs is not supported" in err and not proxy.forwarded  # HTTP 500 each time: nothing paid

    journal_path = tmp_path / "other.jsonl"
    with FaultProxy(server.base_url) as proxy:
        paid = Journal(journal_path, binding(proxy.url, name, _load(params)))
        paid.put("k0", {"c": [], "p": 1, "o": 1})  # something paid under it: the binding holds
        paid.close()
        other = write_params(root, tmp_path, name="other.yaml")
        text = other.read_text().replace("  temperature: 2.0\n", "  temperature: 1.5\n")
        other.write_text(text)
        err = _error(capsys, attack_args(proxy.url, name, other, tmp_path / "o2", "--journal", str(journal_path)))
        assert "belongs to another attack (sampling.temperature was 2.0, now 1.5)" in err
        err = _error(capsys, attack_args(server.base_url, name, params, tmp_path / "o3", "--journal", str(journal_path)))
        assert "belongs to another attack (endpoint was" in err
        assert proxy.posts == 0


def test_a_corrupt_gguf_is_a_one_line_server_error(tmp_path):
    """A GGUF cut short (5 MB of the embedded model's file): llama.cpp's own failure, in one line from the server's
    process and from the parent that starts it."""
    from nv.models.loading import embedded_gguf

    cut = tmp_path / "cut.gguf"
    with embedded_gguf().open("rb") as f:
        cut.write_bytes(f.read(5 << 20))
    with pytest.raises(NVError, match=r"llama.cpp server exited with status 2: error: llama.cpp: Failed to load model from file: .*cut.gguf \(a file cut short") as err:
        LlamaServer(cut, n_ctx=256).start()
    assert "\n" not in str(err.value)


def test_a_server_key_from_an_unset_variable_is_a_one_line_error(monkeypatch):
    """``--api-key-env VAR`` with VAR unset, or an empty key, would serve without a key, open to anyone: refused before
    the model loads."""
    monkeypatch.delenv("NV_TEST_UNSET_KEY", raising=False)
    proc = subprocess.run([sys.executable, "-m", "nv.models.llama_server", "--api-key-env", "NV_TEST_UNSET_KEY"],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "error: --api-key-env NV_TEST_UNSET_KEY: the variable is not set (or empty)\n")
    with pytest.raises(NVError, match="an empty api_key would serve with no key at all"):  # nor from Python
        LlamaServer("embedded", api_key="")


def test_the_server_holds_its_port_from_the_start_and_never_outlives_a_failed_start():
    """LlamaServer binds the port before the model loads (the child serves the inherited socket): a port that
    something already listens on is an error at once, where the server used to take any answer on it for its own
    (another process's model, timed as ours); a start interrupted (Ctrl-C or SIGTERM, run_main's KeyboardInterrupt;
    here an alarm 0.1 s in, while the child imports) stops the child, which used to load on and serve for good."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(NVError, match=f"cannot serve on 127.0.0.1:{port}: Address already in use"):
            LlamaServer("embedded", n_ctx=256, port=port).start()
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    interrupted = LlamaServer("embedded", n_ctx=256)
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted.process.poll() is not None and not interrupted.log_path.exists()
    with LlamaServer("embedded", n_ctx=256) as server:  # and one that starts serves its model on the port it bound
        models = httpx.get(server.base_url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [server.model_name] and server.process.poll() is None


def test_malformed_log_probabilities_are_one_line_errors():
    """Replies a faulty endpoint could send: a log-prob that is not a number, NaN or positive, a token entry that is
    not an object, token bytes that are not bytes. Each used to escape as an AttributeError, ValueError or TypeError
    (or poison the journal with NaN); a sound reply still parses."""
    def reply(entry):
        return {"choices": [{"index": 0, "logprobs": {"content": [entry]}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    good = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    assert parse_reply(reply(good), chat=True, top_logprobs=0)["c"] == [["b:61", -0.5, []]]
    for bad in ("tok", good | {"logprob": "abc"}, good | {"logprob": float("nan")}, good | {"logprob": 5.0},
                good | {"bytes": [300]}, good | {"bytes": ["a"]}):
        with pytest.raises(NVError, match="log-probabilities are malformed") as err:
            parse_reply(reply(bad), chat=True, top_logprobs=0)
        assert "\n" not in str(err.value)
    # usage counts that would undercount the cost and fail the sample's checks after the run had paid (a review:
    # Ollama's 0 for a cached prompt; Infinity, which Python's JSON reader takes, was an OverflowError)
    for usage in ({"prompt_tokens": 0}, {"prompt_tokens": -5}, {"prompt_tokens": float("inf")}, {"prompt_tokens": "3"},
                  {"prompt_tokens": True}, {"prompt_tokens": 2.5}, {"prompt_tokens": 3, "completion_tokens": -1}):
        with pytest.raises(NVError, match="usage counts are not whole token counts") as err:
            parse_reply(reply(good) | {"usage": usage}, chat=True, top_logprobs=0)
        assert "\n" not in str(err.value)
    assert parse_reply(reply(good) | {"usage": {"prompt_tokens": 3.0}}, chat=True, top_logprobs=0)["p"] == 3
    # vLLM's bytes are its decoded text re-encoded: every partial UTF-8 token comes as U+FFFD, ef bf bd, which named them
    # all one token (one column, their counts and log-probs merged); OpenAI's own bytes still name them apart
    lossy = {"token": "\ufffd", "logprob": -3.0, "bytes": list("\ufffd".encode()), "top_logprobs": []}
    assert parse_reply(reply(lossy), chat=True, top_logprobs=0)["c"] == [[None, -3.0, []]]
    assert parse_reply(reply(lossy | {"token": " \ufffd", "bytes": list(" \ufffd".encode())}), chat=True, top_logprobs=0)["c"][0][0] is None
    assert parse_reply(reply(lossy | {"bytes": [0xE4]}), chat=True, top_logprobs=0)["c"] == [["b:e4", -3.0, []]]


def test_the_sampled_tokens_own_log_prob_stands_beside_its_top_entry(tmp_path):
    """With live.top_logprobs > 0 the sampled token is often listed again among the top entries: its own value is the
    one kept (the top entry's replaced it, where a server reports them apart), and the token counted once."""
    oracle = HTTPOracle("http://127.0.0.1:9/v1", "m", top_logprobs=2, journal=Journal(None, {"endpoint": "e"}))
    record = {"c": [["s:a", -1.0, [["s:a", -1.2], ["s:b", -1.5]]]], "p": 5, "o": 1}
    key = request_key(oracle._sample_body(["x"], 1.0, [(0, 0)], [1], 0))
    oracle.journal.put(key, record)
    (out,) = oracle.sample(["x"], 1, 1.0, [(0, 0)])
    column = {oracle.journal.column("s:a"): "a", oracle.journal.column("s:b"): "b"}
    got = {column[int(t)]: (float(lp), int(c)) for t, lp, c in zip(out.token_ids, out.logprobs, out.counts)}
    assert got == {"a": (-1.0, 1), "b": (-1.5, 1)}


# -- the journal itself -------------------------------------------------------------------------


def test_journal_drops_a_torn_last_line_and_refuses_a_corrupt_one(tmp_path, caplog):
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"endpoint": "e"})
    j.put("k1", {"c": [["s:a", -1.0, []]], "p": 5, "o": 1})
    assert j.column("s:a") == 0 and j.column("s:b") == 1 and j.column("s:a") == 0
    j.put("k2", {"c": [], "p": 7, "o": 1})
    j.sync()
    j.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"r":"k3","d":{"c":[')  # a write cut short by kill -9
    j = Journal(path, {"endpoint": "e"})
    assert "torn last line" in caplog.text
    assert j.get("k1") == {"c": [["s:a", -1.0, []]], "p": 5, "o": 1} and "k2" in j and "k3" not in j
    assert j.columns == {"s:a": 0, "s:b": 1}
    assert (j.requests, j.prompt_tokens, j.output_tokens) == (2, 12, 2)
    with pytest.raises(NVError, match="in use by another process"):
        Journal(path, {"endpoint": "e"})
    j.close()
    assert path.read_bytes() == whole  # truncated back to the last whole line
    lines = whole.split(b"\n")
    path.write_bytes(b"\n".join(lines[:1] + [b"{broken"] + lines[2:]))
    with pytest.raises(NVError, match=r"line 2 is corrupt, .* \(keep the replies above it with `head -n 1`"):
        Journal(path, {"endpoint": "e"})
    # Python's JSON extensions, which nv never writes: a NaN log-prob or an infinite token count is a corrupt line,
    # the last whole line too (it was dropped as torn: a paid reply lost, a NaN one silently)
    for bad in (b'{"r":"k","d":{"c":[["s:a",NaN,[]]],"p":1,"o":1}}', b'{"r":"k","d":{"c":[],"p":Infinity,"o":1}}',
                b'{"r":"k","d":{"c":[["s:a",-1e999,[]]],"p":1,"o":1}}', b'{"r":"k","d":{"c":[],"p":1e999,"o":1}}'):
        path.write_bytes(b"\n".join(lines[:3] + [bad] + lines[3:]))
        with pytest.raises(NVError, match=r"line 4 is corrupt, .*`head -n 3`"):
            Journal(path, {"endpoint": "e"})
        path.write_bytes(whole + bad + b"\n")
        with pytest.raises(NVError, match=rf"line {len(lines)} is corrupt, .*`head -n {len(lines) - 1}`"):
            Journal(path, {"endpoint": "e"})
        assert path.read_bytes() == whole + bad + b"\n"  # nothing truncated
    # JSON, but not what a paid reply or a column looks like: as untrusted as a broken line, never a KeyError later
    for bad in ({"r": "k", "d": {}}, {"r": "k", "d": {"c": "garbage", "p": 1, "o": 1}}, {"r": "k", "d": {"c": [], "p": "x", "o": 1}},
                {"r": "k", "d": {"c": [["s:a", "x", []]], "p": 1, "o": 1}}, {"r": 5, "d": {"c": [], "p": 1, "o": 1}},
                {"v": 3, "c": 2}):
        path.write_bytes(b"\n".join(lines[:3] + [json.dumps(bad).encode()] + lines[3:]))
        with pytest.raises(NVError, match=r"line 4 is not a response or a column entry, .*`head -n 3`"):
            Journal(path, {"endpoint": "e"})
    with pytest.raises(NVError, match=r"belongs to another attack \(endpoint was 'e', now 'f'\)"):
        path.write_bytes(whole)
        Journal(path, {"endpoint": "f"})
    torn = whole + b'{"r":"k3","d":{"c":['  # another attack's journal, cut short: refused, and left as it was
    path.write_bytes(torn)
    with pytest.raises(NVError, match="belongs to another attack"):
        Journal(path, {"endpoint": "f"})
    assert path.read_bytes() == torn
    # a path the caller leaves unbound (how many requests, not what they ask) may change: the paid replies are reused
    unbound = Journal(path, {"endpoint": "e", "N": 12}, unbound=("N",))
    assert unbound.requests == 2 and "k1" in unbound and "k2" in unbound
    unbound.close()
    with pytest.raises(NVError, match=r"belongs to another attack \(endpoint was 'e', now 'f'\)"):
        Journal(path, {"endpoint": "f", "N": 12}, unbound=("N",))


def test_a_rerun_may_change_how_many_requests_a_round_makes_but_not_what_they_ask(root, tmp_path):
    """The sampling keys that decide how many requests each round makes (N, N_max, N0, growth), how the draws are
    stored or estimated (chunk, estimator, live.columns) keep a journal's paid replies: a request's key is its whole
    body, so a rerun finds the same requests paid. tau, D and the seed shape the requests: they bind it (an auditor
    switching to the cheaper estimator after a stop used to be sent to a new --out, to pay for everything again)."""
    params = _load(write_params(root, tmp_path))
    path = tmp_path / "j.jsonl"
    paid = Journal(path, binding("http://e/v1", "m", params), UNBOUND)
    paid.put("k0", {"c": [], "p": 1, "o": 1})
    paid.close()
    changed = {**params, "sampling": params["sampling"] | {"N": "auto", "N0": 7, "N_max": 900, "growth": 3.0,
                                                           "estimator": "incomplete", "chunk": 3},
               "live": params["live"] | {"columns": 1024}}
    again = Journal(path, binding("http://e/v1", "m", changed), UNBOUND)
    assert again.requests == 1 and "k0" in again
    again.close()
    for section, key, value in (("sampling", "temperature", 1.5), ("search", "D", 5), ("live", "n_per_request", 2)):
        other = {**params, section: params[section] | {key: value}}
        with pytest.raises(NVError, match=f"belongs to another attack \\({section}.{key} was"):
            Journal(path, binding("http://e/v1", "m", other), UNBOUND)


def test_journal_is_a_regular_file_on_a_file_system_that_locks(tmp_path, monkeypatch):
    """--journal /dev/null (it took every paid reply and gave none back; os.fsync's EINVAL then ended in a traceback)
    or a FIFO is refused in one line; so is a file system without locks (NFS's ENOLCK, which does not exist here:
    flock fails as it would there), which is not "in use by another process"."""
    os.mkfifo(tmp_path / "fifo")
    for special in ("/dev/null", tmp_path / "fifo"):
        with pytest.raises(NVError, match="is not a regular file: give a file's path"):
            Journal(special, {"endpoint": "e"})
    monkeypatch.setattr(journal_module.fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(37, "No locks available")))
    with pytest.raises(NVError, match=r"cannot be locked \(No locks available; a network file system\?\)"):
        Journal(tmp_path / "j.jsonl", {"endpoint": "e"})


def test_a_full_disk_leaves_no_torn_line_in_the_journal(tmp_path):
    """A journal on a real full disk (a one-page tmpfs): the reply whose line does not fit is written in part, then the
    write fails; the part is cut off, so the replies written once there is room follow whole lines and the journal
    reopens with every one of them (a torn line inside the file made the whole journal untrusted). Mounting needs
    root: skipped elsewhere."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs (the full disk) needs root")
    try:
        j = Journal(disk / "j.jsonl", {"endpoint": "e"})
        paid = 0
        with pytest.raises(OSError, match="No space left on device"):
            while True:
                j.put(f"k{paid}", {"c": [], "p": 1, "o": 1})
                paid += 1
        assert (disk / "j.jsonl").stat().st_size == j._end  # whole lines only: the torn part cut off
        subprocess.run(["mount", "-o", "remount,size=64k", str(disk)], check=True)
        j.put("after", {"c": [], "p": 1, "o": 1})
        j.close()
        again = Journal(disk / "j.jsonl", {"endpoint": "e"})
        assert again.requests == paid + 1 > 40 and "after" in again and f"k{paid}" not in again
        again.close()
    finally:  # lazily: a failed assertion leaves a journal open on it
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_journal_index_finds_every_reply_through_colliding_prefixes_and_runs(tmp_path, monkeypatch):
    """The journal holds an index, not the replies: a reply is read back from its line. Here runs of 4 entries (many
    merges) and prefixes of 3 values (every lookup meets colliding keys): every reply is found, as written, before and
    after a reopen; a key never put is not; a key put twice gives its last reply; a line changed under the attack is
    an error, not another reply."""
    monkeypatch.setattr(journal_module._Index, "BATCH", 4)
    monkeypatch.setattr(journal_module, "_prefix", lambda key: int(key[1:]) % 3)
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"endpoint": "e"})
    records = {f"k{i}": {"c": [[f"s:{i}", -0.5 * i, []]], "p": i, "o": 1} for i in range(50)}
    for i, (key, record) in enumerate(records.items()):
        j.put(key, record)
        if i % 7 == 0:
            j.column(f"s:{i}")  # column lines between the replies' lines
    assert all(j.get(k) == r for k, r in records.items()) and "k50" not in j and j.requests == 50
    j.close()
    j = Journal(path, {"endpoint": "e"})
    assert all(j.get(k) == r for k, r in records.items()) and "k50" not in j and j.requests == 50
    assert j.prompt_tokens == sum(range(50)) and len(j.columns) == 8
    j.put("k50", {"c": [], "p": 1, "o": 1})
    assert j.get("k50") == {"c": [], "p": 1, "o": 1} and j.get("k49") == records["k49"]
    again = {"c": [], "p": 2, "o": 1}
    j.put("k7", again)  # a key paid twice (two requests in flight at once): its last reply, billed twice
    for k in ("k51", "k52", "k53"):  # before and after the dict is filed into the runs
        assert j.get("k7") == again
        j.put(k, {"c": [], "p": 1, "o": 1})
    assert j.get("k7") == again and j.requests == 55
    j.close()
    j = Journal(path, {"endpoint": "e"})
    assert j.get("k7") == again and j.requests == 55 and j.get("k6") == records["k6"]
    text = path.read_bytes()
    start = text.index(b'"r":"k3"')
    path.write_bytes(text[: start - 30] + b"#" * 30 + text[start - 30 :])  # bytes inserted: the offsets now miss
    with pytest.raises(NVError, match="no longer what was read there"):
        j.get("k3")
    j.close()


def test_journal_index_against_a_dict(monkeypatch):
    """``_Index.places`` gives exactly the (offset, length) pairs filed under a prefix, whatever the merges: 3,000 adds
    in batches of 7 over 300 prefixes, among them 0 and the largest uint64 values (where a signed comparison would
    fail)."""
    monkeypatch.setattr(journal_module._Index, "BATCH", 7)
    rng = np.random.default_rng(0)
    pool = [0, 2**63 - 1, 2**63, 2**64 - 1] + [2 * int(x) for x in rng.integers(0, 2**63, 296, dtype=np.int64)]
    index, reference = journal_module._Index(), {}
    for i in range(3000):
        prefix = pool[int(rng.integers(len(pool)))]
        index.add(prefix, 10 * i, i % 97)
        reference.setdefault(prefix, []).append((10 * i, i % 97))
    assert index.size == 3000 and len(index._runs) <= 10
    assert all(sorted(index.places(p)) == sorted(reference.get(p, [])) for p in pool + [1, 2**64 - 2])


def test_journal_read_in_pieces_keeps_every_reply(tmp_path, monkeypatch, caplog):
    """Linux returns at most 2 GiB per read: a journal read in one ``os.pread`` came back short past that size, its
    rest looked like a torn last line and was truncated away, paid replies with it. Here every read is short (as past
    2 GiB), positional or through the file the reader opens; the journal loads every reply and its file keeps every
    byte. The short reads are patched in: a real journal past 2 GiB would cost the suite minutes and the disk 2 GiB."""
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"endpoint": "e"})
    for k in range(200):
        j.put(f"k{k}", {"c": [[f"s:{k}", -1.5, []]], "p": 5, "o": 1})
    j.close()
    whole = path.read_bytes()
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real(fd, min(n, 1000), offset))

    class ShortReads(io.RawIOBase):
        def __init__(self, path):
            self.fd = os.open(path, os.O_RDONLY)

        def readable(self):
            return True

        def readinto(self, buffer):
            data = os.read(self.fd, min(len(buffer), 1000))
            buffer[: len(data)] = data
            return len(data)

        def close(self):
            if not self.closed:
                os.close(self.fd)
            super().close()

    monkeypatch.setattr(journal_module, "open", lambda p, mode: io.BufferedReader(ShortReads(p)), raising=False)
    with caplog.at_level("WARNING"):
        j = Journal(path, {"endpoint": "e"})
    assert j.requests == 200 and "torn" not in caplog.text
    j.close()
    assert path.read_bytes() == whole


def test_the_budget_pre_check_counts_only_what_the_journal_does_not_answer():
    """``HTTPOracle.refuses`` on a resumed attack (no server: every reply it needs is in the journal or not asked).
    A search replayed from the journal measures its prompts' tokens, as a paid one does (a rerun's check used the
    ``live.prompt_tokens`` guess); after N is raised from 4 to 8, each prompt's first 4 requests are paid, and only
    the other 4 count against the cap (a search over all requests at once counted most of them again)."""
    prompts, seeds = [f"p{q}" for q in range(50)], [(0, q) for q in range(50)]
    journal = Journal(None, {})
    oracle = HTTPOracle("http://127.0.0.1:9/v1", "m", journal=journal, budget=Budget(calls=50 * 8))
    try:
        for p in prompts:  # the search's T = 0 calls, paid by an earlier run: 500 prompt tokens each
            journal.put(request_key(oracle._body(p, 0.0, 1, None, logprobs=True)), {"c": [["s:a", -0.1, []]], "p": 500, "o": 1})
        oracle.argmax(prompts)  # replayed, nothing sent
        assert oracle.stats == {"sent": 0, "replayed": 50, "retries": 0} and oracle._prompt_len["p0"] == 500
        refusal = oracle.refuses(prompts, 8, 2.0, seeds)
        assert refusal is not None and "would pass the calls cap" in refusal and "~2e+05 billed tokens" in refusal
        sizes = oracle._sizes(4)
        for q in range(50):  # the first 4 requests of every prompt, paid under N = 4
            for j in range(4):
                journal.put(request_key(oracle._sample_body(prompts, 2.0, seeds, sizes, q * 4 + j)),
                            {"c": [["s:a", -1.0, []]], "p": 500, "o": 1})
        # spent: 50 search + 200 samples; left at N = 8: 200, so 450 <= 450 and 449 refuses
        oracle.budget = Budget(calls=450)
        assert oracle.refuses(prompts, 8, 2.0, seeds) is None
        oracle.budget = Budget(calls=449)
        assert "200 requests of ~1e+05 billed tokens would pass the calls cap of 449" in oracle.refuses(prompts, 8, 2.0, seeds)
        # a rerun at a smaller N needs nothing new: nothing to refuse, whatever the journal spent beyond it ("0 requests
        # ... would pass the cap" stopped it; a review)
        oracle.budget = Budget(calls=100)
        assert oracle.refuses(prompts, 4, 2.0, seeds) is None
    finally:
        oracle.close()


def test_a_read_only_journal_reads_beside_the_attack_and_changes_nothing(tmp_path):
    """The dry run's look at what is paid: it reads a journal another process holds locked and is appending to,
    without its lock, and neither drops a torn last line nor rewrites a header-only journal of another binding."""
    path = tmp_path / "j.jsonl"
    running = Journal(path, {"endpoint": "e"})  # the attack, holding the lock
    running.put("k1", {"c": [["s:a", -1.0, []]], "p": 5, "o": 1})
    running.sync()
    os.write(running._fd, b'{"r":"k2","d":{"c":[')  # a reply being written at this moment
    before = path.read_bytes()
    look = Journal(path, {"endpoint": "e"}, readonly=True)
    assert look.requests == 1 and "k1" in look and look.prompt_tokens == 5 and path.read_bytes() == before
    with pytest.raises(NVError, match="belongs to another attack"):
        Journal(path, {"endpoint": "f"}, readonly=True)
    running.close()
    header_only = tmp_path / "h.jsonl"
    Journal(header_only, {"endpoint": "typo"}).close()
    kept = header_only.read_bytes()
    assert Journal(header_only, {"endpoint": "e"}, readonly=True).requests == 0 and header_only.read_bytes() == kept


def test_journal_refuses_a_foreign_file_untouched_and_reuses_one_where_nothing_was_paid(tmp_path, caplog):
    """A --journal path naming someone else's file is refused and left as it was, even a one-line file (it used to
    be taken for a torn header and overwritten); a journal whose header is all it holds (a first run that failed its
    set-up checks) serves the corrected attack instead of refusing it."""
    for content in (b"garbage", b"[1]\n", b"\xff\xfe", b'{"a": 1}\n{"b": 2', b"some notes\nnot JSON at all\n"):
        path = tmp_path / "other.jsonl"
        path.write_bytes(content)
        with pytest.raises(NVError, match="is not a NightVision journal"):
            Journal(path, {"endpoint": "e"})
        assert path.read_bytes() == content
    path = tmp_path / "j.jsonl"
    Journal(path, {"endpoint": "typo"}).close()  # nothing paid under it
    with caplog.at_level("INFO"):
        j = Journal(path, {"endpoint": "e"})
    assert "no reply was paid" in caplog.text
    j.put("k1", {"c": [], "p": 5, "o": 1})
    j.close()
    with pytest.raises(NVError, match="belongs to another attack"):  # once something is paid, the binding holds
        Journal(path, {"endpoint": "f"})
    torn = tmp_path / "torn.jsonl"  # our own first write cut short: a torn header is dropped, not refused
    torn.write_bytes(b'{"binding":{"endp')
    Journal(torn, {"endpoint": "e"}).close()
    assert torn.read_bytes().startswith(b'{"binding":{"endpoint":"e"}')


def test_dry_run_theory_is_theorem_1_inverted():
    """The dry run's guaranteed |C| is the largest d whose Theorem 1 sample bound the planned N meets."""
    from nv.theory.sample_complexity import guaranteed_common_size, theorem1_samples

    for N, D, V in [(300_000, 3000, 4096), (300_000, 3000, 16384), (5_000, 200, 1024), (4_000, 50, 1024)]:
        d = guaranteed_common_size(N, D, V)
        assert 0 < d < V and theorem1_samples(d, D, V) <= N
        try:
            assert theorem1_samples(d + 1, D, V) > N
        except NVError as exc:  # d + 1 needs a mean above |V|: no N guarantees it
            assert "unreachable" in str(exc)
    assert guaranteed_common_size(8, 4, 1024) == 0


def test_n_samples_per_request_where_honoured(server):
    """With n honoured (the proxy's ``n`` mode), 7 samples at 3 per request are 3 requests: the paper's
    accounting charges 7 x (prompt + 1) tokens, the provider's the prompt tokens 3 times."""
    with FaultProxy(server.base_url, mode="n") as proxy, \
            HTTPOracle(proxy.url, server.model_name, n_per_request=3, extra_body={"top_k": 0, "min_p": 0.0}) as oracle:
        oracle.probe()
        assert oracle.n_supported and oracle.n_per_request == 3 and [b.get("n", 1) for b in proxy.forwarded] == [3, 1]
        (s,) = oracle.sample(["ЖΩ中ب⣿"], 7, 2.0, seeds=[(0, 0)])
        sent = proxy.forwarded[2:]
    assert [b.get("n", 1) for b in sent] == [3, 3, 1] and len({b["seed"] for b in sent}) == 3
    records = [oracle.journal.get(request_key(b)) for b in sent]
    assert sum(len(r["c"]) for r in records) == 7
    assert s.counts.sum() == sum(key is not None for r in records for key, _, _ in r["c"])
    ell = s.prompt_tokens
    assert oracle.cost.tokens == 7 * (ell + 1) and oracle.cost.calls == 7
    assert sum(r["p"] for r in records) == 3 * ell  # the provider bills the prompt once per request


# Phase 2 on the endpoint: a real calibration, made as the timing and timing_fit stages make one, on the endpoint's
# own platform (a llama.cpp server, 1 thread): three random-weight references with SmolLM2's layer shape (d = 576,
# 9 / 3 heads, d_ffn = 1536) and known depths 4, 10 and 16, timed with the App. D protocol below (three, so that
# each held out leaves two to fit: the intervals are then finite, at the split-conformal level 3/4). Same platform,
# so k = 1; the served model has L = 30 and P = 134,515,008 (the test prints the estimates beside them). Shallow
# references and 4 trials (the middle 2 kept) because this test took 31 min on a degraded machine with depths 10
# and 40 and 5 trials; the accuracy it prints is the protocol's at CI cost, not the README's.
REF_DEPTHS = (4, 10, 16)
PROTOCOL = {"r": 0.02, "trials": 4, "warmups": 2, "trim": 0.25, "n_lengths": 5, "discard": 1, "kv_ratio": 0.25, "ffn_ratio": 3.5}


@pytest.fixture(scope="module")
def calibration_file(lm32, tmp_path_factory):
    from nv.phase2.calibration import calibration
    from nv.phase2.platforms import reference_model, time_platform

    tmp = tmp_path_factory.mktemp("calibration")
    cfg = {"r": PROTOCOL["r"], "trials": PROTOCOL["trials"], "threads": 1, "references": "all"}
    timing = {"platforms": {"llamacpp": cfg}, **{k: v for k, v in PROTOCOL.items() if k not in ("r", "trials")}}
    records = []
    for L in REF_DEPTHS:  # the timing_reference stage's path: a random-weight GGUF served, swept by its true shape
        model = reference_model(f"ref-{L}", {"d": 576, "L": L, "n_kv_heads": 3, "d_ffn": 1536}, lm32, 0)
        records.append(time_platform(model, "llamacpp", cfg, model.lengths(cfg["r"], PROTOCOL["n_lengths"]), timing, 0,
                                     tmp / f"t{L}.jsonl", progress=False))
    cal = calibration({"llamacpp": records}, timing)
    assert cal["beta"] > 0 and cal["platform"] == "llamacpp"
    path = tmp / "calibration.json"
    path.write_text(json.dumps(cal))
    return path


def test_phase2_on_the_endpoint_from_a_calibration(server, root, tmp_path, calibration_file):
    """`--timing-calibration`: after phase 1 the endpoint is timed on the sweep of d_hat and its depth and size are
    reported, from the calibration file's beta and alpha, with the transfer factor the user gives.

    Measured here with references of depth 10 and 40, 5 trials and 2 server threads (2-core machine, other jobs
    running): basic L_hat 19.9-29.4 in most runs for the true 30, up to 48 when the load changed between calibration
    and attack; Eq. 10 15-34. On a degraded machine (stalls of seconds) it left even a factor 2 (two CI runs failed
    there): a few trials follow the machine, not the model. So the accuracy is printed, not asserted (the README's, on an idle machine); asserted is what holds
    whatever the timings: the sweep of d_hat = 576, the calibration used as written, Eq. 3 on the L_hat found, the
    journal's replay, and k."""
    out = tmp_path / "out"
    params = write_params(root, tmp_path)
    common = attack_args(server.base_url, server.model_name, params, out, "--timing-calibration", str(calibration_file),
                         "--timing-d-hat", "576", "--vocab-size", "49152", "--context-length", "512")
    proc = run_attack(common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    t = report["timing"]
    assert (t["d_hat"], t["k"], t["trials"], t["calibration_platform"]) == (576, 1.0, 4, "llamacpp")
    # the timed lengths are the server's own prompt-token counts, rising along the App. D sweep of d_hat = 576 with
    # the default ratios: ell* = floor((576 + 144 + 1.5 * 2016) * 0.02) = 74, five points on [37, 3 ell* = 222] + ell*
    ell, T = np.array(t["lengths"]), np.array(t["T"])
    assert np.all(np.diff(ell) > 0) and abs(ell[-1] - 222) <= 4 and abs(ell[1] - 74) <= 4 and len(ell) == 6
    assert len(T) == 6 and np.all(np.isfinite(T))
    cal = json.loads(calibration_file.read_text())
    assert (t["beta"], t["alpha"]) == (cal["beta"], cal["alpha"])
    print(f"live phase 2 (true L 30, P 134.5 M): L_hat {t['L_hat']:.1f} ({t['rule']}; basic {t['L_hat_basic']:.1f}, "
          f"Eq. 10 {t['L_hat_eq10']:.1f}), 90 % {t.get('L_interval')}, P_hat {t.get('P_hat')}, {t.get('P_interval')}, "
          f"T {np.round(T, 3)}, calibration q_L {cal['q_L_basic']}, {cal['q_L_eq10']}, prefill {cal['prefill']}")
    assert t["rule"] in ("basic", "eq10") and t["L_hat"] == t[f"L_hat{'_eq10' if t['rule'] == 'eq10' else '_basic'}"]
    if t["L_hat"] > 0:
        # the headline's 90 % interval holds it (an end is null where a reference had no fit: unbounded)
        lo, hi = t["L_interval"]
        assert (lo is None or lo <= t["L_hat"]) and (hi is None or t["L_hat"] <= hi)
        # P_hat_paper: Eq. 3 with the paper's default ratios (1/4, 3.5, untied), written out here from the paper;
        # SmolLM2 ties its embeddings and has d_ffn/d = 2.67, so even at the true L these ratios count 186.1 M (38 % too many)
        by_hand = 2 * 49152 * 576 + t["L_hat"] * (2 + 2 * 0.25 + 3 * 3.5) * 576**2 + (2 * t["L_hat"] + 1) * 576
        assert t["P_hat_paper"] == pytest.approx(by_hand, rel=1e-9) and t["vocab_size"] == 49152
        if "P_hat" in t:  # the attacker-side P_hat: the midpoint of the tied and untied totals, inside its interval
            tied, untied = t["P_tied_untied"]
            assert untied - tied == pytest.approx(49152 * 576, abs=1e-3) and t["P_hat"] == pytest.approx((tied + untied) / 2)
            assert (t["P_interval"][0] or 0) <= tied and untied <= (t["P_interval"][1] or np.inf)
        else:  # the references' prefill curves too noisy for a fit, or none left for the parameters at this L_hat
            assert t["note"].startswith("no attacker-side P_hat"), t
    else:
        assert "P_hat" not in t and "L_interval" not in t and t["note"].startswith("L_hat <= 0"), t
    # every timed call was paid and journaled once: a rerun replays them all (nothing sent) and, with the transfer
    # factor k = 2, reports exactly half the depth from the same timings (Eq. 9 and Eq. 10 divide by k beta)
    replay = run_attack(common + ["--timing-k", "2"])
    assert replay.returncode == 0, replay.stderr[-3000:]
    again = json.loads((out / "report.json").read_text())
    assert again["http"]["sent"] == 0 and again["timing"]["T"] == t["T"]
    assert again["timing"]["L_hat"] == pytest.approx(t["L_hat"] / 2, rel=1e-12)
    assert again["timing"]["L_hat_eq10"] == pytest.approx(t["L_hat_eq10"] / 2, rel=1e-12)
    assert again["timing"]["rule"] == t["rule"]  # chosen from the references' errors and the signs, which k keeps
    timed = 2 + 4 + 6 * 4  # warm-ups, the ell = 1 baseline's 4 trials, 6 lengths x 4 trials
    assert again["cost"]["paper"]["calls"] == report["cost"]["paper"]["calls"] == 4 * 8 + 4 + timed
    # phase 2 is in the plan and its budget check: phase 1's 38 requests fit a calls cap of 45, its 30 timed calls
    # do not, and nothing is sent (the cap stopped phase 2 half-way, after phase 1 had been paid for)
    timed_args = ["--timing-calibration", str(calibration_file), "--timing-d-hat", "576", "--context-length", "512"]
    dry = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out4", *timed_args, "--dry-run"))
    assert json.loads(dry.stdout.strip().splitlines()[-1])["phase2"]["requests"] == timed and "30 requests" in dry.stdout
    capped = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out4", *timed_args,
                                    "--budget-calls", "45"))
    assert capped.returncode == 2 and "with phase 2's 30 timed calls needs 68 calls > --budget-calls 45" in capped.stderr
    assert not (tmp_path / "out4").exists() or not (tmp_path / "out4" / "report.json").exists()
    # a tokens cap of phase 1's and phase 2's bills exactly is too small: the last timed call reserves twice the
    # longest prompt before its bill is known, so phase 2 could stop a call short after phase 1 was paid (a review:
    # 2 runs of 6); the check counts the reservation and refuses before anything is sent
    planned = json.loads(dry.stdout.strip().splitlines()[-1])
    bills, held = planned["tokens_billed"] + planned["phase2"]["tokens_billed"], planned["tokens_billed"] + planned["phase2"]["tokens_held"]
    assert held > bills
    assert f"phase 1's, with {held - bills:,} tokens more its last call reserves beyond its bill)\n" in dry.stdout
    tight = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out4", *timed_args,
                                   "--budget-tokens", str(bills)))
    assert tight.returncode == 2 and f"needs {held:,} tokens > --budget-tokens {bills:,}" in tight.stderr, tight.stderr[-2000:]
    # a context too short for App. D's sweep (p_max - 200) is refused before anything is paid; it used to give phase 2
    # a negative token bound, which widened the cap phase 1 ran under (a run paid past --budget-tokens)
    for short in ("100", "200"):
        proc = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out7", "--timing-calibration",
                                      str(calibration_file), "--context-length", short, "--budget-tokens", "10000"))
        assert proc.returncode == 2 and proc.stderr == (f"error: --context-length {short} leaves no room for App. D's sweep, "
                                                        "which stops 200 tokens short of the context: give the endpoint's "
                                                        "own context length (default 8192)\n"), proc.stderr[-2000:]
    assert not (tmp_path / "out7" / "journal.jsonl").exists()
    # adaptive rounds under a cap hold phase 2's share back: 70 calls would pay round 2 (phase 1 to N = 16: 70
    # requests), leaving nothing for phase 2; with its 30 held, the loop stops after round 1 (38) and phase 2 runs
    adaptive = yaml.safe_load(params.read_text())
    adaptive["sampling"].update(N="auto", N0=4, N_max=16, growth=2.0)
    (tmp_path / "adaptive.yaml").write_text(yaml.safe_dump(adaptive, allow_unicode=True, sort_keys=False))
    held = run_attack(attack_args(server.base_url, server.model_name, tmp_path / "adaptive.yaml", tmp_path / "out6",
                                  *timed_args, "--budget-calls", "70"))
    assert held.returncode == 0, held.stderr[-2000:]
    summary = json.loads(held.stdout)
    assert summary["adaptive_stop"].startswith("round 2 (N = 16, ") and summary["cost"]["provider"]["calls"] == 38 + timed
    assert summary["timing"]["L_hat"] is not None  # phase 2 ran to its end
    # its rerun replays every call (nothing sent) and counts the same §5 cost, though the finished rounds are not
    # asked again (their folders are reused): phase 1's cost comes from its sample, phase 2's from its timed calls
    again = run_attack(attack_args(server.base_url, server.model_name, tmp_path / "adaptive.yaml", tmp_path / "out6",
                                   *timed_args, "--budget-calls", "70"))
    assert again.returncode == 0, again.stderr[-2000:]
    replayed = json.loads(again.stdout)
    assert replayed["cost"]["paper"] == summary["cost"]["paper"] and replayed["cost"]["provider"] == summary["cost"]["provider"]
    # a phase 2 that fails (the server refuses a timed call) leaves phase 1's report whole, marked (it was overwritten
    # by a phase-1-only one, without its cost and endpoint)
    with FaultProxy(server.base_url, {40: "400"}) as proxy:  # past phase 1's 38 requests
        failed = run_attack(attack_args(proxy.url, server.model_name, params, tmp_path / "out5", *timed_args))
    assert failed.returncode == 2 and "refused the request: HTTP 400" in failed.stderr, failed.stderr[-2000:]
    partial = json.loads((tmp_path / "out5" / "report.json").read_text())
    assert partial["timing"]["note"].startswith("phase 2 did not finish") and partial["cost"]["provider"]["calls"] == 38
    assert {k: v for k, v in partial.items() if k not in ("timing", "cost", "http", "endpoint")} == {
        k: v for k, v in report.items() if k not in ("timing", "cost", "http", "endpoint")}
    # without a d_hat (tiny phase 1: not saturated) phase 2 says why instead of timing anything
    no_d = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out2", "--timing-calibration",
                                  str(calibration_file)))
    assert no_d.returncode == 0, no_d.stderr[-3000:]
    no_d_report = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert no_d_report["timing"] == {"note": "no d_hat from phase 1 (spectrum not saturated): phase 2 needs one"}
    assert no_d_report["saturated"] is False
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out3", "--timing-calibration", str(bad)))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "lacks" in proc.stderr


# -- nv defend: the defended proxy in front of the real server ---------------------------------------


@contextlib.contextmanager
def nv_defend(server, root, *knobs: str):
    """``nv defend`` (a real subprocess) in front of the llama.cpp server with ``--defence`` ``knobs``; yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "nv.cli", "defend", "--upstream", server.base_url.removesuffix("/v1"), "--port", str(port),
            "--params", str(root / "params.yaml")] + [a for knob in knobs for a in ("--defence", knob)]
    # its log (a line per request, on stdout) unread: a pipe nobody reads would fill and stall the proxy
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            proc.kill()
            pytest.fail(f"nv defend did not start: {proc.communicate()[1][-2000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture()
def defended(server, root):
    """``nv defend`` in front of the llama.cpp server, log-probs rounded to 1 decimal."""
    with nv_defend(server, root, "round_decimals=1") as url:
        yield url


def test_defended_proxy_rounds_what_the_attack_sees(baseline, defended, server, root, tmp_path):
    """The same request straight to the server and through the proxy: the same token, its log-prob rounded to one
    decimal. Then `nv attack --base-url` through the proxy: every log-prob it paid for (journal) is a multiple of 0.1,
    the undefended baseline's are not, and the report carries the rounded values' verdict."""
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "⠓ꦂ🜁ᚠ∰"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 0, "temperature": 2.0, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    plain = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    rounded = httpx.post(defended + "/v1/chat/completions", json=body, timeout=60).json()
    a, b = plain["choices"][0]["logprobs"]["content"][0], rounded["choices"][0]["logprobs"]["content"][0]
    assert a["token"] == b["token"] and b["logprob"] == round(a["logprob"], 1) and a["logprob"] != b["logprob"]

    params = write_params(root, tmp_path)
    proc = run_attack(attack_args(defended + "/v1", server.model_name, params, tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    def logprobs(out: Path) -> np.ndarray:
        values = []
        for line in (out / "journal.jsonl").read_bytes().splitlines()[1:]:
            entry = json.loads(line)
            values += [c[1] for c in entry.get("d", {}).get("c", []) if c[1] is not None] if "r" in entry else []
        return np.array(values)
    ours, theirs = logprobs(tmp_path / "out"), logprobs(baseline["out"])
    assert len(ours) >= 4 * 8 and np.allclose(ours, np.round(ours, 1), atol=1e-9)
    assert not np.allclose(theirs, np.round(theirs, 1), atol=1e-9)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["calls"] == baseline["report"]["calls"] and report["saturated"] is False


def test_defended_proxy_cuts_the_real_servers_top_list_and_refuses_a_logit_bias(server, root):
    """The llama.cpp server lists its whole head whatever its sampler truncates. Behind `nv defend --defence top_k=2`
    a request for 20 top log-probs gets back only the two tokens top-k keeps (the sampled one among them), and a logit
    bias, which would draw a token top-k hides with its log-prob, is refused."""
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "⠓ꦂ🜁ᚠ∰"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 20, "temperature": 2.0, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    plain = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    head = [t["token"] for t in plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
    with nv_defend(server, root, "top_k=2") as url:
        entry = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["content"][0]
        biased = httpx.post(url + "/v1/chat/completions", json=body | {"logit_bias": {"12869": 100}}, timeout=60)
    assert len(head) > 2 and [t["token"] for t in entry["top_logprobs"]] == head[:2] and entry["token"] in head[:2]
    assert biased.status_code == 400 and "'logit_bias' not passed on" in biased.json()["error"]["message"]


def test_defend_bad_arguments_are_one_line(server, capsys):
    for argv, message in ((["--upstream", "ftp://x", "--port", "9"], "--upstream must be an http(s) URL"),
                          (["--upstream", "http://[::1", "--port", "9"], "--upstream must be an http(s) URL"),
                          (["--upstream", "http://127.0.0.1:70000", "--port", "9"], "--upstream must be an http(s) URL"),
                          (["--upstream", server.base_url, "--port", "70000"], "--port must be in 1..65535"),
                          (["--upstream", server.base_url, "--port", "9", "--defence", "pad_to_tokens=64"], "pad_to_tokens needs"),
                          (["--upstream", server.base_url, "--port", "9", "--defence", "top_q=1"], "unknown --defence key 'top_q'")):
        assert main(["defend", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_adaptive_rounds_resume_after_kill_minus_9_without_paying_twice(server, root, tmp_path):
    """`sampling.N: auto` on the endpoint: rounds N = 4, 8, 16 (4 + 4 + 8 new calls per prompt). Killed mid-run, the
    rerun sends only what no finished request answered, each once, and reaches the uninterrupted run's result. A rerun
    under a calls cap of 40, which affords round 1 (38 requests in all) but not round 2, finishes the interrupted
    round 1: the requests of its unfinished shard already journaled are not counted against the cap again (they were,
    and the round was refused)."""
    params = yaml.safe_load(write_params(root, tmp_path).read_text())
    params["sampling"].update(N="auto", N0=4, N_max=16, growth=2.0)
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    requests = 2 + 4 + 4 * 16
    with FaultProxy(server.base_url) as proxy:
        whole = run_attack(attack_args(proxy.url, server.model_name, path, tmp_path / "whole"))
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert len(proxy.forwarded) == requests
    reference = json.loads((tmp_path / "whole" / "report.json").read_text())
    assert [r["N"] for r in reference["adaptive"]] == [4, 8, 16] and reference["N"] == 16
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, path, out)
        done = kill_after(args, journal, 25)
        # inside round 1's first shard (requests 23-30; round 1 is requests 23-38, two shards of 2 prompts x 4 calls)
        assert 25 <= len(done) < 30 and not (out / "report.json").exists()
        proxy.wait_idle()
        before = len(proxy.forwarded)
        capped = run_attack(args + ["--budget-calls", "40"])
        assert capped.returncode == 0, capped.stderr[-3000:]
        summary = json.loads(capped.stdout)
        assert summary["adaptive_stop"].startswith("round 2 (N = 16, ") and summary["cost"]["provider"]["calls"] == 38
        rerun = run_attack(args)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        resent = [request_key(b) for b in proxy.forwarded[before:]]
    assert not done & set(resent) and len(resent) == len(set(resent)) == requests - len(done)
    assert result(json.loads((out / "report.json").read_text())) == result(reference)


def test_adaptive_round_the_budget_cannot_finish_is_not_started(server, root, tmp_path):
    """A calls cap that affords rounds N = 4 and 8 but not the 8 more calls per prompt of N = 16: the loop stops
    before that round sends anything, says why on the console and in the report, and exits 0 with its best estimate;
    a failure that is not the budget's (a client error mid-round) still ends the run with that error."""
    params = yaml.safe_load(write_params(root, tmp_path).read_text())
    params["sampling"].update(N="auto", N0=4, N_max=16, growth=2.0)
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    two_rounds = 2 + 4 + 4 * 8  # probes, search, 8 calls per prompt
    with FaultProxy(server.base_url) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, path, tmp_path / "out", "--budget-calls", "50"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(proxy.forwarded) == proxy.posts == two_rounds  # nothing of the round that could not finish
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["N"] for r in report["adaptive"]] == [4, 8] and report["N"] == 8
    assert report["adaptive_stop"].startswith("round 2 (N = 16, ") and "would pass the calls cap of 50" in report["adaptive_stop"]
    assert json.loads(proc.stdout)["adaptive_stop"] == report["adaptive_stop"]  # stdout: the JSON summary alone
    with FaultProxy(server.base_url, {two_rounds - 3: "400"}) as proxy:  # a request of round 1
        proc = run_attack(attack_args(proxy.url, server.model_name, path, tmp_path / "out2"))
    assert proc.returncode == 2 and "refused the request: HTTP 400" in proc.stderr and "not affordable" not in proc.stderr
    assert not (tmp_path / "out2" / "report.json").exists()
