"""``nv attack --base-url``: phase 1 (§4.1) against a live OpenAI-compatible endpoint.

The order of work makes bad input cost nothing: params and output folder, the journal's binding,
the free ``GET /models`` (reachable, JSON, model served), the planned calls and tokens against the
budget, then a paid probe of two requests (log-probs present, ``n`` honoured, raw or processed), then
the attack itself through the same ``nv.phase1.pipeline`` functions as the simulator (the attack code never knows
the backend)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

from nv.errors import NVError
from nv.oracle.journal import Journal
from nv.oracle.http import Budget, HTTPOracle, split_credentials
from nv.outputs import write_json
from nv.phase1.adaptive import schedule
from nv.theory.sample_complexity import guaranteed_common_size

EFFECTIVE_VOCABS = (1024, 4096, 16384, 65536)  # |V'| of the dry run's Theorem 1 lines
CHECKED_REACH = 30  # the planner's predictions were checked up to this multiple of the pilot's N (README, planner)
PLAN_SIZES = (512, 1024, 2048, 4096, 8192)  # common-set sizes the pilot's plan lines are for (typical hidden sizes)
# live.* keys that shape requests (bound to the journal); the rest is politeness or planning only
REQUEST_KEYS = ("chat", "n_per_request", "top_logprobs", "extra_body", "columns")
# binding paths a rerun may change and keep its journal: how many samples, how the rounds grow, how the draws are
# stored and estimated, not what a request asks (a request's identity is its body, with its own seed): raising N or
# N_max, or switching to sampling.estimator: incomplete, after a stop reuses every paid reply, and the journal's cost
# stays everything paid through it
UNBOUND = ("sampling.N", "sampling.N_max", "sampling.N0", "sampling.growth", "sampling.estimator", "sampling.chunk",
           "live.columns")
# a paid reply in the journal: bytes of its line on disk, and of memory at the peak, the index that finds the line
# merging its runs (benchmarks/bench_journal_memory.py, 2^20 one-sample replies, resident: 37 bytes each held while
# the attack runs, 45 at its peak, 45-50 at the peak of a resume's read, two runs)
JOURNAL_BYTES = {"disk": 133, "memory": 50}


def binding(base_url: str, model: str, params: dict) -> dict:
    """What a journal is valid for: the endpoint, the model and every parameter that shapes requests."""
    live = params["live"]
    return {"endpoint": base_url.rstrip("/"), "model": model, "seed": params["seed"], "search": params["search"],
            "sampling": params["sampling"], "live": {k: live[k] for k in REQUEST_KEYS}}


def _cost(params: dict, budget: Budget, N: int) -> dict:
    """Calls, requests, §5 tokens, billed tokens and money of the search plus D x N samples (see ``plan``)."""
    search, live = params["search"], params["live"]
    ell, n = live["prompt_tokens"], live["n_per_request"]
    search_calls = search["rounds"] * search["batch_size"]
    sample_calls, sample_requests = search["D"] * N, search["D"] * math.ceil(N / n)
    billed = (ell + max(2, n)) + (ell + 1) + search_calls * (ell + 1) + sample_requests * ell + sample_calls
    requests = 2 + search_calls + sample_requests
    # the least time the endpoint's rate limits allow (live.rpm, live.tpm; None without either: its speed decides)
    paced = [requests / live["rpm"] if live["rpm"] else 0.0, billed / live["tpm"] if live["tpm"] else 0.0]
    return {"N": N, "sampling_calls": sample_calls, "requests": requests,
            "tokens_paper": (ell + 1) * (search_calls + sample_calls), "tokens_billed": billed, "money": budget.money_of(billed),
            "minutes_at_rate_limits": max(paced) if any(paced) else None}


def plan(params: dict, budget: Budget, pilot: Path | None = None, target: tuple[str, str] | None = None,
         timing: dict | None = None, places: dict[str, Path] | None = None) -> dict:
    """Planned calls and tokens of phase 1 before anything is sent (§5, §4.1.2).

    Calls: the search's rounds x batch T = 0 calls, then D x N samples, plus two probe requests.
    Prompt tokens per call are unknown before the first reply: ``live.prompt_tokens`` estimates them (a pilot's
    replies measured them).
    Tokens (§5): (prompt + 1) per call. Billed: prompt tokens once per request, n samples per
    request as ``live.n_per_request`` asks (if the server turns out not to honour n, the budget cap
    still stops the run in time). Theory: Theorem 1's guaranteed common-set size for the planned D
    and N if next tokens were uniform over an effective vocabulary of |V'| tokens, for a few |V'|
    (high-entropy prompts spread over a sub-vocabulary; Corollary 1 makes that precise). With ``pilot`` (the
    samples folder of an earlier, small run on the same endpoint): the N, and its cost, at which the planner
    (``nv.phase1.planner``) expects the D prompts to share each of ``PLAN_SIZES`` tokens; ``target`` (endpoint, model)
    names the attack planned, and a pilot drawn elsewhere (another endpoint or model, a simulated model) is flagged.
    With ``timing`` (``attack``'s), phase 2's requests and tokens (``nv.phase2.live.timing_cost``), which the budget
    check adds to phase 1's. With ``places`` (``{"out": --out, "journal": --journal}``): each volume's free space
    against what the plan writes there (``disk_check``).
    """
    search, sampling = params["search"], params["sampling"]
    drawn = None
    if pilot is not None:
        from nv.outputs import read_json
        from nv.phase1.sampling import MANIFEST, load_samples

        if not (pilot / MANIFEST).is_file() and (pilot / "samples" / MANIFEST).is_file():
            raise NVError(f"--pilot {pilot} is an attack's output folder: give its draws, {pilot / 'samples'}")
        drawn = load_samples(pilot)
        if drawn.temperature != sampling["temperature"]:
            raise NVError(f"the pilot in {pilot} was sampled at tau = {drawn.temperature:g}, the plan is for tau = "
                          f"{sampling['temperature']:g}: a pilot predicts only its own temperature")
        # the pilot's replies measured the prompt tokens per call (system prompt, template, input) on its endpoint
        params = {**params, "live": {**params["live"], "prompt_tokens": max(1, round(float(drawn.prompt_tokens.mean())))}}
        drawn_by = read_json(pilot / MANIFEST).get("model")
        if isinstance(drawn_by, dict) and drawn_by.get("top_logprobs"):
            raise NVError(f"the pilot in {pilot} was drawn with live.top_logprobs = {drawn_by['top_logprobs']}: its counts are "
                          "top-k reveals, not draws; the planner needs a pilot drawn with live.top_logprobs: 0")
        source = pilot_source(drawn_by, params["live"], target)
        from nv.phase1.planner import MIN_CHECKED, disk_bytes, draws_over_expected, fit

        checked = draws_over_expected(drawn)[1]
        if checked < MIN_CHECKED:  # an undersized pilot planned N beyond 1e8 and a disk 1000x too small (a review)
            raise NVError(f"the pilot in {pilot} ({drawn.D:,} prompts x {drawn.N:,} calls) is too small to plan from: "
                          f"{checked} of its entries are drawn often enough (N_0 p >= 30) to check that its log-probs "
                          f"are its draws' probabilities ({MIN_CHECKED} needed); draw a few hundred prompts x 10^4 calls "
                          "(README: Planning a budget)")
    adaptive = sampling["N"] == "auto"
    rounds = schedule(sampling["N0"], sampling["N_max"], sampling["growth"]) if adaptive else [sampling["N"]]
    N = rounds[-1]  # adaptive: the worst case (N_max); the first round is what a budget must afford
    total = _cost(params, budget, N)
    out = {
        "D": search["D"],
        **total,
        "adaptive": adaptive,
        "rounds": [_cost(params, budget, r) for r in rounds],
        "search_calls": search["rounds"] * search["batch_size"],
        "prompt_tokens_per_call": params["live"]["prompt_tokens"],
        "prompt_tokens_from": "estimate: live.prompt_tokens" if drawn is None else "measured by the pilot",
    }
    if timing is not None:
        from nv.phase2.live import timing_cost

        out["phase2"] = timing_cost(timing["calibration"], timing["d_hat"], timing["p_max"])
        out["phase2"]["money"] = budget.money_of(out["phase2"]["tokens_billed"])
    # the journal and the disk are sized for the rounds a cap lets run (the cumulative costs grow: a prefix), not for
    # N_max's worst case, which warned of a full volume a capped run never reaches (a review, 2026-12-07)
    affordable = sum(budget.passed(*_with_phase2(r, out.get("phase2"))) is None for r in out["rounds"])
    sized = rounds[:affordable] if adaptive and 0 < affordable < len(rounds) else rounds
    out["sized_N"] = sized[-1]
    # at the N the run can reach: N_max's was printed under a cap that stops the run rounds before it (a review)
    out["theorem1_common_set"] = {V: guaranteed_common_size(out["sized_N"], search["D"], V) for V in EFFECTIVE_VOCABS}
    out["journal_bytes"] = {k: v * out["rounds"][len(sized) - 1]["requests"] for k, v in JOURNAL_BYTES.items()}
    if drawn is not None:
        tail = fit(drawn, params["planner"]["min_seen"])
        needed = {size: tail.samples_for(size, search["D"], N_max=1e8) for size in PLAN_SIZES}
        out["pilot"] = {"folder": str(pilot), "D0": tail.D0, "N0": tail.N0, "logprobs": tail.logprobs, **source,
                        "common_set": {size: None if n is None else _cost(params, budget, math.ceil(n))
                                       | {"disk": disk_bytes(tail, search["D"], [math.ceil(n)])["sample"]}
                                       for size, n in needed.items()},
                        "disk": disk_bytes(tail, search["D"], sized, adaptive)}
    if places is not None:
        writes = [("journal", places["journal"], out["journal_bytes"]["disk"])]
        if "pilot" in out:
            writes.append(("sample's peak" if adaptive else "sample", places["out"], out["pilot"]["disk"]["peak"]))
        out["disk_free"] = disk_check(writes)
    return out


def disk_check(writes: list[tuple[str, Path, float]]) -> list[dict]:
    """Free space against planned writes ``(what, path, bytes)``, per volume: the nearest existing folder at or above
    each path (the attack creates the rest), its volume's free bytes, what goes there and whether it fits."""
    volumes: dict[int, dict] = {}
    for what, path, size in writes:
        at = Path(path).absolute()
        while not at.is_dir():  # a journal that exists is a file: its folder is the volume's place
            at = at.parent
        volume = volumes.setdefault(at.stat().st_dev, {"path": str(at), "free": shutil.disk_usage(at).free, "writes": {}})
        volume["writes"][what] = size
    return [v | {"fits": sum(v["writes"].values()) <= v["free"]} for v in volumes.values()]


def pilot_source(model: object, live: dict, target: tuple[str, str] | None) -> dict:
    """Where a pilot was drawn (its manifest's ``model``: an endpoint's identity or a simulated model's params; an
    adaptive run's merged draws record neither) and, as ``elsewhere``, why it may not be the ``target`` (endpoint,
    model) and request shape planned (None: it is)."""
    if not isinstance(model, dict) or not ("endpoint" in model or "spec" in model):
        return {"source": "an unrecorded target", "elsewhere": None if target is None else "an unrecorded target"}
    if "endpoint" not in model:
        return {"source": f"simulated model {model['spec']!r}", "elsewhere": None if target is None else "a simulated model"}
    source = f"{model['endpoint']}, model {model.get('model')!r}"
    differs = [what for what, a, b in (("endpoint", model["endpoint"],
                                        None if target is None else split_credentials(target[0])[0].rstrip("/")),
                                       ("model", model.get("model"), None if target is None else target[1]),
                                       ("chat mode (live.chat)", model.get("chat"), live["chat"])) if b is not None and a != b]
    return {"source": source, "elsewhere": f"another {' and '.join(differs)}" if differs else None}


def paid_so_far(journal: Path, base_url: str, model: str, params: dict, budget: Budget) -> dict | None:
    """What the journal a run would resume from has paid already (None: no journal yet); a journal of another attack
    is refused here, as the run would refuse it, and so is a path that is not a regular file."""
    if not journal.exists():
        return None
    if not journal.is_file():  # the run's own words (``nv.oracle.journal.Journal``): a folder, /dev/null, a FIFO
        raise NVError(f"journal {journal} is not a regular file: give a file's path (--journal)")
    j = Journal(journal, binding(split_credentials(base_url)[0], model, params), UNBOUND, readonly=True)
    j.close()
    tokens = j.prompt_tokens + j.output_tokens
    return {"journal": str(journal), "requests": j.requests, "tokens_billed": tokens, "money": budget.money_of(tokens)}


def endpoint_check(base_url: str, model: str, live: dict) -> str | None:
    """The dry run's look at the endpoint: the attack's free ``GET /models`` (nothing billed); None where the endpoint
    answers and serves ``model``, else the reason, which the plan prints (a plan made offline still stands)."""
    oracle = HTTPOracle.from_params(base_url, model, live, None, Budget())  # a malformed URL: the one-line error
    try:
        oracle.preflight()
    except NVError as exc:
        return str(exc)
    finally:
        oracle.close()
    return None


def format_plan(p: dict, params: dict, model: str, base_url: str, budget: Budget, timing: dict | None = None) -> str:
    """The dry run's text: the endpoint check's outcome (``p["endpoint_error"]``, where checked), phase 1's calls,
    requests, tokens, money and time; phase 2's calls with ``timing`` (``attack``'s: the calibration and the d_hat
    given, if any)."""
    calibration = None if timing is None else timing["calibration"]
    placed = "phase 1's d_hat" if timing is None or not timing["d_hat"] else f"d_hat = {timing['d_hat']}"
    s, smp, live = params["search"], params["sampling"], params["live"]
    money = "" if p["money"] is None else (f"\n  money             {_money(p['money'])} (billed tokens x --price-per-mtok, in "
                                           "its currency)")
    adaptive = _format_rounds(p["rounds"], budget, p.get("phase2")) if p["adaptive"] else ""
    return (
        f"plan for phase 1 against {model} at {split_credentials(base_url)[0]} (nothing billed; --out is checked when "
        "the attack starts):\n"
        + ("" if "endpoint_error" not in p else "  endpoint          GET /models (free): "
           + (f"serves {model}\n" if p["endpoint_error"] is None else f"{p['endpoint_error']}: the attack would stop there\n"))
        + f"  prompt search     {s['rounds']} rounds x {s['batch_size']} = {p['search_calls']:,} calls at T = 0\n"
        f"  sampling          D = {s['D']:,} prompts x N = {p['N']:,} = {p['sampling_calls']:,} calls at tau = {smp['temperature']}{adaptive}\n"
        f"  requests          {p['requests']:,} (2 probes; {live['n_per_request']} sample{'s' * (live['n_per_request'] > 1)} "
        "per request where n is honoured)\n"
        f"  tokens (§5)       {p['tokens_paper']:,} = (prompt + 1) x calls, prompt ~ {p['prompt_tokens_per_call']} tokens ({p['prompt_tokens_from']})\n"
        f"  tokens (billed)   {p['tokens_billed']:,} (prompt tokens once per request){money}\n"
        f"  time              {_duration(p['minutes_at_rate_limits'], live)}\n"
        f"  journal           ~{_size(p['journal_bytes']['disk'])} on disk, ~{_size(p['journal_bytes']['memory'])} of memory "
        "while the attack runs (an index of every paid reply; the figures of one-sample replies: README, Live endpoint)"
        + _capped(p) + "\n"
        f"  theory (Thm. 1)   at N = {p['sized_N']:,}, |C| >= d with 95 % probability if next tokens were uniform over "
        "|V'| tokens: " + ", ".join(f"|V'| = {V:,}: d = {d:,}" for V, d in p["theorem1_common_set"].items())
        + _format_pilot(p, money_given=p["money"] is not None)
        + "".join(f"\n  disk free         ~{_size(v['free'])} at {v['path']}, for the "
                  + " and the ".join(f"{what} (~{_size(size)})" for what, size in v["writes"].items())
                  + ("" if v["fits"] else ": WARNING, not enough: the attack would stop when the volume is full "
                     "(resumable; free space or give another --out / --journal before it starts)")
                  for v in p.get("disk_free", []))
        + ("" if not p.get("paid") else
           f"\n  already paid      {p['paid']['requests']:,} requests, {p['paid']['tokens_billed']:,} billed tokens"
           + ("" if p["paid"]["money"] is None else f", money {_money(p['paid']['money'])}")
           + f" in {p['paid']['journal']}: a run reuses those its plan asks for and pays only the rest; the caps count "
           "every paid reply" + _paid_over(p["paid"], budget))
        + ("" if calibration is None else
           f"\n  phase 2 (timing)  after phase 1: {calibration['warmups']} warm-ups, the ell = 1 baseline and "
           f"{calibration['trials']} trials at each of {calibration['n_lengths'] + 1} lengths (App. D, r = {calibration['r']:g}: "
           f"placed from {placed}), one output token each: {p['phase2']['requests']:,} requests, "
           f"{'at most ' if p['phase2']['bound'] else ''}{p['phase2']['tokens_billed']:,} billed tokens"
           + ("" if p["phase2"]["money"] is None else f", money {_money(p['phase2']['money'])}")
           + " (not in the totals above; the budget check adds them to phase 1's" + (", its first round's" if p["adaptive"] else "")
           + f", with {p['phase2']['tokens_held'] - p['phase2']['tokens_billed']:,} tokens more its last call reserves "
           "beyond its bill)\n"
           + _format_k(timing) +
           f"\n  both phases       {p['requests'] + p['phase2']['requests']:,} requests, "
           f"{p['tokens_billed'] + p['phase2']['tokens_billed']:,} billed tokens"
           + ("" if p["money"] is None else f", money {_money(p['money'] + p['phase2']['money'])}")
           + (" (N_max's phase 1)" if p["adaptive"] else ""))
    )


def _money(x: float) -> str:
    """An amount of money as the plan prints it: cents from 0.01 up, three significant digits below."""
    return f"{x:,.2f}" if x >= 0.01 else f"{x:.3g}"


def _amount(what: str, x: float) -> str:
    """A cap or a spend as the plan prints it: money with cents (``_money``), tokens and calls whole."""
    return _money(x) if what == "money" else f"{x:,.0f}"


def _format_k(timing: dict) -> str:
    """The plan's line on Eq. 8's platform transfer factor k, with the caveat where it is the default."""
    k, platform = timing["k"], timing["calibration"]["platform"]
    if timing.get("k_given"):
        return f"                    k = {k:g} (--timing-k): L_hat's and P_hat's intervals assume it exact"
    return k_note(platform)


def k_note(platform: str) -> str:
    """Said in the plan and when phase 2 starts, where --timing-k is left at 1."""
    return (f"  NOTE: k = 1 (--timing-k not given): phase 2's calibration was timed on platform {platform!r}; L_hat, "
            "P_hat and their 90 % intervals assume this endpoint prefills at that platform's speed (a server rarely "
            "does: README, Live endpoint)")


def _format_rounds(rounds: list[dict], budget: Budget, phase2: dict | None) -> str:
    """The adaptive loop's rounds with their cumulative cost, and the first round a budget cap stops the run before
    (with ``phase2``'s share held back, as the attack holds it)."""
    lines = ["\n  adaptive (N: auto) rounds stop when the estimate is stable (once saturated, the next round is sqrt(2) "
             "larger); cumulative cost by round while unsaturated:"]
    stopped = False
    for r in rounds:
        line = (f"                    N = {r['N']:>11,}: {r['requests']:,} requests, {r['tokens_paper']:,} tokens (§5), "
                f"{r['tokens_billed']:,} billed" + ("" if r["money"] is None else f", money {_money(r['money'])}"))
        over = budget.passed(*_with_phase2(r, phase2))
        if over and not stopped:
            line += f"  <- past --budget-{over[0]} {_amount(over[0], over[1])}: the run stops before this round"
            stopped = True
        lines.append(line)
    lines.append("                    (the totals below are N_max's, the worst case; a cap ends the run after its last "
                 "affordable round)")
    return "\n".join(lines)


def _size(n: float) -> str:
    return next(f"{n / 1024**i:.3g} {unit}" for i, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "B"))
                if n >= 1024**i or i == 0)


