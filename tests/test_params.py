"""params.yaml validation: one-line errors naming the key, on the CLI without a traceback."""

import datetime
import re
import subprocess
import sys

import pytest
import yaml

from nv.errors import NVError
from nv.params import load_params


@pytest.fixture
def params(root):
    return yaml.safe_load((root / "params.yaml").read_text())


def write(tmp_path, data):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def test_shipped_params_are_valid(root):
    p = load_params(root / "params.yaml")
    assert p["seed"] == 0 and p["model"]["spec"] == "embedded"


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("model", "batch_size", "64x", "'model.batch_size' must be int, got str"),
        ("model", "batch_size", 0, "'model.batch_size' must be >= 1"),
        ("model", "batch_size", True, "'model.batch_size' must be int, got bool"),
        ("model", "logprobs", "topk", "'model.logprobs' must be one of"),
        ("model_card", "temperature", -2.0, "'model_card.temperature' must be > 0"),
        ("model_card", "top_k", 1.5, "'model_card.top_k' must be int, got float"),
        ("sampling", "growth", float("inf"), "'sampling.growth' must be a finite number, got inf"),
        ("sampling", "temperature", float("inf"), "'sampling.temperature' must be a finite number, got inf"),
        ("exactness", "temperatures", [2.0, float("inf")], "'exactness.temperatures' must be a non-empty list of finite numbers"),
        # YAML 1.1 (PyYAML) reads an exponent without a dot as text: the message says how to write the number
        ("sampling", "N_max", "1e6", "'sampling.N_max' must be int, got str '1e6' (YAML reads 1e6 as text: write 1000000)"),
        ("defence", "min_logprob", "-1e1", "'defence.min_logprob' must be int or float or null, got str '-1e1' (YAML reads -1e1 as text: write -10)"),
    ],
)
def test_wrong_type_or_range_names_the_key(tmp_path, params, section, key, value, message):
    params[section][key] = value
    with pytest.raises(NVError, match=re.escape(message)) as err:
        load_params(write(tmp_path, params))
    assert "\n" not in str(err.value)


def test_missing_key_section_seed_and_bad_yaml(tmp_path, params):
    del params["model"]["dtype"]
    with pytest.raises(NVError, match="missing key 'model.dtype'"):
        load_params(write(tmp_path, params))
    with pytest.raises(NVError, match="missing section 'nope'"):
        load_params(write(tmp_path, {"seed": 1}), ["nope"])
    with pytest.raises(NVError, match="missing key 'seed' in "):  # was "'seed' must be an int ..., got None" (a review)
        load_params(write(tmp_path, {"search": {"D": 5}}))
    for seed in ("x", -1, 2**63):  # 2^64 passed and stopped the timing stage in torch.manual_seed (a review)
        with pytest.raises(NVError, match=re.escape(f"'seed' must be an int in [0, 2^63), got {seed!r}")):
            load_params(write(tmp_path, {"seed": seed}))
    (tmp_path / "bad.yaml").write_text("seed: 0\nsweep: {budgets: [1, 2}\n")
    with pytest.raises(NVError, match="not valid YAML: expected ',' or ']', but got '}' at line 2, column 23"):
        load_params(tmp_path / "bad.yaml")
    (tmp_path / "twice.yaml").write_text("seed: 0\nsampling:\n  N: 10\n  N: 20\n")  # PyYAML alone keeps the last
    with pytest.raises(NVError, match="not valid YAML: key 'N' given twice at line 4, column 3"):
        load_params(tmp_path / "twice.yaml")
    # a merge key's entries are overridden by the mapping's own (YAML); a complex key is one line, not a TypeError
    from nv.params import _UniqueKeyLoader

    merged = yaml.load("base: &b {N: 10, N0: 5}\nsampling:\n  <<: *b\n  N: 20\n", Loader=_UniqueKeyLoader)
    assert merged["sampling"] == {"N": 20, "N0": 5}  # refused before: no constructor for the merge tag
    (tmp_path / "complex.yaml").write_text("seed: 0\n? [a, b]\n: 1\n")
    with pytest.raises(NVError, match=r"not valid YAML: a mapping key must be a scalar, got list at line 2, column 3"):
        load_params(tmp_path / "complex.yaml")
    with pytest.raises(NVError, match="params file not found"):
        load_params(tmp_path / "absent.yaml")
    with pytest.raises(NVError, match="cannot be read: Is a directory"):
        load_params(tmp_path)
    (tmp_path / "latin.yaml").write_bytes(b"seed: 0\n# caf\xe9\n")
    with pytest.raises(NVError, match="cannot be read: not UTF-8 text"):
        load_params(tmp_path / "latin.yaml")
    with pytest.raises(NVError, match="'live.extra_body' must be a mapping of plain JSON"):  # a YAML date: no JSON
        load_params(write(tmp_path, {**params, "live": {**params["live"], "extra_body": {"when": datetime.date(2024, 1, 1)}}}), ["live"])
    for field in ("temperature", "max_tokens", "model"):  # it was merged after the attack's own fields, and won
        with pytest.raises(NVError, match=r"'live.extra_body' must be .* setting none of the attack's own fields"):
            load_params(write(tmp_path, {**params, "live": {**params["live"], "extra_body": {field: 1}}}), ["live"])
    for body in ({True: 1, "top_k": 0}, {"chat_template_kwargs": {2: "x", "b": "y"}}, {1: 2}):  # YAML's `on:`, `2:`
        with pytest.raises(NVError, match=r"'live.extra_body' must be a mapping of plain JSON \(string keys"):  # a TypeError
            load_params(write(tmp_path, {**params, "live": {**params["live"], "extra_body": body}}), ["live"])  # at a run
    with pytest.raises(NVError, match=r"'live.columns' must be in \[1, 2\^24\]"):  # np.zeros(columns), after paying
        load_params(write(tmp_path, {**params, "live": {**params["live"], "columns": 10**12}}), ["live"])
    params["search"].update({1: 5, "foo": 3})  # unknown keys of two types: named, not a TypeError from sorting them
    with pytest.raises(NVError, match="unknown key 'search.1'"):
        load_params(write(tmp_path, params), ["search"])


