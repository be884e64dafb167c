"""`nv attack --simulate`: the whole phase 1 from the command line, on the real embedded model."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from conftest import write_tiny_params
from nv.errors import NVError, run_main
from nv.phase1.planner import disk_bytes, fit
from nv.phase1.sampling import load_samples

NV = [sys.executable, "-m", "nv.cli"]
SEARCH = {"D": 40, "rounds": 1, "batch_size": 48}  # the tiny params' search cut to a third: two runs, ~2 min each here


def small_params(root, tmp_path, **sampling):
    """The tiny params with 40 prompts from one search round (and ``sampling`` overrides)."""
    path = write_tiny_params(root, tmp_path)
    params = yaml.safe_load(path.read_text())
    params["search"].update(SEARCH)
    params["sampling"].update(sampling)
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    return path


def test_attack_simulate_writes_report_and_says_not_saturated_at_a_tiny_budget(root, tmp_path):
    params = small_params(root, tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(NV + ["attack", "--simulate", "embedded", "--params", str(params), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "embedded" and report["d_true"] == 576 and report["D"] == 40
    assert report["N"] == 5000 and report["calls"] == 40 * 5000 + 48
    assert not report["saturated"] and report["reason"] == "not saturated"
    assert report["d_hat"] is None and 0 <= report["lower_bound"] <= 576  # a bound, never a confident number
    assert report["common_set_size"] < 576
    assert (out / "spectrum.png").stat().st_size > 10_000
    assert json.loads(proc.stdout.strip().splitlines()[-1])["saturated"] is False
    # this run's draws as the pilot of a planned attack (the dry run bills nothing; an endpoint that does not answer its
    # free GET /models is said in the plan, which stands: an auditor may plan before the endpoint is reachable)
    planned = ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--params", str(params), "--dry-run"]
    dry = subprocess.run(NV + planned + ["--pilot", str(out / "samples")], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    planned_json = json.loads(dry.stdout.strip().splitlines()[-1])
    assert planned_json["endpoint_error"].startswith("cannot reach http://127.0.0.1:9/v1/models: ConnectError")
    assert "  endpoint          GET /models (free): cannot reach" in dry.stdout and "the attack would stop there" in dry.stdout
    # a budget below the plan: the plan, then the refusal, with no look at the endpoint first
    small = subprocess.run(NV + planned + ["--budget-calls", "10"], capture_output=True, text=True, timeout=300)
    assert small.returncode == 2 and small.stderr.startswith("error: budget too small") and "GET /models" not in small.stdout
    assert "  prompt search" in small.stdout
    pilot = planned_json["pilot"]
    assert (pilot["D0"], pilot["N0"]) == (40, 5000) and "planner (pilot)" in dry.stdout
    # drawn from a simulated model, not from the endpoint planned: said, as its prompt tokens and tail are that model's
    assert pilot["source"] == "simulated model 'embedded'" and "NOTE: the pilot was drawn from a simulated model" in dry.stdout
    drawn = load_samples(out / "samples")  # its replies measured the prompt tokens per call: the plan's costs use them
    assert planned_json["prompt_tokens_per_call"] == round(float(drawn.prompt_tokens.mean())) != 45
    assert f"prompt ~ {planned_json['prompt_tokens_per_call']} tokens (measured by the pilot)" in dry.stdout
    tail = fit(drawn, 3)
    for size, cost in pilot["common_set"].items():
        N = tail.samples_for(int(size), 40, N_max=1e8)  # the plan is for the params' D = 40 prompts
        assert (cost is None) == (N is None) and (cost is None or cost["N"] == math.ceil(N)), (size, cost, N)
        assert cost is None or cost["disk"] == disk_bytes(tail, 40, [cost["N"]])["sample"]  # the sample's bytes there
    assert pilot["disk"] == disk_bytes(tail, 40, [5000]) and "  disk (pilot)      the sample at N = 5,000: ~" in dry.stdout
    volume, = planned_json["disk_free"]  # --out (not given: ./attack-out) and its journal in it: one volume
    assert volume["writes"] == {"journal": planned_json["journal_bytes"]["disk"], "sample": pilot["disk"]["peak"]}
    assert volume["fits"] and "  disk free         ~" in dry.stdout and "WARNING" not in dry.stdout
    # N = 10^12 plans a journal of ~5 PB: more than any volume here holds, said before anything is paid
    huge = yaml.safe_load(params.read_text())
    huge["sampling"]["N"] = 10**12
    (tmp_path / "huge.yaml").write_text(yaml.safe_dump(huge, allow_unicode=True, sort_keys=False))
    big = subprocess.run(NV + planned[:-2] + [str(tmp_path / "huge.yaml"), "--dry-run", "--out", str(tmp_path / "new" / "o")],
                         capture_output=True, text=True, timeout=300)
    assert big.returncode == 0, big.stderr[-2000:]
    volume, = json.loads(big.stdout.strip().splitlines()[-1])["disk_free"]
    assert volume["path"] == str(tmp_path) and not volume["fits"]  # the nearest folder that exists
    now = shutil.disk_usage(tmp_path)  # the other tests write beside it: the same volume's free space, roughly
    assert abs(volume["free"] - now.free) < 0.1 * now.total
    assert f"at {tmp_path}, for the journal (~" in big.stdout and "WARNING, not enough" in big.stdout
    Ns = [c["N"] for c in pilot["common_set"].values() if c]
    assert Ns and Ns == sorted(Ns) and Ns[0] > 5000  # the pilot's own 5000 calls share fewer than 512 tokens
    alone = subprocess.run(NV + planned[:-1] + ["--pilot", str(out / "samples")], capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and alone.stderr.strip() == "error: --pilot goes with --dry-run (it plans a run, it does not start one)"
    missing = subprocess.run(NV + planned + ["--pilot", str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no sampling manifest in" in missing.stderr and "Traceback" not in missing.stderr
    whole = subprocess.run(NV + planned + ["--pilot", str(out)], capture_output=True, text=True, timeout=300)
    assert whole.stderr.strip() == f"error: --pilot {out} is an attack's output folder: give its draws, {out / 'samples'}"
    colder = yaml.safe_load(params.read_text())
    colder["sampling"]["temperature"] = 1.0
    (tmp_path / "colder.yaml").write_text(yaml.safe_dump(colder, allow_unicode=True, sort_keys=False))
    other = subprocess.run(NV + planned[:-2] + [str(tmp_path / "colder.yaml"), "--dry-run", "--pilot", str(out / "samples")],
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "a pilot predicts only its own temperature" in other.stderr


def test_attack_simulate_adaptive_rounds_stop_at_n_max_with_a_lower_bound(root, tmp_path):
    """sampling.N: auto on the real model, N_max far below saturation: rounds 1000, 2000, 2500 (nested draws), each
    estimated, the run ends at N_max not saturated, and the report carries every round."""
    params_path = small_params(root, tmp_path, N="auto", N0=1000, N_max=2500, growth=2.0)
    out = tmp_path / "out"
    proc = subprocess.run(NV + ["attack", "--simulate", "embedded", "--params", str(params_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert [r["N"] for r in report["adaptive"]] == [1000, 2000, 2500] and report["adaptive_stop"] == "N_max"
    assert report["N"] == 2500 and report["calls"] == 40 * 2500 + 48 and not report["saturated"]
    assert report["adaptive"][-1]["lower_bound"] == report["lower_bound"] and report["adaptive"][-1]["C"] == report["common_set_size"]
    assert all(a["C"] <= b["C"] + 3 for a, b in zip(report["adaptive"], report["adaptive"][1:]))  # the common set grows with N
    # the rounds and the stop go to stderr beside the bars; stdout is the JSON summary alone, with why it stopped
    assert "round 2: N = 2,500" in proc.stderr and "round 2" not in proc.stdout
    assert json.loads(proc.stdout)["adaptive_stop"] == "N_max"
    # the round a rerun draws: round 2 (2,000 -> 4,000, cut at 2,500) again at its own size (it named 5,000)
    assert re.search(r"stopped: N_max = 2,500 reached, the estimate not yet stable; the next round \(N = 4,000\) would "
                     r"cost [\d.e+]+ more tokens \(§5\); round 2 is drawn again at that size .*: raise sampling.N_max to "
                     r"at least 4,000", proc.stderr), proc.stderr[-1000:]
    rounds = {p: p.stat().st_mtime_ns for p in (out / ".checkpoints").rglob("*.npz")}  # every round's draws
    sample = {p: p.read_bytes() for p in (out / "samples").glob("*.npz")}  # the merged sample, rewritten from them
    quiet = subprocess.run(NV + ["attack", "--simulate", "embedded", "--params", str(params_path), "--out", str(out),
                                 "--quiet"], capture_output=True, text=True, timeout=900)  # resumes: nothing drawn again
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["adaptive_stop"] == "N_max" and "round" not in quiet.stderr
    assert rounds and {p: p.stat().st_mtime_ns for p in (out / ".checkpoints").rglob("*.npz")} == rounds
    assert sample and {p: p.read_bytes() for p in (out / "samples").glob("*.npz")} == sample


def test_an_adaptive_dry_run_sizes_the_journal_for_the_last_round_a_cap_affords(root, tmp_path):
    """The shipped params (N: auto up to N_max = 10^6) under a money cap: the rounds past the cap are marked, and the
    journal (and its volume's check) is sized for the last round the cap lets run; it was N_max's ~372 GiB, with a
    "not enough" warning for a run the cap stops at a sixth of it (a review, 2026-12-07). Without a cap, N_max's."""
    from nv.live import JOURNAL_BYTES

    planned = NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--params", str(root / "params.yaml"),
                    "--dry-run", "--out", str(tmp_path / "o"), "--price-per-mtok", "0.2"]
    plans = {}
    for cap in ([], ["--budget-money", "5000"]):
        dry = subprocess.run(planned + cap, capture_output=True, text=True, timeout=300)
        assert dry.returncode == 0, dry.stderr[-2000:]
        plans[bool(cap)] = (json.loads(dry.stdout.strip().splitlines()[-1]), dry.stdout)
    (free, _), (capped, text) = plans[False], plans[True]
    assert free["sized_N"] == free["N"] == 10**6 and free["journal_bytes"]["disk"] == JOURNAL_BYTES["disk"] * free["requests"]
    last = max(i for i, r in enumerate(capped["rounds"]) if r["money"] <= 5000)
    assert 0 < last < len(capped["rounds"]) - 1 and capped["sized_N"] == capped["rounds"][last]["N"] < capped["N"]
    assert capped["journal_bytes"]["disk"] == JOURNAL_BYTES["disk"] * capped["rounds"][last]["requests"]
    assert capped["disk_free"][0]["writes"]["journal"] == capped["journal_bytes"]["disk"]
    assert f"to N = {capped['sized_N']:,}, the last round the budget affords" in text and "the run stops before this round" in text