def _duration(minutes: float | None, live: dict) -> str:
    """The plan's time line: the least time the rate limits allow, or why there is none."""
    if minutes is None:
        return "the endpoint's speed decides (no live.rpm / live.tpm set); the progress bars show the rate and the ETA"
    span = (f"{minutes:.3g} min" if minutes < 120 else f"{minutes / 60:.3g} h" if minutes < 2880 else
            f"{minutes / 1440:.3g} days" if minutes < 525_600 else f"{minutes / 525_600:.3g} years")
    return f"at least {span} at live.rpm = {live['rpm']:g}, live.tpm = {live['tpm']:g}"


def _format_pilot(p: dict, money_given: bool) -> str:
    if "pilot" not in p:
        return ""
    pilot = p["pilot"]
    lines = [f"\n  planner (pilot)   from {pilot['D0']:,} prompts x {pilot['N0']:,} calls in {pilot['folder']} (drawn from "
             f"{pilot['source']}): the N at which all D = {p['D']:,} prompts are expected to share |C| tokens (Theorem 1's "
             "mean, fitted tail)"]
    if pilot["logprobs"] == "raw":
        lines.append("                    NOTE: the pilot's log-probs are raw, log_softmax(z) (its draws do not follow them): "
                     "turned into its draws' log_softmax(z / tau) by each prompt's counts (README, planner)")
    if pilot["elsewhere"]:
        lines.append(f"                    NOTE: the pilot was drawn from {pilot['elsewhere']}, which may not be this plan's "
                     "target: its prompt tokens per call and its tail are that target's")
    for size, c in pilot["common_set"].items():
        cost = "beyond N = 1e8" if c is None else (f"N = {c['N']:,}, {c['tokens_paper']:,} tokens (§5), "
                                                    f"{c['requests']:,} requests" + (f", money {_money(c['money'])}" if money_given else "")
                                                    + f", the sample ~{_size(c['disk'])} on disk")
        lines.append(f"                    |C| = {size:,}: {cost}")
    far = max((c["N"] for c in pilot["common_set"].values() if c), default=0) / pilot["N0"]
    if far > CHECKED_REACH:
        lines.append(f"                    NOTE: these reach {far:,.0f}x the pilot's N; the fit was checked up to "
                     f"{CHECKED_REACH}x (README, planner): a larger pilot plans farther with less risk")
    lines.append("                    (the robust estimator needs |C| > d, and more on a noisy spectrum: README, planner)")
    disk = pilot["disk"]
    lines.append(f"  disk (pilot)      the sample at N = {p['sized_N']:,}{_capped(p)}: ~{_size(disk['sample'])}"
                 + (f"; the adaptive loop's peak there ~{_size(disk['peak'])} (every round's draws kept beside it, and "
                    "the merged sample before it or a round's check copy; a sqrt 2 step after a failed check adds a "
                    "round's draws)" if p["adaptive"] else "") + ", under --out (the pilot's fit, which errs low: README, planner)")
    return "\n".join(lines)


