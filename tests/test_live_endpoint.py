"""The live endpoint (issue 6) against a real llama.cpp server on 127.0.0.1 serving the embedded GGUF:
the HTTP oracle agrees with the simulator, `nv attack --base-url` runs end to end, faults and a
kill -9 change nothing in the result, nothing completed is paid twice, bad input costs nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from faultproxy import FaultProxy
from nv.cli import main
from nv.errors import NVError
from nv.oracle.journal import Journal, request_key
from nv.live import binding
from nv.models.llama_server import LlamaServer, free_port
from nv.oracle.http import HTTPOracle

NV = [sys.executable, "-m", "nv.cli", "attack"]
TINY_LIVE = {"search": {"D": 4, "rounds": 1, "batch_size": 4}, "sampling": {"N": 8, "chunk": 2},
             "live": {"concurrency": 2, "timeout": 30, "backoff": 0.05, "retries": 6}}
REQUESTS = 2 + 4 + 4 * 8  # probe + search + D x N, one sample per request (llama.cpp ignores n)


@pytest.fixture(scope="module")
def server():
    with LlamaServer("embedded", n_ctx=512, n_threads=2) as s:
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


def run_attack(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
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


# -- nv attack --base-url ---------------------------------------------------------------------


def test_attack_end_to_end_reports_not_saturated_at_a_tiny_budget(baseline, server):
    report = baseline["report"]
    assert report["model"] == server.model_name and report["D"] == 4 and report["N"] == 8
    assert not report["saturated"] and report["reason"] == "not saturated"
    assert report["d_hat"] is None and report["d_hat_raw"] is None and report["lower_bound"] >= 0
    assert report["calls"] == 4 * 8 + 4 == report["cost"]["paper"]["calls"]
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
    # one sample per request: prompt tokens once per request (provider) = once per sample (§5), probe aside
    assert provider["prompt_tokens"] == report["tokens"] - report["calls"] + probe_prompt_tokens
    assert len(set(keys)) == len(keys)  # no request sent twice
    assert sorted(journal_keys(baseline["out"] / "journal.jsonl")) == sorted(keys)  # every paid reply journaled
    assert all(b["max_tokens"] == 1 and b["logprobs"] is True and b["top_logprobs"] == 0 for b in baseline["forwarded"])
    assert (baseline["out"] / "spectrum.png").stat().st_size > 10_000
    assert json.loads(baseline["stdout"].strip().splitlines()[-1])["saturated"] is False


def test_dry_run_plans_the_calls_the_attack_made_and_sends_nothing(baseline, server, root, tmp_path):
    with FaultProxy(server.base_url) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, baseline["params"], tmp_path / "o", "--dry-run"))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["requests"] == REQUESTS and plan["sampling_calls"] == 32 and proxy.posts == 0
    assert "tokens (§5)" in proc.stdout and not (tmp_path / "o").exists()


def test_faults_change_nothing_in_the_result(baseline, server, root, tmp_path):
    faults = {3: "429", 6: "500", 9: "timeout", 12: "truncate", 15: "reset", 24: "500", 25: "429"}
    params = write_params(root, tmp_path, timeout=5)
    with FaultProxy(server.base_url, faults, hold=6) as proxy:
        proc = run_attack(attack_args(proxy.url, server.model_name, params, tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert result(report) == result(baseline["report"])
    assert report["http"]["retries"] >= len(faults) and report["http"]["sent"] == REQUESTS
    keys = [request_key(b) for b in proxy.forwarded]
    assert set(keys) == {request_key(b) for b in baseline["forwarded"]}  # the same questions, only retried


def test_kill_minus_9_then_resume_pays_nothing_twice(baseline, server, tmp_path):
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, baseline["params"], out)
        proc = subprocess.Popen(NV + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while (not journal.exists() or len(journal_keys(journal)) < 20) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
        done = set(journal_keys(journal))
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


def test_budget_cap_stops_before_overspending_and_a_raised_budget_resumes(baseline, server, root, tmp_path):
    """The plan under-estimates prompt tokens (live.prompt_tokens: 1), so only the in-flight cap can stop the run."""
    params = write_params(root, tmp_path, prompt_tokens=1)
    cap = baseline["report"]["cost"]["provider"]["tokens"] // 2
    out = tmp_path / "out"
    with FaultProxy(server.base_url) as proxy:
        args = attack_args(proxy.url, server.model_name, params, out)
        stopped = run_attack(args + ["--budget-tokens", str(cap)])
        assert stopped.returncode == 2 and stopped.stderr.startswith("error: budget reached")
        assert len(stopped.stderr.strip().splitlines()) == 1 and "Traceback" not in stopped.stderr
        journal = Journal(out / "journal.jsonl", binding(proxy.url, server.model_name, _load(params)))
        spent, requests = journal.prompt_tokens + journal.output_tokens, journal.requests
        journal.close()
        assert spent <= cap and requests == len(proxy.forwarded) > 0  # under the cap, every paid reply kept
        resumed = run_attack(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(proxy.forwarded) == REQUESTS  # nothing paid twice across the two runs
    assert result(json.loads((out / "report.json").read_text())) == result(baseline["report"])


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


def test_bad_input_is_one_line_and_costs_nothing(server, root, tmp_path, capsys):
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
    with LlamaServer("embedded", n_ctx=256, logprobs=False) as plain, FaultProxy(plain.base_url) as proxy:
        few = write_params(root, tmp_path, name="few-retries.yaml", retries=1)
        err = _error(capsys, attack_args(proxy.url, plain.model_name, few, tmp_path / "o-plain"))
        assert "logprobs is not supported" in err and not proxy.forwarded  # HTTP 500 each time: nothing paid

    journal_path = tmp_path / "other.jsonl"
    with FaultProxy(server.base_url) as proxy:
        Journal(journal_path, binding(proxy.url, name, _load(params))).close()
        other = write_params(root, tmp_path, name="other.yaml")
        text = other.read_text().replace("  N: 8\n", "  N: 9\n")
        other.write_text(text)
        err = _error(capsys, attack_args(proxy.url, name, other, tmp_path / "o2", "--journal", str(journal_path)))
        assert "belongs to another attack (sampling.N was 8, now 9)" in err
        err = _error(capsys, attack_args(server.base_url, name, params, tmp_path / "o3", "--journal", str(journal_path)))
        assert "belongs to another attack (endpoint was" in err
        assert proxy.posts == 0


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
    assert set(j.responses) == {"k1", "k2"} and j.columns == {"s:a": 0, "s:b": 1}
    assert (j.requests, j.prompt_tokens, j.output_tokens) == (2, 12, 2)
    with pytest.raises(NVError, match="in use by another process"):
        Journal(path, {"endpoint": "e"})
    j.close()
    assert path.read_bytes() == whole  # truncated back to the last whole line
    lines = whole.split(b"\n")
    path.write_bytes(b"\n".join(lines[:1] + [b"{broken"] + lines[2:]))
    with pytest.raises(NVError, match="line 2 is corrupt"):
        Journal(path, {"endpoint": "e"})
    with pytest.raises(NVError, match=r"belongs to another attack \(endpoint was 'e', now 'f'\)"):
        path.write_bytes(whole)
        Journal(path, {"endpoint": "f"})


def test_dry_run_theory_is_theorem_1_inverted():
    """The dry run's guaranteed |C| is the largest d whose Theorem 1 sample bound the planned N meets."""
    from nv.live import guaranteed_common_size
    from nv.theory.sample_complexity import theorem1_samples

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


