"""Phase 1 end to end (§4.1, Alg. 1-2): common-set matrix, the spectral estimators, report.

The stages (notebooks) and ``nv attack`` compose these functions; nothing here talks to a
model except through the oracle passed in.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from nv.outputs import write_json
from nv.plots import save
from nv.plots.phase1 import spectrum_panels
from nv.phase1 import incomplete
from nv.phase1.prune import Pruned, greedy_prune
from nv.phase1.sampling import SampledMatrix, collect, load_samples, observed_mask
from nv.phase1.search import search_prompts
from nv.phase1.spectrum import SpectrumEstimate, estimate, snap


@dataclass
class CommonSet:
    """The pruned common-set log-prob matrix Y (D' x |C|) and which prompts/tokens survived."""

    Y: np.ndarray
    pruned: Pruned


def common_set(sampled: SampledMatrix, pruned: Pruned | None = None) -> CommonSet:
    """Alg. 1 lines 6-7: greedy NaN pruning of Y_hat (or ``pruned``, that of its mask, ``observed_mask``), then the
    dense submatrix Y (float64). Columns are taken first: taking the rows first would copy nearly all of Y_hat."""
    pruned = greedy_prune(sampled.counts) if pruned is None else pruned
    Y = sampled.logprobs[:, pruned.cols][pruned.rows].toarray().astype(np.float64)
    return CommonSet(Y, pruned)


def common_set_of(folder: Path, frac: float | None = None) -> tuple[CommonSet, SampledMatrix]:
    """``common_set`` of a sampling folder without holding its Y_hat: greedy pruning of the observation mask
    (``observed_mask``, 5 bytes an entry), then only the common set's columns read, and with ``frac`` also those seen
    under >= frac of the prompts (the missing-data estimator's, ``incomplete.frequent``). Returns it and that part of
    the sample (its prompts' tokens, N and cost whole)."""
    mask = observed_mask(folder)
    pruned, columns = greedy_prune(mask), np.zeros(mask.shape[1], dtype=bool)
    columns[pruned.cols] = True
    if frac is not None:
        columns[incomplete.frequent(mask, frac)] = True
    del mask
    sampled = load_samples(folder, columns)
    return common_set(sampled, pruned), sampled


def estimate_on(Y: np.ndarray, method: str, hyper: dict) -> SpectrumEstimate:
    """One estimator on a common-set matrix. A common set below 2 x 2 (a budget far too small) has no spectrum:
    robust reports not saturated with lower bound 0, paper no saddle."""
    if min(Y.shape) < 2:
        none = np.empty(0)
        diag = {"lambda": none, "a": none, "s_tilde": none, "sigma": none}
        if method == "paper":  # the thresholds it would have used, as its figure panel draws them
            diag |= {"lam_sad": hyper["lam_sad"], "lam_peak": hyper["lam_peak"]}
        return SpectrumEstimate(method, False, None, None, hyper["g"], 0 if method == "robust" else None,
                                "not saturated" if method == "robust" else "no saddle", diag)
    return estimate(Y, method, **hyper)


def estimate_both(Y: np.ndarray, spectrum: dict) -> dict[str, SpectrumEstimate]:
    """Both estimators on the same matrix, hyperparameters from params.yaml's ``spectrum``."""
    return {m: estimate_on(Y, m, spectrum[m]) for m in ("robust", "paper")}


def missing_data(S: SampledMatrix, robust: SpectrumEstimate, shape: tuple[int, int], spectrum: dict, seed: int,
                 progress: bool = False) -> SpectrumEstimate:
    """The missing-data estimator (``nv.phase1.incomplete``) as the attack uses it: where the ``robust`` estimate on the
    common set (of ``shape``) is saturated, that one (reason "ok: robust"; the ladder would be its costliest there);
    elsewhere the ladder on every observed entry of S's frequent tokens, anchored at the robust estimate's spectrum,
    with the robust detector (``spectrum.robust``) and ``spectrum.incomplete``."""
    if robust.saturated:
        return replace(robust, method="incomplete", reason="ok: robust", diagnostics={"shape": None, "rungs": []})
    return incomplete.estimate(S, incomplete.anchor(robust, shape), **spectrum["incomplete"], **spectrum["robust"],
                               seed=seed, progress=progress)


def estimate_all(S: SampledMatrix, Y: np.ndarray, spectrum: dict, seed: int, progress: bool = False
                 ) -> dict[str, SpectrumEstimate]:
    """``estimate_both`` on the common set Y of sample S, and ``missing_data`` beside them."""
    out = estimate_both(Y, spectrum)
    out["incomplete"] = missing_data(S, out["robust"], Y.shape, spectrum, seed, progress)
    return out


def _int(v) -> int | None:
    return None if v is None else int(v)


def _incomplete_fields(e: SpectrumEstimate | None) -> dict:
    """The missing-data estimate in a report (where it ran): its d_hat, lower bound, block shape and ladder."""
    if e is None:
        return {}
    return {"d_hat_incomplete_raw": e.d_hat_raw, "d_hat_incomplete": e.d_hat, "incomplete_lower_bound": e.lower_bound,
            "incomplete_block": None if e.diagnostics["shape"] is None else [int(x) for x in e.diagnostics["shape"]],
            "incomplete_rungs": [asdict(r) for r in e.diagnostics["rungs"]]}


def report(
    model: str,
    d_true: int | None,
    budget: dict,
    common_shape: tuple[int, int],
    estimates: dict[str, SpectrumEstimate],
    method: str,
    search_cost: dict | None = None,
) -> dict:
    """The metrics record (metrics/hidden_dim.json, report.json): d_hat, errors, cost, landmarks.

    ``budget`` is ``SampledMatrix.budget()``; ``common_shape`` is (D', |C|). The headline is ``method``'s estimate;
    where that is the robust one, not saturated, and ``estimates`` hold a saturated missing-data estimate
    (``estimate_all``), that one: it answers from the entries the common block drops (``estimator`` says which)."""
    chosen, paper = estimates[method], estimates["paper"]
    if method == "robust" and not chosen.saturated and getattr(estimates.get("incomplete"), "saturated", False):
        method, chosen = "incomplete", estimates["incomplete"]
    search_cost = search_cost or {"calls": 0, "tokens": 0}
    rel = None if chosen.d_hat_raw is None or not d_true else abs(chosen.d_hat_raw - d_true) / d_true
    return {
        "model": model,
        "estimator": method,
        "d_true": d_true,
        "saturated": chosen.saturated,
        "reason": chosen.reason,
        "d_hat_raw": chosen.d_hat_raw,
        "d_hat": chosen.d_hat,
        "g": chosen.g,
        "d_hat_g64": None if chosen.d_hat_raw is None else snap(chosen.d_hat_raw, 64),
        "d_hat_g128": None if chosen.d_hat_raw is None else snap(chosen.d_hat_raw, 128),
        "lower_bound": chosen.lower_bound,
        "rel_error": rel,
        "d_hat_paper": paper.d_hat,
        "d_hat_paper_raw": paper.d_hat_raw,
        "paper_reason": paper.reason,
        "i_sad": _int(paper.diagnostics.get("i_sad")),
        "i_peak": _int(paper.diagnostics.get("i_peak")),
        **_incomplete_fields(estimates.get("incomplete")),
        "D": budget["D"],
        "D_prime": int(common_shape[0]),
        "common_set_size": int(common_shape[1]),
        "N": budget["N"],
        "temperature": budget["temperature"],
        "tokens": budget["tokens"] + int(search_cost["tokens"]),
        "calls": budget["calls"] + int(search_cost["calls"]),
        "sampling_tokens": budget["tokens"],
        "search_tokens": int(search_cost["tokens"]),
    }


def sample(oracle, prompts: list[str], sampling: dict, spectrum: dict, seed: int, out_dir: Path, checkpoint_root: Path,
           identity: dict, progress: bool = True) -> tuple[Path, dict]:
    """Alg. 1 lines 1-5 into ``out_dir``: N calls per prompt, or adaptive rounds when ``sampling.N`` is 'auto'
    (``nv.phase1.adaptive``, stopping on ``sampling.estimator``, with ``spectrum``'s hyperparameters; the rounds and
    why they stopped are returned for the report)."""
    if sampling["N"] != "auto":
        return collect(oracle, prompts, sampling["N"], sampling["temperature"], seed, out_dir, oracle.vocab_size,
                       checkpoint_root=checkpoint_root, identity=identity, chunk=sampling["chunk"], progress=progress), {}
    from nv.phase1.adaptive import sample_adaptive  # adaptive builds on this module's common_set

    ladder = spectrum["incomplete"] if sampling["estimator"] == "incomplete" else None
    folder, rounds, why = sample_adaptive(oracle, prompts, sampling, spectrum["robust"], seed, out_dir, oracle.vocab_size,
                                          checkpoint_root, identity, progress, ladder=ladder)
    return folder, {"adaptive": [asdict(r) for r in rounds], "adaptive_stop": why}


def search_and_sample(oracle, params: dict, out_dir: Path, checkpoint_root: Path, progress: bool = True
                      ) -> tuple[Path, dict, dict]:
    """Prompt search (App. B.1.1) and sampling (Alg. 1 lines 1-5) on any oracle, ``params``' seed, model, search,
    sampling and spectrum sections: writes ``prompts.json`` and ``samples/`` under ``out_dir``; returns the samples
    folder, the search's cost and the adaptive rounds (empty at a fixed N), which ``estimate_and_report`` adds."""
    search, sampling = params["search"], params["sampling"]
    if sampling["N"] == "auto":  # the rounds' check before the search pays (it came after it)
        from nv.phase1.adaptive import check_rounds

        check_rounds(sampling["N0"], sampling["N_max"], sampling["growth"])
    result = search_prompts(oracle, search["D"], search["rounds"], search["batch_size"], search["explore_rounds"],
                            search["threshold"], seed=params["seed"], length=search["length"], mode=search["mode"],
                            progress=progress)
    search_cost = oracle.cost.as_dict()
    (out_dir / "prompts.json").write_text(json.dumps(result.kept, ensure_ascii=False, indent=0) + "\n")
    samples_dir, adaptive = sample(oracle, result.kept, sampling, params["spectrum"], params["seed"],
                                   out_dir / "samples", checkpoint_root, {"model": params["model"]}, progress)
    return samples_dir, search_cost, adaptive


def estimate_and_report(samples_dir: Path, spectrum: dict, model_name: str, d_true: int | None, search_cost: dict,
                        adaptive: dict, out_dir: Path, seed: int, progress: bool = True) -> dict:
    """Pruning and the estimators (Alg. 1 lines 6-7, Alg. 2, ``estimate_all``) on the samples, of which only the common
    set's and the frequent tokens' columns are read (``common_set_of``: memory holds the observation mask, not the
    sample's values): writes ``report.json`` and ``spectrum.png`` under ``out_dir`` and returns the report. No oracle
    is needed (its model may be freed first); ``d_true`` (white-box) fills the error columns only."""
    common, sampled = common_set_of(samples_dir, spectrum["incomplete"]["frac"])
    estimates = estimate_all(sampled, common.Y, spectrum, seed, progress)
    record = report(model_name, d_true, sampled.budget(), common.Y.shape, estimates, spectrum["method"], search_cost) | adaptive
    write_json(out_dir / "report.json", record)
    save(spectrum_panels(None, estimates["paper"], estimates["robust"], d_true), out_dir / "spectrum.png")
    # the figure's log axes leave matplotlib reference cycles through its frames, up to this one: collected now, or
    # the sample stays alive after the report returns, until the next full collection (the 1.5B's phase-1 stage held
    # its 4.8 GB through the budget sweep: 16.2 GB, when this read the sample whole; README, validation)
    gc.collect()
    return record


def run(oracle, params: dict, out_dir: Path, model_name: str, d_true: int | None = None, progress: bool = True) -> dict:
    """The whole phase on any oracle: search, sampling (checkpointed under ``out_dir/.checkpoints``), pruning,
    spectrum. Writes ``prompts.json``, ``samples/`` and ``report.json`` under ``out_dir``; returns the report."""
    samples_dir, search_cost, adaptive = search_and_sample(oracle, params, out_dir, out_dir / ".checkpoints", progress)
    return estimate_and_report(samples_dir, params["spectrum"], model_name, d_true, search_cost, adaptive, out_dir,
                               params["seed"], progress)