def _capped(p: dict) -> str:
    """Where the journal and the disk are sized short of N_max: at the last round the budget affords."""
    return "" if p["sized_N"] == p["N"] else f", to N = {p['sized_N']:,}, the last round the budget affords"


def _with_phase2(cost: dict, phase2: dict | None) -> tuple[int, int]:
    """Requests and billed tokens of phase 1's ``cost`` (a ``_cost`` dict) with what phase 2 holds added, where it is
    planned."""
    extra = phase2 or {"requests": 0, "tokens_held": 0}
    return cost["requests"] + extra["requests"], cost["tokens_billed"] + extra["tokens_held"]


def _paid_over(paid: dict, budget: Budget) -> str:
    """The dry run's note where the journal's spend alone passes a cap: only the requests it answers can still run."""
    over = budget.passed(paid["requests"], paid["tokens_billed"])
    return "" if over is None else (f" (these alone pass the {over[0]} cap, {_amount(over[0], over[2])} > {_amount(over[0], over[1])}: a run can use "
                                    "only what the journal answers, and one that needs a new request stops before it)")


def check_budget(p: dict, budget: Budget) -> None:
    """Refuse, before anything is spent, a budget below the planned requests, tokens or money (adaptive: below the
    first round; the run stops after the last round the budget affords), phase 2's added where it is planned."""
    phase1 = p["rounds"][0] if p["adaptive"] else p
    over = budget.passed(*_with_phase2(phase1, p.get("phase2")))
    if over:
        what, cap, amount = over
        with2 = f" with phase 2's {p['phase2']['requests']:,} timed calls" if p.get("phase2") else ""
        raise NVError(f"budget too small: the planned attack (D = {p['D']:,}, N = {phase1['N']:,}){with2} needs "
                      f"{_amount(what, amount)} {what} > --budget-{what} {_amount(what, cap)}; lower D or N, or raise the budget")


