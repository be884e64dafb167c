"""Real DVC + papermill runs of every stage in a copy of the project, at tiny parameters."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import TINY_FAMILY, write_tiny_params

BIN = Path(sys.executable).parent
FIGURES = [
    "temperature_entropy.png", "prompt_search.png", "sampling_distinct_tokens.png", "common_set_coverage.png",
    "spectrum_compare.png", "validation_budget.png", "unsaturated_spectrum.png", "expected_N_vs_D.png",
    "spectrum_carlini_vs_common_set.png", "cost_overhead.png", "timing_scaling.png", "timing_measured_vs_predicted.png",
    "timing_errors.png", "timing_cross_platform.png", "overall_error_vs_budget.png", "validation_d_vs_budget.png",
    "err_d_L_N.png", "validation_L_P_errors.png", "validation_scaling.png", "L_param_err_budget.png", "defences.png",
    "exactness_grid.png", "exactness_threshold.png", "planner.png",
]
STAGES = {"model_card", "prompt_search", "sampling", "pruning", "spectrum", "budget_sweep", "sample_complexity",
          "carlini_baseline", "timing_target", "timing_fit", "overall", "validation_phase1@qwen-0_5b",
          "validation_timing@qwen-0_5b", "validation", "defences", "exactness", "planner"} | {f"timing_reference@{m}" for m in TINY_FAMILY}


def dvc_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """One dvc command; the timeout only guards against a hang (the first repro was measured past 30 min on a
    degraded machine: each page fault ~40 us, Python's imports 10x slower)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "JUPYTER_PREFER_ENV_PATH": "1"}
    return subprocess.run([str(BIN / "dvc"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=5400)


def dvc(*args: str, cwd: Path) -> str:
    proc = dvc_run(*args, cwd=cwd)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def ran(stdout: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", stdout)


def changed(project: Path) -> set[str]:
    """The stages `dvc status` finds changed: those whose own dependencies (params, files) differ from dvc.lock."""
    return set(json.loads(dvc("status", "--json", cwd=project)))


def edit_params(project: Path, edit) -> str:
    """Apply ``edit`` to the project's params.yaml; return the text before, to restore it."""
    path = project / "params.yaml"
    before = path.read_text()
    params = yaml.safe_load(before)
    edit(params)
    path.write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False))
    return before


@pytest.fixture(scope="module")
def project(root, tmp_path_factory) -> Path:
    """The committed + untracked (not ignored) files of the project, as a fresh git repo, tiny params."""
    dest = tmp_path_factory.mktemp("project")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for f in files:
        if (root / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
    for f in FIGURES:  # committed figures must be regenerated, not found
        (dest / "figures" / f).unlink(missing_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    dvc("pull", "-q", "data.dvc", cwd=dest)
    write_tiny_params(root, dest)
    return dest


def test_repro_runs_every_stage_and_writes_every_figure(project):
    """The shipped `timing_target.d_hat: phase1`: phase 2 reads phase 1's result. At tiny budgets phase 1 is not
    saturated, and the timing stage must stop on phase 1's own verdict (not time a made-up d); with the int the
    error message asks for (the true d here), the rest of the pipeline runs and its phase 2 gives real values."""
    assert yaml.safe_load((project / "params.yaml").read_text())["timing_target"]["d_hat"] == "phase1"
    first = dvc_run("repro", cwd=project)
    assert first.returncode != 0, first.stdout[-3000:]
    hidden = json.loads((project / "metrics" / "hidden_dim.json").read_text())  # phase 1 finished first
    assert (hidden["saturated"], hidden["d_hat"], hidden["reason"]) == (False, None, "not saturated")
    assert 0 <= hidden["lower_bound"] < min(hidden["D_prime"], hidden["common_set_size"])
    log = first.stdout + first.stderr
    assert f"phase 1 found no hidden dimension ({hidden['reason']}): raise its budget or set timing_target.d_hat" in log
    assert "Running stage 'timing_target'" in log and not list((project / "outputs" / "timing_target").glob("*.json"))
    edit_params(project, lambda p: p["timing_target"].update(d_hat=576))
    out = dvc("repro", cwd=project)
    assert set(ran(first.stdout)) | set(ran(out)) == STAGES
    assert not {"prompt_search", "sampling", "pruning", "spectrum"} & set(ran(out))  # phase 1 is not redone
    for f in FIGURES:
        assert (project / "figures" / f).stat().st_size > 10_000, f
    metrics = json.loads((project / "metrics" / "hidden_dim.json").read_text())
    assert metrics == hidden
    for key in ("model", "estimator", "d_true", "d_hat_raw", "d_hat", "rel_error", "d_hat_paper", "D", "D_prime",
                "common_set_size", "N", "tokens", "calls", "i_sad", "i_peak"):
        assert key in metrics
    assert metrics["d_true"] == 576 and metrics["D"] == 120 and metrics["N"] == 5000
    sweep = (project / "outputs" / "budget_sweep" / "sweep.csv").read_text()
    assert sweep.count("\n") == 1 + 2 * 3  # header + 2 budgets x 3 estimators (robust, paper, missing-data)
    card = (project / "outputs" / "model_card" / "temperature_entropy.csv").read_text()
    assert "top100_mass" in card
    check_phase2(project)
    check_validation(project)
    check_exactness(project)
    check_planner(project)
    check_defences(project)


def check_defences(project: Path) -> None:
    """One row per (knob, setting) and the undefended rows, which reproduce the budget sweep's verdict at the sampling
    N and the timing fit's L_hat of the target on the reference platform exactly."""
    table = pd.read_csv(project / "outputs" / "defences" / "results.csv", keep_default_na=False)
    assert list(table.columns) == ["knob", "setting", "phase", "without_counter", "with_counter", "at_10x", "adaptive",
                                   "paper_estimator", "cost"]
    swept = [("round_decimals", "1"), ("noise_sigma", "0.1"), ("top_k", "50"), ("latency_quantum_ms", "100"), ("delay_exp_ms", "50")]
    assert set(zip(table.knob, table.setting.astype(str))) == {("none", ""), *swept}
    sweep = pd.read_csv(project / "outputs" / "budget_sweep" / "sweep.csv")
    at_N = sweep[(sweep.N == 5000) & (sweep.method == "robust")].iloc[0]
    undefended = table[(table.knob == "none") & (table.phase == 1)].iloc[0]
    assert undefended.without_counter == f"not saturated (d >= {int(at_N.lower_bound)})"
    # the adaptive replay of the undefended draws ends, unsaturated, at the loop's round 4,000 (its next, 8,000, is past
    # the stored 5,000), with that round's bound
    adaptive = pd.read_csv(project / "outputs" / "defences" / "adaptive.csv", keep_default_na=False)
    none = adaptive[adaptive.knob == "none"].iloc[0]
    assert none.N == 4000 and undefended.adaptive == (f"no stop by N = 4,000 (d >= {int(none.lower_bound)}; its next round "
                                                      "is past the stored draws)")
    assert list(zip(adaptive.knob, adaptive.setting.astype(str))) == [("none", ""), *swept[:3]]
    assert {str(n) for n in adaptive.N} <= {"", "1000", "2000", "4000"}  # every row ends at a round of the loop's
    fit = pd.read_csv(project / "outputs" / "timing_fit" / "estimates.csv")
    L_hat = fit[(fit.role == "target") & (fit.calibration == "same platform") & (fit.d_source == "d_hat")].L_hat.iloc[0]
    phase2 = pd.read_csv(project / "outputs" / "defences" / "phase2.csv")
    assert phase2[(phase2.knob == "none") & (phase2.variant == "no_counter")].L_hat.iloc[0] == pytest.approx(L_hat, rel=1e-12)
    assert table[table.knob == "top_k"].cost.iloc[0].startswith("KL ")
    # a 100 ms clock: the honest calls' wait up to the next step, what their measured latency leaves of the quantum
    # (not the q / 2 of latencies uniform modulo q), as the phase-2 table's added latency says
    price = table[table.knob == "latency_quantum_ms"].cost.iloc[0]
    added = phase2[(phase2.knob == "latency_quantum_ms") & (phase2.variant == "no_counter")].added_ms.iloc[0]
    assert price == f"{added:,.0f} ms per request" and 0 <= added < 100, price


def check_validation(project: Path) -> None:
    """The validation set at tiny settings: both real models in metrics/validation.json with their true facts, the
    second model's own phase 1 (not saturated at N = 4000, so its lower bound is reported), its timings on the
    in-process platform, and phase 2's estimates of both at the d each sweep used."""
    summary = json.loads((project / "metrics" / "validation.json").read_text())
    entries = {e["model"]: e for e in summary["models"]}
    assert set(entries) == {"embedded", "qwen2.5-coder-0.5b"}
    # the 0.5B is tied: its file stores the embedding twice (nv.models.packaged.tied_embeddings), counted once
    truth = {"embedded": (576, 30, 134_515_008), "qwen2.5-coder-0.5b": (896, 24, 494_032_768)}
    for name, entry in entries.items():
        for key in ("model", "d_true", "d_hat_raw", "saturated", "tokens", "L_true", "L_hat", "L_lo", "L_hi", "L_lo_rule",
                    "L_hi_rule", "P_true", "P_hat", "P_lo", "P_hi", "P_lo_rule", "P_hi_rule", "P_hat_paper", "P_hat_oracle"):
            assert key in entry, (name, key)
        assert (entry["d_true"], entry["L_true"], entry["P_true"]) == truth[name]
        assert entry["saturated"] is False and entry["d_hat_raw"] is None and entry["L_hat"] is None  # no d_hat: no phase 2
        assert 0 <= entry["lower_bound"] < entry["d_true"] and entry["d_lo"] == entry["lower_bound"] and entry["tokens"] > 0
    qwen = json.loads((project / "outputs" / "validation_phase1" / "qwen-0_5b" / "report.json").read_text())
    assert (qwen["d_true"], qwen["D"], qwen["N"], qwen["saturated"]) == (896, 120, 4000, False)
    record = json.loads((project / "outputs" / "validation_timing" / "qwen-0_5b" / "inprocess.json").read_text())
    assert (record["d_used"], record["L"], record["trials"], record["lengths"]) == (896, 24, 5, [291, 361, 430, 500])
    assert not (project / "outputs" / "validation_timing" / "qwen-0_5b" / "llamacpp.json").exists()
    timing = pd.read_csv(project / "outputs" / "validation" / "timing.csv")
    assert set(timing.model) == {"embedded", "qwen2.5-coder-0.5b"} and set(timing.setup) == {"F", "all"}
    same = timing[timing.calibration == "same platform"]
    basic, text = same.rule == "basic", lambda notes: notes.astype(object).fillna("")  # an all-empty column reads as float
    # the attacker-side P_ne_hat, or the reason there is none: the tiny references' prefill curves can be too flat for a
    # positive per-parameter cost (the calibration says so), or the rule's L_hat too deep, its attention term leaving no
    # time for the parameters (the note names that estimator)
    explained = np.array([("prefill calibration" in note or f"the {rule} estimator's" in note)
                          for note, rule in zip(text(same.note_prefill), same.rule)])
    rule_L = np.where(basic, same.L_hat, same.L_hat_eq10)
    rule_P_ne = np.where(basic, same.P_ne_hat_basic, same.P_ne_hat_eq10)
    # a depth, or the fit's own reason for none (a slope under 2 standard errors: two trials of a few hundred tokens
    # on a loaded machine can give it), and a depth for most cases: a broken timing path gives none anywhere
    reason = np.where(basic, text(same.note) + text(same.note_t_basic), text(same.note_eq10) + text(same.note_t_eq10))
    assert ((rule_L > 0) | (reason != "")).all() and (rule_L > 0).mean() >= 0.5, same
    assert (pd.notna(rule_P_ne) | explained | ~(rule_L > 0)).all(), same
    for cover in (summary["coverage"], summary["coverage"]["rule"]):  # the hull of both estimators', the rule's alone
        # lower bounds (below the truth): uninformative, not 3 of 3 covered (2026-12-06 evening)
        assert cover["d_cases"] == 0 and cover["d"] is None and cover["d_bounds"] == 3 <= cover["uninformative"]
    # where the time went: one line per executed stage (per item), from papermill's record, and the total
    times = subprocess.run([str(BIN / "python"), "-m", "nv.stage", "times"], cwd=project, capture_output=True, text=True, check=True)
    lines = times.stdout.splitlines()
    assert len(lines) == len(STAGES) + 1 and lines[-1].startswith("total"), times.stdout
    assert any(line.startswith("validation_timing@qwen-0_5b ") for line in lines)


def check_exactness(project: Path) -> None:
    """The (D, N, tau) grid at tiny settings: tau = 2 for both models on their phase-1 draws (the validation model's
    N = 4000 leaves out the 5000 column), tau = 4 for the embedded one sampled by the stage (the shipped default
    `validation_temperatures: [2.0]`); nothing is exact at these budgets, so tokens-to-exact is empty and the robust
    estimator's lower bounds stay below the truth."""
    table = pd.read_csv(project / "outputs" / "exactness" / "grid.csv")
    cells = table.groupby(["model", "temperature"]).size().to_dict()
    assert cells == {("embedded", 2.0): 12, ("embedded", 4.0): 12, ("qwen2.5-coder-0.5b", 2.0): 6}, cells  # x 3 estimators
    robust = table[table.method == "robust"]
    assert (robust.outcome == "not saturated").all() and (robust.lower_bound < robust.d_true).all()
    assert (table.calls == table.D * table.N).all() and (table.tokens > table.calls).all()
    # tau = 2 is the sampling stage's own sample: the full cell is the pruning stage's common set
    full = robust[(robust.model == "embedded") & (robust.temperature == 2.0) & (robust.D == 120) & (robust.N == 5000)].iloc[0]
    hidden = json.loads((project / "metrics" / "hidden_dim.json").read_text())
    assert (full.D_prime, full.C, full.lower_bound) == (hidden["D_prime"], hidden["common_set_size"], hidden["lower_bound"])
    efficiency = json.loads((project / "metrics" / "efficiency.json").read_text())
    assert len(efficiency["tokens_to_exact"]) == 3 * 3 and all(r["tokens"] is None for r in efficiency["tokens_to_exact"])
    assert all(0 <= r["best_lower_bound"] < r["d_true"] and r["wrong_cells"] == 0  # the honesty check, per group
               for r in efficiency["tokens_to_exact"] if r["method"] in ("robust", "incomplete"))
    # the adaptive loop replayed on each model's tau = 2 draws (N0 = 1000, x2: its rounds up to the stored N), searched
    # down from there: never stable here, so the search ends at its top round, unsaturated; the stored 5,000 is no
    # round of the loop's (it was assessed as one before a review), whose next, 8,000, is past the draws
    adaptive = {r["model"]: r for r in efficiency["adaptive"]}
    assert set(adaptive) == {"embedded", "qwen2.5-coder-0.5b"} and all(r["stop"] == "stored draws" for r in adaptive.values())
    assert (adaptive["embedded"]["rounds"], adaptive["embedded"]["N"]) == (3, 4000)  # 1000, 2000, 4000
    assert adaptive["embedded"]["tokens"] * 5000 == full.tokens * 4000 and adaptive["embedded"]["d_hat_raw"] is None
    assert all(0 <= r["lower_bound"] < r["d_true"] for r in adaptive.values())
    # nothing exact at these budgets: the edge ratio R of every cell is there, and no threshold can be bracketed
    assert np.allclose(table.R, table.D_prime * table.C / (np.sqrt(table.D_prime) + np.sqrt(table.C)) ** 2)
    assert [(r["model"], r["exact_cells"], r["R_min_exact"], r["separates"]) for r in efficiency["threshold"]] == [
        ("embedded", 0, None, None), ("qwen2.5-coder-0.5b", 0, None, None)]


def check_planner(project: Path) -> None:
    """The planner at tiny settings, both models: a 60-prompt x 1000-call pilot inside each sample, its prediction of
    the common set over all 120 prompts at every budget of the model's sweep. Tiny samples of a real model share few
    tokens, so only the bookkeeping and the sign of the prediction are asserted (the accuracy is README: planner)."""
    table = pd.read_csv(project / "outputs" / "planner" / "planner.csv")
    assert set(zip(table.model, table.N)) == {("embedded", 2000), ("embedded", 5000), ("qwen2.5-coder-0.5b", 4000)}
    assert (table.D == 120).all() and (table.predicted_C >= 0).all() and (table.measured_C <= table.pruned_C).all()
    summary = json.loads((project / "metrics" / "planner.json").read_text())["models"]
    assert {(m["model"], m["pilot_prompts"], m["pilot_N"]) for m in summary} == {("embedded", 60, 1000),
                                                                              ("qwen2.5-coder-0.5b", 60, 1000)}
    assert all(m["tokens_fitted"] > 0 and 0 < m["pilot_share"] < 0.5 for m in summary)
    # the measured adaptive stop is the exactness stage's, where that loop stopped inside the draws (here neither did)
    stops = json.loads((project / "metrics" / "efficiency.json").read_text())["adaptive"]
    assert {m["model"]: m["adaptive_stop_N"] for m in summary} == {r["model"]: r["N"] if r["stop"] == "stable" else None
                                                                   for r in stops} == {"embedded": None, "qwen2.5-coder-0.5b": None}


def check_phase2(project: Path) -> None:
    """Phase 2's real values at tiny settings (5 trials trimmed to 3, 5 lengths, three 2-6-layer references of width 256-320).

    Measured here: same platform L_hat 33-62 (basic) and 27-39 (Eq. 10) for the true 30 on an idle machine, but 9.1
    (Eq. 10) in a CI run and 4.5 (basic) beside another stage, and on a degraded machine (a page fault ~15 us, stalls of
    seconds) the target's in-process T came out [0.53, -0.08, 0.39, 0.42, 0.84] s over 187-500 tokens: 3 kept trials
    follow the machine, not the model. So nothing here depends on the timings' values (the accuracy at real settings is
    the README's, measured on an idle machine): the sweep, the server's token counts, and that every fit gives a depth
    or says why not."""
    # Stage 1: the target's sweep is App. D's for d_hat = 576 with the default ratios and r = 0.1, capped by
    # p_max = 700: ell* = floor((576 + 144 + 1.5 * 2016) * 0.1) = 374, four points on [187, 500] plus ell*
    for platform in ("inprocess", "llamacpp"):
        record = json.loads((project / "outputs" / "timing_target" / f"{platform}.json").read_text())
        assert record["lengths"] == [187, 291, 374, 396, 500] and record["d_used"] == 576 and record["L"] == 30
        assert all(abs(e - t) <= 8 for e, t in zip(record["ell"], record["lengths"]))  # the server's own counts
        assert len(record["T"]) == 5 and np.all(np.isfinite(record["T"])) and np.all(np.array(record["sigma"]) >= 0)
    timing = json.loads((project / "metrics" / "timing.json").read_text())
    rows = {(r["calibration"], r["d_source"]): r for r in timing["target"]}
    assert set(rows) == {("same platform", "d_hat"), ("same platform", "true d"),
                         ("inprocess -> llamacpp", "d_hat"), ("inprocess -> llamacpp", "true d")}
    for (calibration, source), row in rows.items():
        assert row["L_true"] == 30 and row["trials"] == 5 and row["d_used"] == 576 and len(row["lengths"]) == 5
        assert row["P_true"] == 134_515_008
        if row["beta"] is None:  # a calibration fit that failed (Eqs. 6-8 need positive slopes) says so
            assert "must be positive" in row["note"], row
            continue
        assert row["beta"] > 0 and row["k"] > 0, row
        for suffix in ("", "_eq10"):  # a positive depth with its error, or the reason there is none
            L_hat, note = row[f"L_hat{suffix}"], row[f"note{suffix}"]
            if note:
                assert L_hat is None and "do not grow with ell^2 d" in note, row
            else:
                assert L_hat > 0 and row[f"L_err{suffix}"] == pytest.approx(abs(L_hat - 30) / 30), row
    same = rows[("same platform", "d_hat")]
    assert same["k"] == 1.0 or same["beta"] is None
    assert same["L_hat"] == rows[("same platform", "true d")]["L_hat"]  # d_hat = d = 576: the same fit


def test_second_repro_reruns_nothing(project):
    out = dvc("repro", cwd=project)
    assert ran(out) == [] and "didn't change" in out
    assert "up to date" in dvc("status", cwd=project)


@pytest.mark.parametrize("knob", ["robust", "incomplete"])
def test_a_spectrum_parameter_changes_exactly_the_stages_that_declare_it(project, knob):
    """dvc.yaml's params: `spectrum.robust` and `spectrum.incomplete` are read by sampling (adaptive sampling's stop
    rule; the missing-data estimator's with sampling.estimator: incomplete) and by every stage that estimates a
    spectrum, and by nothing else (not the search, the model card, the timings or the sample complexity).
    `dvc status` checks the declarations without the ~20 min rerun (DVC then reruns a stage downstream of these only
    where an output it reads changed); `dvc exp run` below does a real one-parameter rerun."""
    edit = {"robust": {"z_min": 9.0}, "incomplete": {"tol": 0.01}}[knob]
    before = edit_params(project, lambda p: p["spectrum"][knob].update(edit))
    assert changed(project) == {"sampling", "spectrum", "budget_sweep", "exactness", "carlini_baseline",
                                "validation_phase1@qwen-0_5b", "validation", "defences"}
    (project / "params.yaml").write_text(before)
    assert changed(project) == set()


def test_adding_a_reference_model_changes_its_stage_and_the_fits_that_read_the_family(project):
    before = edit_params(project, lambda p: p["timing_family"].update({"t-192x2": {"d": 192, "L": 2, "n_kv_heads": 1,
                                                                                   "d_ffn": 384}}))
    assert changed(project) == {"timing_reference@t-192x2", "timing_fit", "overall", "validation", "defences"}
    (project / "params.yaml").write_text(before)
    assert changed(project) == set()


def test_exp_run_on_one_parameter_reruns_only_the_stage_that_reads_it(project):
    """`dvc exp run -S` (a reviewer's one-parameter experiment) on the committed copy runs only the stage that
    reads the parameter (the planner's; the spectrum test above checks a parameter many stages read)."""
    dvc("repro", cwd=project)  # nothing after the tests above; the whole pipeline when this test runs alone
    for args in (["config", "user.name", "nv-test"], ["config", "user.email", "nv-test@localhost"], ["add", "-A"],
                 ["commit", "-q", "-m", "base"]):  # dvc exp needs a commit, and commits the experiment itself
        subprocess.run(["git", *args], cwd=project, check=True, capture_output=True, timeout=300)
    before = (project / "metrics" / "planner.json").read_text()
    assert set(ran(dvc("exp", "run", "-S", "planner.min_seen=5", cwd=project))) == {"planner"}
    assert yaml.safe_load((project / "params.yaml").read_text())["planner"]["min_seen"] == 5
    assert (project / "metrics" / "planner.json").read_text() != before  # the planner fitted fewer tokens
    assert len(dvc("exp", "list", "--name-only", cwd=project).split()) == 1