def test_attack_errors_are_one_line_without_traceback(root, tmp_path):
    params = write_tiny_params(root, tmp_path)
    folder_gguf = tmp_path / "model.gguf"
    folder_gguf.mkdir()
    cases = [
        (["--simulate", "embedded", "--params", str(params), "--out", "/proc/nv-out"], "not writable"),
        (["--simulate", "/no/such/model.gguf", "--params", str(params), "--out", str(tmp_path / "o")], "GGUF file not found"),
        (["--simulate", "embedded", "--params", str(tmp_path / "absent.yaml")], "params file not found"),
        (["--simulate", "embedded", "--params", str(tmp_path)], "cannot be read: Is a directory"),
        (["--simulate", "embedded", "--params", str(params), "--out", str(params)], "is a file: give a folder"),
        (["--base-url", "http://127.0.0.1:abc/v1", "--model", "x", "--params", str(params), "--out", str(tmp_path / "u")],
         "the port must be a number in 1-65535"),
        (["--base-url", "http://127.0.0.1:9/v1?x=1", "--model", "x", "--params", str(params), "--out", str(tmp_path / "q")],
         "must not carry a query or fragment"),
        (["--base-url", "http://127.0.0.1:70000/v1", "--model", "x", "--params", str(params), "--out", str(tmp_path / "p")],
         "the port must be a number in 1-65535"),
        (["--base-url", "http://", "--model", "x", "--params", str(params), "--out", str(tmp_path / "h")], "names no host"),
        (["--base-url", "127.0.0.1:9/v1", "--model", "x", "--params", str(params), "--out", str(tmp_path / "s")],
         "must start with http:// or https://"),
        (["--simulate", str(tmp_path), "--params", str(params)], "has no config.json"),
        (["--simulate", str(folder_gguf), "--params", str(params)], "is a folder, not a GGUF file"),
        (["--simulate", str(tmp_path / "no-such-model"), "--params", str(params)], "no such file or folder"),
        (["--simulate", "", "--params", str(params)], "no such file or folder"),
        # options of a live endpoint given to a simulated attack, or phase 2's without its calibration: refused before
        # anything is loaded (a --dry-run of a simulation used to start the whole attack)
        (["--simulate", "embedded", "--dry-run", "--budget-tokens", "1000", "--params", str(params)],
         "--budget-tokens, --dry-run: apply to --base-url only"),
        (["--simulate", "embedded", "--journal", "j.jsonl", "--params", str(params)], "--journal: applies to --base-url only"),
        # a timing defence on an attack that times nothing: refused, not recorded as applied
        (["--simulate", "embedded", "--defence", "delay_uniform_ms=1e5", "--params", str(params), "--out", str(tmp_path / "t")],
         "defence delay_uniform_ms: a timing defence, and a simulated attack times nothing"),
        (["--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--timing-k", "2", "--params", str(params), "--dry-run"],
         "--timing-k: phase 2's options, they need --timing-calibration FILE"),
    ]
    for args, message in cases:
        proc = subprocess.run(NV + ["attack", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith("error:") and message in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()  # the refused timing defence left no empty --out behind (a review, 2026-12-07)
    elsewhere = tmp_path / "elsewhere"  # outside the project: no params.yaml
    elsewhere.mkdir()
    proc = subprocess.run(NV + ["attack", "--simulate", "embedded"], capture_output=True, text=True, timeout=300, cwd=elsewhere)
    assert proc.returncode == 2 and proc.stderr == ("error: no params.yaml in the current folder: run from the project "
                                                    "root or give --params PATH\n"), proc.stderr
    # nv defend needs none: its knobs can all come from --defence (it refused to start before); here it gets as far
    # as the upstream's check
    proc = subprocess.run(NV + ["defend", "--upstream", "ftp://x", "--port", "9", "--defence", "round_decimals=1"],
                          capture_output=True, text=True, timeout=300, cwd=elsewhere)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --upstream must be an http(s) URL"), proc.stderr
    proc = subprocess.run(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--budget-tokens", "inf"],
                          capture_output=True, text=True, timeout=300)  # argparse's own usage line, then the reason
    assert proc.returncode == 2 and proc.stderr.strip().endswith("must be a whole number >= 0, got inf") and "Traceback" not in proc.stderr
    proc = subprocess.run(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--budget-money", "1e999",
                                "--price-per-mtok", "1"], capture_output=True, text=True, timeout=300)  # was an infinite cap
    assert proc.returncode == 2 and proc.stderr.strip().endswith("must be a finite number >= 0, got 1e999"), proc.stderr
    proc = subprocess.run(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--budget-tokens", "abc"],
                          capture_output=True, text=True, timeout=300)  # not "invalid _count value"
    assert proc.returncode == 2 and proc.stderr.strip().endswith("--budget-tokens: must be a number, got 'abc'"), proc.stderr
    for k in ("0", "nan", "-1"):  # read with the arguments, not after phase 1 has paid for its calls
        proc = subprocess.run(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--timing-k", k],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.strip().endswith(f"must be a finite number > 0, got {k}"), proc.stderr
    for flag in ("--timing-d-hat", "--vocab-size", "--context-length"):  # 0 is no size (--timing-d-hat 0 read as "phase 1's")
        proc = subprocess.run(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "x", flag, "0"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.strip().endswith(f"{flag}: must be a whole number >= 1, got 0"), proc.stderr


def test_a_busy_output_folder_a_bad_model_folder_and_a_dry_run_s_odd_journal_are_one_line(root, tmp_path, lm32):
    """A review (2026-12-07): a second `--simulate` on a busy --out crashed mid-write, a model folder whose config
    contradicts itself or whose safetensors are damaged gave transformers' or safetensors' traceback, and a dry run
    planned over a journal path the run refuses (a folder). Each is one line and exit 2 now, before anything runs."""
    import fcntl
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    params = write_tiny_params(root, tmp_path)
    busy = tmp_path / "busy"
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY)  # another attack's lock on the folder
    fcntl.flock(fd, fcntl.LOCK_EX)
    model = tmp_path / "tiny-llama"  # a real model folder, then damaged two ways
    config = LlamaConfig(vocab_size=lm32.arch.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(model)
    lm32.tokenizer.save_pretrained(model)
    heads, weights, more, fewer = (tmp_path / name for name in ("heads", "weights", "more", "fewer"))
    spec = json.loads((model / "config.json").read_text())
    for folder, change in ((heads, {"num_attention_heads": 7}), (weights, {}), (more, {"num_hidden_layers": 3}),
                           (fewer, {"num_hidden_layers": 1})):  # 64 is no multiple of 7; layers the weights lack, or hold
        shutil.copytree(model, folder)
        (folder / "config.json").write_text(json.dumps(spec | change))
    (weights / "model.safetensors").write_bytes(os.urandom(4096))
    cache = tmp_path / "cache-file"  # $NV_CACHE naming a file: the Qwen model cannot be assembled there
    cache.write_text("")
    try:
        for args, message in (
                (["--simulate", "embedded", "--out", str(busy)], f"output folder {busy} is in use by another nv attack"),
                (["--simulate", str(heads)], f"cannot load model '{heads}': "),
                (["--simulate", str(weights)], f"cannot load model '{weights}': "),
                # random weights for a layer the file lacks, or a layer left out, were loaded silently before
                (["--simulate", str(more)], f"model '{more.resolve()}' has no weights for 9 parameter(s) (model.layers.2."),
                (["--simulate", str(fewer)], f"model '{fewer.resolve()}' holds weights its config has no place for: 9 "),
                (["--simulate", "qwen2.5-coder-0.5b"], f"cannot write the model cache {cache}/packaged ("),
                (["--base-url", "http://127.0.0.1:9/v1", "--model", "x", "--dry-run", "--journal", str(tmp_path)],
                 f"journal {tmp_path} is not a regular file")):
            proc = subprocess.run(NV + ["attack", *args, "--params", str(params), "--quiet"], capture_output=True, text=True,
                                  timeout=300, cwd=tmp_path, env=os.environ | {"NV_CACHE": str(cache)} if "qwen" in args[1]
                                  else None)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            *report, line = proc.stderr.strip().splitlines()  # transformers' load report, where the weights differ
            assert not report or args[1] in (str(more), str(fewer)) and "LOAD REPORT" in report[0], proc.stderr
            assert line.startswith("error: ") and message in line, line
    finally:
        os.close(fd)
    assert not (heads / "report.json").exists() and not list(busy.iterdir())  # nothing written


def test_a_path_of_the_wrong_kind_is_one_line(tmp_path, capsys):
    """What a rerun over an earlier output folder can meet (report.json turned into a folder, samples/ into a file):
    the path and the reason in one line, exit 2, where a traceback came before."""
    (tmp_path / "report.json").mkdir()
    (tmp_path / "samples").write_text("")
    for work, path in ((lambda: (tmp_path / "report.json").write_text("{}"), "report.json"),
                       (lambda: shutil.rmtree(tmp_path / "samples"), "samples")):
        assert run_main(work) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and err.rstrip().endswith(path)


def test_free_space_is_read_at_the_nearest_folder(tmp_path):
    """A journal that exists is a file: the free space is its folder's (the line named the file; a review); a path not
    made yet, its nearest existing folder's."""
    from nv.live import disk_check

    journal = tmp_path / "j.jsonl"
    journal.write_text("")
    (volume,) = disk_check([("journal", journal, 10), ("sample", tmp_path / "new" / "samples", 20)])
    assert volume["path"] == str(tmp_path) and volume["writes"] == {"journal": 10, "sample": 20} and volume["fits"]


def test_a_reader_that_leaves_ends_the_output_quietly(root):
    """`nv attack --dry-run | head`: the plan's reader gone, the command ends with SIGPIPE's status 141 and nothing on
    stderr (a BrokenPipeError traceback before; a review). The pipe is closed before the child writes."""
    proc = subprocess.Popen(NV + ["attack", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--dry-run",
                                  "--params", str(root / "params.yaml")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", err


SLOW_TEARDOWN = """
import signal, sys, time
from nv.errors import NVError, run_main

class Slow:
    def __del__(self):  # as a progress bar's finalizer, freed with the interrupted frame
        print("finalizing", flush=True)
        time.sleep(30)

def work():
    held = Slow()
    raise KeyboardInterrupt

status = run_main(work)
print("returned", status, signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
"""


def test_a_second_ctrl_c_while_the_interrupted_work_is_freed_ends_the_process_without_a_traceback(tmp_path):
    """After a Ctrl-C (exit 130), another one while the interrupted work's objects are finalized ends the process at
    once (it used to land in a finalizer: "Exception ignored in ... tqdm.__del__" and a traceback); a run that is not
    interrupted again returns 130 with Python's own Ctrl-C handling restored."""
    script = tmp_path / "slow_teardown.py"
    script.write_text(SLOW_TEARDOWN.replace("time.sleep(30)", "time.sleep(30 if 'again' in sys.argv else 0)"))
    # Python's own Ctrl-C handling in the child whatever started the tests (a shell's background job ignores SIGINT,
    # and a child inherits that: tests/test_live_endpoint.py)
    default = dict(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc = subprocess.Popen([sys.executable, str(script), "again"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **default)
    assert proc.stdout.readline() == "finalizing\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT and "returned" not in out, (out, err)
    assert err == "interrupted: finished work is checkpointed; rerun the same command to resume\n"
    once = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, **default)
    assert once.stdout.splitlines() == ["finalizing", "returned 130 True"] and "Traceback" not in once.stderr


def test_a_pilot_too_small_to_check_is_refused_and_the_plan_adds_both_phases(root, tmp_path):
    """An auditor's review (2026-12-07): a pilot of 12 prompts x 100 calls planned "beyond N = 1e8" for every |C| and a
    sample of ~1 MiB at N = 10^6 (the README's own figures put it in GB), its raw log-probs never checked, since
    under 20 of its entries are drawn often enough to check them. Such a pilot is refused in one line. The plan's
    Theorem 1 line is at the N a cap lets the run reach, phase 2's cost is added to phase 1's in one line, and k = 1
    left at its default is said."""
    from nv.live import plan, format_plan
    from nv.oracle.http import Budget
    from nv.params import load_params
    from nv.phase1.planner import MIN_CHECKED, draws_over_expected
    from nv.phase1.sampling import collect
    from synthetic import LowRankOracle

    params = load_params(write_tiny_params(root, tmp_path), ["seed", "search", "sampling", "live", "planner"])
    tau = params["sampling"]["temperature"]
    folder = collect(LowRankOracle(rank=8, vocab=4000), [f"p{q}" for q in range(12)], 100, tau, 0, tmp_path / "pilot",
                     4000, tmp_path / "ck", {"toy": 1}, progress=False)
    assert draws_over_expected(load_samples(folder))[1] < MIN_CHECKED
    with pytest.raises(NVError, match=r"^the pilot in .* \(12 prompts x 100 calls\) is too small to plan from: \d+ of its "
                                      r"entries .* \(20 needed\); draw a few hundred prompts x 10\^4 calls"):
        plan(params, Budget(None, None, None, None), folder)
    # a calibration's protocol fields (a fresh clone has no outputs/timing_fit: the stages make it)
    calibration = {"platform": "inprocess", "r": 0.1, "trials": 10, "warmups": 3, "n_lengths": 24, "discard": 12,
                   "kv_ratio": 0.25, "ffn_ratio": 3.5}
    timing = {"calibration": calibration, "k": 1.0, "vocab_size": None, "p_max": 8192, "d_hat": 576, "k_given": False}
    budget = Budget(None, 5_000_000, None, 0.2)  # a call cap that stops the adaptive rounds short of N_max
    p = plan(params | {"sampling": {**params["sampling"], "N": "auto", "N0": 1000, "N_max": 64_000, "growth": 2.0}},
             budget, None, None, timing)
    text = format_plan(p, params, "m", "http://x/v1", budget, timing)
    assert p["sized_N"] < 64_000 and f"at N = {p['sized_N']:,}, |C| >= d" in text
    both = p["requests"] + p["phase2"]["requests"]
    assert f"  both phases       {both:,} requests, {p['tokens_billed'] + p['phase2']['tokens_billed']:,} billed tokens" in text
    assert "NOTE: k = 1 (--timing-k not given): phase 2's calibration was timed on platform 'inprocess'" in text
    assert "e+" not in text  # thousands separators, not 1.22e+03 requests
    assert "k = 2 (--timing-k)" in format_plan(p, params, "m", "http://x/v1", budget, timing | {"k": 2.0, "k_given": True})


def test_the_outcome_in_words_names_the_common_set_and_what_to_do():
    from nv.cli import headline, summary
    from nv.phase1.spectrum import d_interval

    record = {"model": "m", "estimator": "robust", "saturated": False, "reason": "not saturated", "d_hat_raw": None,
              "d_hat": None, "lower_bound": 0, "tokens": 50_775, "calls": 1_216, "D": 12, "D_prime": 1,
              "common_set_size": 68, "N": 100}
    assert headline(record).startswith("phase 1: not saturated, d >= 0; common set 1 x 68 (prompts x tokens) of D = 12 "
                                       "at N = 100 calls a prompt (more calls grow the common set")
    paper = record | {"estimator": "paper", "reason": "no saddle", "lower_bound": None}  # the paper's detector: no bound
    assert headline(paper).startswith("phase 1: no saddle; common set 1 x 68")
    done = record | {"saturated": True, "reason": "saturated", "d_hat_raw": 895, "d_hat": 896, "lower_bound": None,
                     "D_prime": 2_900, "common_set_size": 3_894, "d_interval": list(d_interval(895, None))}
    assert headline(done) == ("phase 1: d_hat = 896 (raw 895, 90 % interval [890.525, 899.475]); common set 2,900 x "
                              "3,894 (prompts x tokens) of D = 12")  # the detector's interval, +- 0.5 % (not 890.525000001)
    assert summary(done)["common_set"] == [2_900, 3_894] and summary(done)["d_interval"] == done["d_interval"]