def attack(base_url: str, model: str, params: dict, out: Path, journal_path: Path, budget: Budget,
           progress: bool = True, timing: dict | None = None) -> dict:
    """Phase 1 against the endpoint, then phase 2 when ``timing`` = {calibration, k, vocab_size,
    p_max, d_hat (None: phase 1's)} is given; writes report.json and spectrum.png under ``out``."""
    from nv.phase1.pipeline import estimate_and_report, search_and_sample

    journal = Journal(journal_path, binding(split_credentials(base_url)[0], model, params), UNBOUND)
    oracle = HTTPOracle.from_params(base_url, model, params["live"], journal, budget, progress)
    try:
        oracle.preflight()
        planned = plan(params, budget, timing=timing)
        check_budget(planned, budget)
        oracle.probe()
        params = {**params, "model": {"endpoint": oracle.base_url, "model": model,
                                      **{k: params["live"][k] for k in REQUEST_KEYS}}}
        phase2 = planned.get("phase2") or {"requests": 0, "tokens_held": 0}
        # phase 2's whole share is kept from phase 1's rounds, even where an earlier run's timed calls are journaled:
        # which calls phase 2 makes follows from phase 1's d_hat (its sweep), known only once phase 1 ends
        with oracle.holding(phase2["requests"], phase2["tokens_held"]):
            samples, search_cost, adaptive = search_and_sample(oracle, params, out, out / ".checkpoints", progress)
        record = estimate_and_report(samples, params["spectrum"], model, None, search_cost, adaptive, out, params["seed"],
                                     progress)
        prompts = json.loads((out / "prompts.json").read_text())
        record.update(live_fields(oracle, record, prompts, samples))
        if timing is not None:
            from nv.phase2.live import timing_phase

            # phase 1's report, whole, while phase 2 runs: a phase 2 that fails or is stopped leaves it, marked
            unfinished = {"note": "phase 2 did not finish: rerun the same command (its paid calls are journaled)"}
            write_json(out / "report.json", record | {"timing": unfinished})
            d_hat = timing["d_hat"] or record["d_hat"]
            before = oracle.cost.as_dict()
            record.update(timing_phase(oracle, d_hat, timing["calibration"], timing["k"], timing["p_max"],
                                       timing["vocab_size"], params["seed"], out / ".checkpoints" / "timing.jsonl", progress))
            after = oracle.cost.as_dict()
            # phase 1's §5 cost from its sample (a rerun does not ask its finished adaptive rounds again, so the oracle
            # does not count them), plus the timed calls (asked again on a rerun, replayed from the journal)
            record["cost"]["paper"] = {k: v + after[k] - before[k] for k, v in record["cost"]["paper"].items()}
            record["cost"]["provider"] = oracle.provider_cost.as_dict()
        write_json(out / "report.json", record)
        return record
    finally:
        oracle.close()
        journal.close()


