"""The ``nv`` command line: ``nv attack`` runs phase 1 on a local model (``--simulate MODEL``, behind the
provider defences of params.yaml's ``defence`` section and ``--defence KEY=VALUE``, see ``nv.oracle.defence``)
or on a live OpenAI-compatible endpoint (``--base-url URL --model NAME``, see ``nv.live``); ``nv defend`` serves
the same defences as a reverse proxy in front of a real server (``nv.oracle.defence_proxy``).

Every NVError becomes one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from nv.errors import NVError, run_main
from nv.models.packaged import PACKAGED
from nv.outputs import write_json
from nv.params import SCHEMA, check_section, load_params

PHASE1_SECTIONS = ["model", "search", "sampling", "spectrum"]


def _writable(folder: Path) -> Path:
    if folder.exists() and not folder.is_dir():
        raise NVError(f"output folder {folder} is a file: give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise NVError(f"output folder {folder} is not writable: {exc.strerror}") from None
    return folder


@contextmanager
def _claimed(folder: Path):
    """An exclusive lock on the output folder while the attack runs: a second attack on the same ``--out`` would write
    the same checkpoints and lose one run's shards mid-write (the live path's journal has its own lock besides)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise NVError(f"output folder {folder} is in use by another nv attack: wait for it, or give another --out") from None
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _load(load, spec: str):
    """``load()``, the model ``spec`` names, with what a file or folder that is not a usable model raises (a config its
    weights or attention heads contradict, damaged safetensors: transformers', huggingface_hub's and safetensors' own
    exception types, not NVError) said in one line."""
    try:
        return load()
    except NVError:
        raise
    except Exception as exc:  # noqa: BLE001 -- third-party loaders raise their own types for a bad file
        while exc.__cause__ is not None:  # the reason a validator wraps ("the hidden size ... is not a multiple ...")
            exc = exc.__cause__
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise NVError(f"cannot load model {spec!r}: {type(exc).__name__}: {first}") from None