def test_stage_cli_one_line_error_no_traceback(tmp_path, params, root):
    params["model"]["batch_size"] = "lots"
    write(tmp_path, params)
    proc = subprocess.run([sys.executable, "-m", "nv.stage", "model_card"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: params: 'model.batch_size' must be int, got str 'lots'"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["timing"]["platforms"].update(gpu={"r": 0.6, "trials": 5, "threads": 1, "references": "all"}),
         "unknown platform 'timing.platforms.gpu'"),
        (lambda p: p["timing"]["platforms"]["inprocess"].update(trials=1), "'timing.platforms.inprocess.trials' must be >= 2"),
        (lambda p: p["timing"]["platforms"]["llamacpp"].update(references=[]), "'all' or a non-empty list"),
        (lambda p: p["timing_family"].update(bad={"d": 512, "spec": "x"}),
         r"'timing_family.bad' must have exactly the keys \{d, L, n_kv_heads, d_ffn\} or \{spec\} or \{d, L, n_kv_heads, d_ffn, head_dim\}"),
        (lambda p: p["timing_family"]["ref-384x12"].update(d=0), "'timing_family.ref-384x12.d' must be >= 1"),
        (lambda p: p["timing_target"].update(d_hat="guess"), "'timing_target.d_hat' must be 'phase1' or an int"),
        (lambda p: p["timing"].update(n_lengths=5, discard=4), r"'timing.discard' must be <= n_lengths - 2 = 3 \(the fit needs two"),
    ],
)
def test_timing_sections_are_checked(tmp_path, params, edit, message):
    edit(params)
    with pytest.raises(NVError, match=message):
        load_params(write(tmp_path, params))


def test_a_reference_model_may_be_a_real_model_spec_or_have_wider_heads(tmp_path, params):
    family = {"smollm2": {"spec": "embedded"}, "h128": {"d": 1536, "L": 16, "n_kv_heads": 2, "d_ffn": 4096, "head_dim": 128}}
    params["timing_family"] = family
    params["timing"]["platforms"]["llamacpp"]["references"] = ["smollm2"]
    assert load_params(write(tmp_path, params))["timing_family"] == family


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["model"].update(colour="blue"), r"params: unknown key 'model.colour' \(known: spec, dtype, "),
        (lambda p: p["spectrum"]["robust"].update(zmin=9), r"params: unknown key 'spectrum.robust.zmin' \(known: g, z_min, min_ratio\)"),
        (lambda p: p["timing"]["platforms"]["inprocess"].update(cores=4),
         r"params: unknown key 'timing.platforms.inprocess.cores' \(known: r, trials, threads, references\)"),
    ],
)
def test_load_params_refuses_an_unknown_key(tmp_path, params, edit, message):
    """A misspelt key is an error of load_params itself (not only of nv.profile), one line naming it."""
    edit(params)
    with pytest.raises(NVError, match=message) as err:
        load_params(write(tmp_path, params))
    assert "\n" not in str(err.value)