def live_fields(oracle: HTTPOracle, record: dict, prompts: list[str], samples: Path) -> dict:
    """The report's endpoint fields. Everything but ``http`` is a function of the journal and the
    data (``samples``: phase 1's folder, of which only the greedy tokens' columns are read), so a resumed or
    fault-ridden run reports the same; ``http`` is this process's traffic."""
    from nv.phase1.sampling import load_samples
    from nv.phase1.spectrum import d_interval

    greedy = np.zeros(oracle.vocab_size, dtype=bool)
    greedy[[col for col, _ in oracle.greedy.values() if col >= 0]] = True
    sampled = load_samples(samples, greedy)
    billed = oracle.provider_cost
    sad, peak = record["i_sad"], record["i_peak"]
    lo, hi = d_interval(record["d_hat_raw"], record["lower_bound"])
    return {
        "endpoint": oracle.base_url,
        "d_interval": [lo, None if math.isinf(hi) else hi],  # the detector's (budget sweep): d_hat_raw +- max(3, 0.5 %)
        "aoi": None if sad is None or peak is None else [sad, peak],
        "logprob_mode": oracle.logprob_mode(prompts, sampled),
        "n_per_request": oracle.n_per_request,
        "n_honoured": oracle.n_supported,
        "cost": {
            "paper": {"calls": record["calls"], "tokens": record["tokens"]},
            "provider": billed.as_dict(),
            "price_per_mtok": oracle.budget.price_per_mtok,
            "money": oracle.budget.money_of(billed.tokens),
            "caps": {"tokens": oracle.budget.tokens, "calls": oracle.budget.calls, "money": oracle.budget.money},
        },
        "unidentified_tokens": oracle.journal.unidentified,
        "http": dict(oracle.stats),
    }