def defence_overrides(section: dict, pairs: list[str]) -> dict:
    """params.yaml's ``defence`` section with ``KEY=VALUE`` overrides (VALUE read as YAML: 1, 0.5, 1e-5, bf16, null)."""
    import yaml

    section = dict(section)
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise NVError(f"--defence takes KEY=VALUE, got {pair!r}")
        if key not in section:
            raise NVError(f"unknown --defence key {key!r} (known: {', '.join(section)})")
        if not text.strip():
            raise NVError(f"--defence {key}= needs a value (null switches the knob off)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise NVError(f"--defence {key}: cannot read the value {text!r}") from None
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            section[key] = float(value) if isinstance(value, str) else value
        except ValueError:
            section[key] = value
    return check_section("defence", section, "--defence") if pairs else section


# options of a live endpoint (its budget, journal, plan) and of its phase 2 (timing), by argparse dest
LIVE_ONLY = ("model", "journal", "budget_tokens", "budget_calls", "budget_money", "price_per_mtok", "dry_run", "pilot",
             "timing_calibration", "timing_k", "vocab_size", "context_length", "timing_d_hat")
TIMING_DEFAULTS = {"timing_k": 1.0, "context_length": 8192}


def summary(record: dict) -> dict:
    """The attack's last line on stdout (JSON; the full report is OUT/report.json): the estimate, its cost, the
    defence it ran behind (--simulate --defence), why the adaptive loop stopped, and phase 2's depth and size where it
    ran."""
    out = {k: record[k] for k in ("model", "estimator", "saturated", "d_hat_raw", "d_hat", "lower_bound", "tokens", "calls")}
    out["common_set"] = [record["D_prime"], record["common_set_size"]]
    out |= {"d_interval": record["d_interval"]} if "d_interval" in record else {}
    if defence := {k: v for k, v in record.get("defence", {}).items() if v is not None}:
        out["defence"] = defence
    out |= {k: record[k] for k in ("adaptive_stop", "cost") if k in record}
    if "timing" in record:
        out["timing"] = {k: record["timing"].get(k) for k in ("L_hat", "L_interval", "P_hat", "P_interval", "note")}
    return out


def headline(record: dict) -> str:
    """Phase 1's outcome in words (stderr, beside the JSON summary on stdout)."""
    block = f"common set {record['D_prime']:,} x {record['common_set_size']:,} (prompts x tokens) of D = {record['D']:,}"
    if record["saturated"]:
        interval = record.get("d_interval")
        where = f", 90 % interval [{interval[0]:g}, {interval[1]:g}]" if interval and interval[1] is not None else ""
        return f"phase 1: d_hat = {record['d_hat']} (raw {record['d_hat_raw']}{where}); {block}"
    bound = "" if record["lower_bound"] is None else f", d >= {record['lower_bound']}"  # the paper's detector has none
    return (f"phase 1: {record['reason']}{bound}; {block} at N = {record['N']:,} calls a prompt (more calls grow the "
            "common set: `--dry-run --pilot` plans N; README, Planning a budget)")


def attack(args: argparse.Namespace) -> int:
    if args.quiet and "tqdm" not in sys.modules:  # every bar, transformers' GGUF dequantisation's too (read on import)
        os.environ["TQDM_DISABLE"] = "1"
    if args.base_url is not None:
        args.base_url = args.base_url.strip()  # a pasted URL's trailing space made every path ".../v1 /models"
    if (args.simulate is None) == (args.base_url is None):
        raise NVError("give exactly one target: --simulate MODEL or --base-url URL --model NAME")
    if args.simulate is not None:
        given = ["--" + dest.replace("_", "-") for dest in LIVE_ONLY if getattr(args, dest) not in (None, False)]
        if given:
            raise NVError(f"{', '.join(given)}: {'applies' if len(given) == 1 else 'apply'} to --base-url only "
                          "(a simulated attack pays nothing and times nothing)")
    if args.base_url is not None:
        if args.defence:
            raise NVError("--defence applies to --simulate only (a live endpoint's defences are its provider's)")
        return attack_live(args)
    spec = args.simulate
    a_path = spec.startswith(("/", "./", "../", "~")) and not spec.endswith(".gguf")  # a .gguf has its own message
    if not spec.strip() or a_path and not Path(spec).expanduser().exists():
        raise NVError(f"--simulate {args.simulate!r}: no such file or folder (give a packaged name, a HF id, a folder or "
                      "a .gguf file)")  # not the hub's "Repo id must be in the form ..." for a path typed wrong
    params = load_params(params_file(args), PHASE1_SECTIONS + ["defence"])
    overrides = defence_overrides(params["defence"], args.defence)
    from nv.oracle.defence import TIMING_KNOBS, Defence, DefendedOracle

    defence = Defence(**overrides)
    timed = [k for k in TIMING_KNOBS if getattr(defence, k) is not None]
    if timed:
        serves = ("`nv defend` cannot serve it either (it needs the model's tokenizer)" if timed[0] == "pad_to_tokens"
                  else "`nv defend` serves it in front of a live server")
        raise NVError(f"defence {timed[0]}: a timing defence, and a simulated attack times nothing (phase 1 only): the "
                      f"defences stage sweeps it on timing records; {serves}")
    out = _writable(Path(args.out))
    with _claimed(out):
        # the model and the attack's modules (torch, scipy, matplotlib: ~20 s on a slow machine) after the input is checked
        from nv.oracle import Simulator
        from nv.phase1.pipeline import run

        if args.quiet:  # transformers' own bars (loading the weights) too
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()

        model = {**params["model"], "spec": args.simulate}
        simulator = _load(lambda: Simulator.from_params(model), args.simulate)
        oracle = DefendedOracle(simulator, defence, params["seed"]) if defence.active else simulator
        # a defended run's draws differ: the defence joins the checkpoint identity (pipeline.run keys it by params["model"])
        params["model"] = {**model, "defence": defence.as_dict()} if defence.active else model
        record = run(oracle, params, out, args.simulate, d_true=simulator.lm.arch.d, progress=not args.quiet)
        record["defence"] = defence.as_dict()
        write_json(out / "report.json", record)
        print(headline(record), file=sys.stderr)
        print(json.dumps(summary(record)))
        return 0


def attack_live(args: argparse.Namespace) -> int:
    if not args.model:
        raise NVError("--base-url needs --model NAME (the model id the endpoint serves)")
    if args.budget_money is not None and args.price_per_mtok is None:
        raise NVError("--budget-money needs --price-per-mtok (the price of a million billed tokens)")
    if args.pilot and not args.dry_run:
        raise NVError("--pilot goes with --dry-run (it plans a run, it does not start one)")
    timing_given = [f"--{d.replace('_', '-')}" for d in ("timing_k", "vocab_size", "context_length", "timing_d_hat")
                    if getattr(args, d) is not None]
    if timing_given and not args.timing_calibration:
        raise NVError(f"{', '.join(timing_given)}: phase 2's options, they need --timing-calibration FILE")
    k_given = args.timing_k is not None
    for dest, value in TIMING_DEFAULTS.items():
        setattr(args, dest, value if getattr(args, dest) is None else getattr(args, dest))
    params = load_params(params_file(args), PHASE1_SECTIONS + ["live"] + (["planner"] if args.pilot else []))
    from nv import live  # after the input is checked (see attack)
    from nv.oracle.http import Budget

    timing = None
    if args.timing_calibration:
        from nv.phase2.calibration import load_calibration

        timing = {"calibration": load_calibration(Path(args.timing_calibration)), "k": args.timing_k,
                  "vocab_size": args.vocab_size, "p_max": args.context_length, "d_hat": args.timing_d_hat, "k_given": k_given}
    budget = Budget(args.budget_tokens, args.budget_calls, args.budget_money, args.price_per_mtok)
    journal = Path(args.journal) if args.journal else Path(args.out) / "journal.jsonl"
    plan = live.plan(params, budget, Path(args.pilot) if args.pilot else None, (args.base_url, args.model), timing,
                     {"out": Path(args.out), "journal": journal})
    if args.dry_run:
        plan["paid"] = live.paid_so_far(journal, args.base_url, args.model, params, budget)
        try:
            live.check_budget(plan, budget)
        except NVError as exc:  # said after the plan, with no wait on the endpoint first
            over = exc
        else:
            over = None
            plan["endpoint_error"] = live.endpoint_check(args.base_url, args.model, params["live"])
        print(live.format_plan(plan, params, args.model, args.base_url, budget, timing))
        if over is not None:
            raise over
        print(json.dumps(plan))
        return 0
    out = _writable(Path(args.out))
    with _claimed(out):
        if timing is not None and not timing["k_given"]:
            print(live.k_note(timing["calibration"]["platform"]).strip(), file=sys.stderr)
        record = live.attack(args.base_url, args.model, params, out, journal, budget, progress=not args.quiet, timing=timing)
    print(headline(record), file=sys.stderr)
    print(json.dumps(summary(record)))
    return 0


def params_file(args: argparse.Namespace) -> str:
    """``--params``, else the current folder's params.yaml (a one-line error where there is none)."""
    if args.params is None and not Path("params.yaml").is_file():
        raise NVError("no params.yaml in the current folder: run from the project root or give --params PATH")
    return args.params or "params.yaml"


def defend(args: argparse.Namespace) -> int:
    """``nv defend``: the defended reverse proxy (``nv.oracle.defence_proxy``) until interrupted."""
    from nv.oracle.defence import Defence
    from nv.oracle.defence_proxy import serve

    given = args.params is not None or Path("params.yaml").is_file()  # else every knob off but the --defence ones
    section = load_params(params_file(args), ["defence"])["defence"] if given else dict.fromkeys(SCHEMA["defence"])
    serve(args.upstream, args.port, Defence(**defence_overrides(section, args.defence)), args.seed, args.timeout)
    return 0


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _count(text: str) -> int:
    value = _number(text)
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return int(value)


def _size(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _amount(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:  # 1e999 read as an infinite cap, silently (a review)
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nv", description="NightVision: black-box inference of d, L and P.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("attack", help="run the attack and write report.json")
    target = p.add_argument_group("target (exactly one)")
    target.add_argument("--simulate", metavar="MODEL",
                        help="attack a local model through the simulator: a packaged name (" + ", ".join(PACKAGED) + "), "
                             "a HF id, a folder or a .gguf file")
    target.add_argument("--base-url", metavar="URL", help="attack an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1")
    target.add_argument("--model", metavar="NAME", help="with --base-url: the model id the endpoint serves")
    live = p.add_argument_group("live endpoint (with --base-url)")
    live.add_argument("--journal", metavar="PATH", help="journal of paid replies (default OUT/journal.jsonl); a rerun resumes from it")
    live.add_argument("--budget-tokens", type=_count, metavar="X", help="cap on billed tokens (prompt tokens once per request + output)")
    live.add_argument("--budget-calls", type=_count, metavar="X", help="cap on API requests")
    live.add_argument("--budget-money", type=_amount, metavar="X", help="cap on money (needs --price-per-mtok)")
    live.add_argument("--price-per-mtok", type=_amount, metavar="X", help="price of one million billed tokens")
    live.add_argument("--dry-run", action="store_true", help="print the planned calls and tokens and check the endpoint (the free GET /models); nothing billed")
    live.add_argument("--pilot", metavar="DIR", help="with --dry-run: the samples/ folder of a small earlier run on the same "
                      "endpoint (e.g. search.D = 300, sampling.N = 10000); plans N from its fitted tail (nv.phase1.planner)")
    phase2 = p.add_argument_group("phase 2, timing (with --base-url)")
    phase2.add_argument("--timing-calibration", metavar="FILE",
                        help="outputs/timing_fit/calibration.json: after phase 1, time the endpoint and report L_hat "
                        "(and P_hat), with 90 %% intervals")
    phase2.add_argument("--timing-k", type=_positive, metavar="K",
                        help="platform transfer factor k of Eq. 8 (default 1: the endpoint runs on the calibration's platform)")
    phase2.add_argument("--vocab-size", type=_size, metavar="V", help="|V| or an upper bound, for P_hat (the prefill curve's and Eq. 3's)")
    phase2.add_argument("--context-length", type=_size, metavar="P", help="the endpoint's context p_max (sweep cap; default 8192)")
    phase2.add_argument("--timing-d-hat", type=_size, metavar="D", help="time with this d_hat instead of phase 1's (e.g. an earlier run's)")
    p.add_argument("--defence", action="append", default=[], metavar="KEY=VALUE",
                   help="with --simulate: switch on a provider defence (params.yaml section defence), e.g. round_decimals=1")
    p.add_argument("--params", help="params file (sections seed, model, search, sampling, spectrum; defence with --simulate; live with "
                   "--base-url, planner with --pilot); default: "
                   "the current folder's params.yaml")
    p.add_argument("--out", default="attack-out", help="output folder (report.json, spectrum.png, checkpoints)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    d = sub.add_parser("defend", help="serve an OpenAI-compatible proxy on 127.0.0.1 that applies the provider defences")
    d.add_argument("--upstream", required=True, metavar="URL", help="the server to defend, e.g. http://127.0.0.1:8080")
    d.add_argument("--port", type=int, required=True, metavar="P", help="port of the defended endpoint on 127.0.0.1")
    d.add_argument("--defence", action="append", default=[], metavar="KEY=VALUE",
                   help="switch on a defence (params.yaml section defence), e.g. round_decimals=1; repeatable. KEY: "
                        + ", ".join(k for k in SCHEMA["defence"] if k != "pad_to_tokens") + " (the *_ms in milliseconds, "
                        "noise_sigma and min_logprob in nats; pad_to_tokens needs the model's tokenizer, which a proxy "
                        "does not have; README: Defences)")
    d.add_argument("--timeout", type=_positive, default=600.0, metavar="S",
                   help="seconds to wait for the upstream's reply before answering 504 (default 600)")
    d.add_argument("--seed", type=_count, metavar="S", help="draw the noise and delays from seed S (reproducible: for tests; "
                   "default: the OS's entropy, which an attacker cannot replay)")
    d.add_argument("--params", help="params file (section defence); default: the current folder's params.yaml, if any "
                   "(else only the --defence knobs are on)")
    args = parser.parse_args(argv)  # argparse reports its own usage errors (exit 2)
    return run_main(lambda: attack(args) if args.command == "attack" else defend(args))


if __name__ == "__main__":
    sys.exit(main())