def test_load_params_refuses_an_unknown_section(tmp_path, params):
    """A misspelt section (``defense`` for ``defence``) was passed through unchecked and ignored: now an error, also
    for a stage that asks for other sections."""
    params["defense"] = {"noise_sigma": 0.1}
    for sections in (None, ["model"]):
        with pytest.raises(NVError, match=r"params: unknown section 'defense' in .*params.yaml \(known: seed, model, "):
            load_params(write(tmp_path, params), sections)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["sampling"].update(N="many"), "'sampling.N' must be an int >= 1 or 'auto', got 'many'"),
        (lambda p: p["sampling"].update(growth=1.0), "'sampling.growth' must be > 1, got 1.0"),
        # found by the sampling stage after the prompt search had run, without the keys' names (a review)
        (lambda p: p["sampling"].update(N0=2_000_000), "'sampling.N0' = 2,000,000 is above 'sampling.N_max' = 1,000,000"),
        # the dry run planned it and the live run paid its probe before the search refused it (a review, 2026-12-07)
        (lambda p: p["search"].update(D=40, rounds=1, batch_size=16),
         "'search.rounds' x 'search.batch_size' = 16 prompts evaluated at most, fewer than 'search.D' = 40"),
        (lambda p: p["spectrum"]["robust"].update(min_ratio=0.5), "'spectrum.robust.min_ratio' must be >= 1"),
        (lambda p: p["validation"]["models"].update({"qwen2.5": p["validation"]["models"]["qwen-0_5b"]}),
         "'validation.models.qwen2.5': a stage item name may hold only letters, digits, '_' and '-'"),
        (lambda p: p["validation"]["models"]["qwen-0_5b"].update(platforms=["gpu"]),
         "'validation.models.qwen-0_5b.platforms' must be a non-empty list of ('inprocess', 'llamacpp')"),
        (lambda p: p["validation"]["models"]["qwen-0_5b"].pop("spec"), "missing key 'validation.models.qwen-0_5b.spec'"),
        # a shape the family's random model cannot take: found by its timing stage, without the key (a review)
        (lambda p: p["timing_family"].update({"ref-x": {"d": 384, "L": 2, "n_kv_heads": 4, "d_ffn": 1024}}),
         "'timing_family.ref-x': d = 384 must be a multiple of the head size 64 into a number of heads that n_kv_heads = 4 divides"),
        (lambda p: p["timing_family"].update({"ref-x": {"d": 400, "L": 2, "n_kv_heads": 1, "d_ffn": 1024}}),
         "'timing_family.ref-x': d = 400 must be a multiple of the head size 64"),
        # attacked twice: the validation stage refused it only after both runs (a review)
        (lambda p: p["validation"]["models"]["qwen-0_5b"].update(spec="embedded"),
         "'validation.models.qwen-0_5b.spec' = 'embedded' is model.spec's: list each model once"),
        # names taken from another section: a validation model timed on a platform params does not configure, a
        # platform's reference the family does not hold (what a profile replacing one collection whole can leave)
        (lambda p: p["timing"]["platforms"].pop("llamacpp"),
         "'validation.models.qwen-0_5b.platforms' names 'llamacpp', which is not in timing.platforms (inprocess)"),
        (lambda p: p["timing_family"].pop("ref-640x20"),
         "'timing.platforms.llamacpp.references' names 'ref-640x20', which is not in timing_family"),
        # a dotted family name passed, and DVC read it as nesting: `dvc repro` stopped after timing it
        (lambda p: p["timing_family"].update({"Qwen2.5-0.5B": {"spec": "Qwen/Qwen2.5-0.5B"}}),
         "'timing_family.Qwen2.5-0.5B': a stage item name may hold only letters, digits, '_' and '-'"),
        # a string passed as a list of names (each of its characters a name)
        (lambda p: p["timing"]["platforms"]["llamacpp"].update(references="ref-384x12"),
         "'timing.platforms.llamacpp.references' must be 'all' or a non-empty list of distinct timing_family names"),
        # trial budgets no model is timed with, or that the trim leaves under 2 trials: an empty figure's traceback,
        # a model gone from the validation, a late failure, at the end of the pipeline
        (lambda p: p["overall"].update(trials=[20, 30]),
         "'overall.trials' budget 20 is above every timing platform's trials (10, 10): no platform times it"),
        # one budget no platform times was left out without a word (the README said it is refused; a review)
        (lambda p: p["overall"].update(trials=[2, 2000]),
         "'overall.trials' budget 2000 is above every timing platform's trials (10, 10): no platform times it"),
        # a name YAML reads as a bool, None or int, or one DVC's command line reads as an option (a review)
        (lambda p: p["timing_family"].update({True: {"spec": "x"}}), "'timing_family.True': YAML reads this name as bool"),
        (lambda p: p["validation"]["models"].update({1000: p["validation"]["models"]["qwen-0_5b"]}),
         "'validation.models.1000': YAML reads this name as int, not text: quote it"),
        (lambda p: p["timing_family"].update({"-ref": {"spec": "x"}}), "'timing_family.-ref': a stage item name may hold"),
        # a reference listed twice weighed twice in every fit (a review)
        (lambda p: p["timing"]["platforms"]["llamacpp"].update(references=["ref-384x12", "ref-384x12"]),
         "'timing.platforms.llamacpp.references' must be 'all' or a non-empty list of distinct timing_family names"),
        (lambda p: p["overall"].update(trials=[6, 10]),
         "'validation.models.qwen-0_5b.trials' = 5 is below every overall.trials budget (6, 10)"),
        (lambda p: (p["overall"].update(trials=[3, 10]), p["timing"].update(trim=0.34)),
         "'timing.trim' = 0.34 on overall.trials = 3 keeps fewer than 2 trials"),
        # found after the model's sweeps were timed (a review)
        (lambda p: (p["overall"].update(trials=[10]), p["timing"].update(trim=0.4)),
         "'timing.trim' = 0.4 on validation.models.qwen-0_5b.trials = 5 keeps fewer than 2 trials"),
    ],
)
def test_adaptive_sampling_and_validation_entries_are_checked(tmp_path, params, edit, message):
    edit(params)
    with pytest.raises(NVError, match=re.escape(message)):
        load_params(write(tmp_path, params))


