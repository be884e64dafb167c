"""Profiles: profiles/paper.yaml merged into a copy of params.yaml (nv.profile), and `make repro PROFILE=paper`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nv.errors import NVError
from nv.params import load_params
from nv.profile import apply
from nv.registry import load_registry

BIN = Path(sys.executable).parent


@pytest.fixture
def params(root, tmp_path) -> Path:
    return Path(shutil.copy(root / "params.yaml", tmp_path / "params.yaml"))


def run_apply(profile: Path, params: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nv.profile", "apply", str(profile), "--params", str(params)],
                          capture_output=True, text=True, timeout=120)


def test_paper_profile_gives_valid_params_with_the_paper_values(root, params):
    default = load_params(params)
    changed = apply(root / "profiles" / "paper.yaml", params)
    p = load_params(params)  # validates every section
    assert (p["search"]["D"], p["sampling"]["N"], p["sampling"]["temperature"]) == (20_000, 1_000_000, 2.0)
    assert p["search"]["rounds"] * p["search"]["batch_size"] >= p["search"]["D"]
    assert max(p["sweep"]["budgets"]) == 1_000_000
    assert max(p["exactness"]["D_values"]) == 20_000 and max(p["exactness"]["N_values"]) == 1_000_000
    assert p["sample_complexity"]["D_values"] == [5000, 10_000, 20_000] and p["sample_complexity"]["runs"] == 40
    assert p["timing"]["platforms"] == {"inprocess": {"r": 0.6, "trials": 100, "threads": 16, "references": "all"}}
    assert all(m["platforms"] == ["inprocess"] and m["trials"] == 100 for m in p["validation"]["models"].values())
    assert max(p["overall"]["trials"]) == 100
    # the reference family: the 39 real models of App. D (32 validation + 7 development) by hub id
    registry = load_registry(root / "data")
    assert len(registry) == 39 and registry.role.value_counts().to_dict() == {"validation": 32, "development": 7}
    assert p["timing_family"] == {m.split("/", 1)[1].replace(".", "_"): {"spec": m} for m in registry.model_id}
    # everything the profile does not name is untouched, and so are params.yaml's comments
    for section in ("model", "spectrum", "live", "carlini_baseline", "timing_target", "model_card"):
        assert p[section] == default[section], section
    text = params.read_text()
    assert "# Alg. 2 / App. B.1.3 and the robust estimator (default)." in text and "  D: 20000  " in text
    assert set(changed) == {"search.D", "search.rounds", "search.batch_size", "sampling.N", "sweep.budgets",
                            "exactness.D_values", "exactness.N_values", "sample_complexity.D_values", "sample_complexity.runs", "timing.platforms", "overall.trials",
                            "timing_family", "validation.models"}
    assert apply(root / "profiles" / "paper.yaml", params) == [] and params.read_text() == text  # idempotent


def test_validation_profile_adds_the_1_5b_and_changes_nothing_else(root, params):
    default = load_params(params)
    assert [m["spec"] for m in default["validation"]["models"].values()] == ["qwen2.5-coder-0.5b"]  # default: SmolLM2 + 0.5B
    assert apply(root / "profiles" / "validation.yaml", params) == ["validation.models"]
    p = load_params(params)
    models = p["validation"]["models"]
    assert models["qwen-0_5b"] == default["validation"]["models"]["qwen-0_5b"]
    assert models["qwen-1_5b"]["spec"] == "qwen2.5-coder-1.5b" and models["qwen-1_5b"]["N"] == 1_000_000
    assert max(models["qwen-1_5b"]["budgets"]) == 1_000_000
    assert {k: v for k, v in p.items() if k != "validation"} == {k: v for k, v in default.items() if k != "validation"}
    # and params.yaml's text outside it is byte for byte the same (its nulls, list indentation and comments)
    before, after = (root / "params.yaml").read_text().splitlines(), params.read_text().splitlines()
    assert [line for line in after if line not in before] == [line for line in after if "qwen-1_5b:" in line]
    assert [line for line in before if line not in after] == []


def test_temperature_profile_changes_only_the_exactness_grid(root, params):
    default = load_params(params)
    assert sorted(apply(root / "profiles" / "temperature.yaml", params)) == [
        "exactness.D_values", "exactness.N_values", "exactness.temperatures"]
    p = load_params(params)
    grid = p["exactness"]
    # finer than the default around its cheapest exact cell, and it keeps the default's tau = 2 (the phase-1 draws)
    assert min(grid["D_values"]) < 1500 < max(grid["D_values"]) and 300_000 in grid["N_values"]
    assert len(grid["N_values"]) > len(default["exactness"]["N_values"]) and p["sampling"]["temperature"] in grid["temperatures"]
    assert max(grid["temperatures"]) > max(default["exactness"]["temperatures"])
    assert grid["validation_temperatures"] == default["exactness"]["validation_temperatures"]
    assert {k: v for k, v in p.items() if k != "exactness"} == {k: v for k, v in default.items() if k != "exactness"}


def test_unknown_key_or_bad_value_fails_with_one_line_and_leaves_params_alone(params, tmp_path):
    before = params.read_text()
    bad = tmp_path / "bad.yaml"
    cases = {"spectrum:\n  robust: {zmin: 9.0}\n": "unknown key 'spectrum.robust.zmin' (known: g, z_min, min_ratio)",
             "sampling: {N: 0}\n": "'sampling.N' must be an int >= 1 or 'auto', got 0",
             "- 1\n": "must be a mapping"}
    for override, message in cases.items():
        bad.write_text(override)
        proc = run_apply(bad, params)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
        assert params.read_text() == before  # and no temporary file is left beside it
        assert sorted(p.name for p in params.parent.iterdir()) == ["bad.yaml", "params.yaml"]
    with pytest.raises(NVError, match="file not found"):
        apply(tmp_path / "missing.yaml", params)
    (tmp_path / "latin1.yaml").write_bytes("sampling: {N: 10}  # caf\xe9\n".encode("latin-1"))  # a traceback before (a review)
    with pytest.raises(NVError, match="latin1.yaml cannot be read: not UTF-8 text"):
        apply(tmp_path / "latin1.yaml", params)


def test_a_mapping_that_is_one_value_is_replaced_whole(params, tmp_path):
    """live.extra_body and defences.knobs are values, not sections: a profile's {} empties extra_body (params.yaml's
    own advice for APIs that reject unknown fields), a new field is taken, one knob replaces the eleven; merged key by
    key, the {} kept every field, the field was an "unknown key" and the other knobs stayed."""
    profile = tmp_path / "p.yaml"
    profile.write_text("live:\n  extra_body: {}\ndefences:\n  knobs: {top_p: [0.9]}\n")
    assert apply(profile, params) == ["live.extra_body", "defences.knobs"]
    p = load_params(params)
    assert p["live"]["extra_body"] == {} and p["defences"]["knobs"] == {"top_p": [0.9]}
    profile.write_text("live:\n  extra_body: {temperature_last: true}\n")
    assert apply(profile, params) == ["live.extra_body"]
    assert load_params(params)["live"]["extra_body"] == {"temperature_last": True}


def test_cli_reports_the_changed_keys(root, params):
    proc = run_apply(root / "profiles" / "paper.yaml", params)
    assert proc.returncode == 0 and "sampling.N" in proc.stdout
    assert proc.stdout.startswith(f"{params}: 13 value(s) from {root / 'profiles' / 'paper.yaml'}: search.D")


def test_paper_profile_gives_one_dvc_stage_per_reference_model(root, params, tmp_path):
    """The family's names are valid DVC foreach keys: `dvc stage list` shows one timing_reference stage each, and DVC
    finds every stage's params in params.yaml (a dot in a name, as in the hub's Qwen2.5-0.5B-Instruct, was read as
    nesting: the stage listed, and `dvc repro` stopped after timing it, "Parameters ... are missing")."""
    apply(root / "profiles" / "paper.yaml", params)
    shutil.copy(root / "dvc.yaml", tmp_path / "dvc.yaml")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(BIN / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True, timeout=120)
    listed = subprocess.run([str(BIN / "dvc"), "stage", "list", "--name-only"], cwd=tmp_path, env=env, check=True,
                            capture_output=True, text=True, timeout=120).stdout.split()
    family = yaml.safe_load(params.read_text())["timing_family"]
    assert {s.split("@", 1)[1] for s in listed if s.startswith("timing_reference@")} == set(family)
    assert len(family) == 39
    read = ("from dvc.repo import Repo\nfrom dvc.dependency.param import ParamsDependency\n"
            "with Repo('.') as repo:\n    n = 0\n    for stage in repo.index.stages:\n"
            "        for dep in stage.deps:\n            if isinstance(dep, ParamsDependency):\n"
            "                dep.get_hash(); n += 1\nprint(n)")  # get_hash raises MissingParamsError
    found = subprocess.run([sys.executable, "-c", read], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0 and int(found.stdout) >= len(family), found.stderr[-2000:]


def test_make_repro_with_a_profile_applies_it_before_dvc_repro(root):
    dry = subprocess.run(["make", "-n", "-C", str(root), "repro", "PROFILE=paper"], capture_output=True, text=True,
                         check=True).stdout
    lines = [ln for ln in dry.splitlines() if "nv.profile" in ln or "dvc repro" in ln]
    assert lines == [".venv/bin/python -m nv.profile apply profiles/paper.yaml", ".venv/bin/dvc repro"]
    plain = subprocess.run(["make", "-n", "-C", str(root), "repro"], capture_output=True, text=True, check=True).stdout
    assert "nv.profile" not in plain