CALIBRATION = {"platform": "inprocess", "beta": 1e-9, "alpha": 0.0, "gamma_ref": 2e-8, "r": 0.01, "trials": 2, "warmups": 2,
               "trim": 0.0, "n_lengths": 4, "discard": 1, "kv_ratio": 0.25, "ffn_ratio": 3.5}


def test_phase2_on_the_endpoint_from_a_calibration(server, root, tmp_path):
    """`--timing-calibration`: after phase 1 the endpoint is timed on the sweep of d_hat and L_hat (§4.2
    basic estimator, Eq. 9) and gamma_g / (k beta) (Eq. 10) are reported from those timings; without
    d_hat it says why not."""
    from nv.phase2.fit import attention_regime, depth_basic, fit_gamma, total_params

    cal_path = tmp_path / "calibration.json"
    cal_path.write_text(json.dumps(CALIBRATION))
    params = write_params(root, tmp_path)
    out = tmp_path / "out"
    args = attack_args(server.base_url, server.model_name, params, out, "--timing-calibration", str(cal_path))
    proc = run_attack(args + ["--timing-d-hat", "576", "--timing-k", "2", "--vocab-size", "49152"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = json.loads((out / "report.json").read_text())["timing"]
    assert t["d_hat"] == 576 and t["k"] == 2 and t["trials"] == 2 and len(t["lengths"]) >= 4
    ell, T, sigma = attention_regime(np.array(t["lengths"]), np.array(t["T"]), np.array(t["sigma"]), 1)
    gamma = fit_gamma(np.full(len(ell), 576.0), ell, T, sigma).slope
    assert t["gamma_g"] == pytest.approx(gamma) and t["L_hat_eq10"] == pytest.approx(gamma / (2 * 1e-9))
    assert t["L_hat"] == pytest.approx(depth_basic(2 * 1e-9, 0.0, 576, ell, T, sigma))
    if t["L_hat"] > 0:
        assert t["P_hat"] == pytest.approx(total_params(576, t["L_hat"], 49152))
    no_d = run_attack(attack_args(server.base_url, server.model_name, params, tmp_path / "out2", "--timing-calibration", str(cal_path)))
    assert no_d.returncode == 0, no_d.stderr[-3000:]
    assert "not saturated" in json.loads((tmp_path / "out2" / "report.json").read_text())["timing"]["note"]
    cal_path.write_text("{}")
    bad = run_attack(args)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "lacks" in bad.stderr