def test_the_tests_tiny_params_are_a_valid_configuration(root, tmp_path):
    """The tiny pipeline's params (tests/conftest.py) pass every check at load, as the stages' would; its K' budgets
    were refused only by the overall stage, minutes into the pipeline test."""
    from conftest import write_tiny_params

    assert load_params(write_tiny_params(root, tmp_path))["overall"]["trials"] == [2, 5]


def test_the_family_head_size_is_the_random_models():
    """params' check of a family shape and the random model it builds take one head size."""
    from nv.models import reference_family
    from nv.params import HEAD_DIM

    assert HEAD_DIM == reference_family.HEAD_DIM


def test_sampling_n_may_be_auto(tmp_path, params):
    params["sampling"]["N"] = "auto"
    assert load_params(write(tmp_path, params))["sampling"]["N"] == "auto"


def test_every_notebooks_parameter_defaults_are_a_valid_configuration(root, params):
    """A notebook run on its own defaults (JupyterLab, plain papermill) meets no missing key: each section default is
    None (a documented switch the stage fills) or passes params.yaml's schema; only an empty set of items (no
    validation models, no reference family) may stand for the shipped one."""
    import json

    from nv.params import SCHEMA, EachOf, check_section

    def filled(value, shipped, schema):  # empty item sets replaced by the shipped ones, recursively
        if isinstance(schema, EachOf):
            return value or shipped
        if isinstance(schema, dict) and isinstance(value, dict):
            return {k: filled(v, (shipped or {}).get(k), schema.get(k)) for k, v in value.items()}
        return value

    checked = 0
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        (cell,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        defaults: dict = {}
        exec("".join(cell["source"]), defaults)
        for name, value in defaults.items():
            if name in SCHEMA and value is not None:
                try:
                    check_section(name, filled(value, params[name], SCHEMA[name]))
                except NVError as exc:
                    pytest.fail(f"{path.name}: {exc}")
                checked += 1
    assert checked >= 40
