"""params.yaml validation: one-line errors naming the key, on the CLI without a traceback."""

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
    ],
)
def test_wrong_type_or_range_names_the_key(tmp_path, params, section, key, value, message):
    params[section][key] = value
    with pytest.raises(NVError, match=message.replace("(", r"\(")) as err:
        load_params(write(tmp_path, params))
    assert "\n" not in str(err.value)


def test_missing_key_section_seed_and_bad_yaml(tmp_path, params):
    del params["model"]["dtype"]
    with pytest.raises(NVError, match="missing key 'model.dtype'"):
        load_params(write(tmp_path, params))
    with pytest.raises(NVError, match="missing section 'nope'"):
        load_params(write(tmp_path, {"seed": 1}), ["nope"])
    with pytest.raises(NVError, match="'seed' must be an int"):
        load_params(write(tmp_path, {"seed": "x"}))
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(NVError, match="not valid YAML"):
        load_params(tmp_path / "bad.yaml")
    with pytest.raises(NVError, match="params file not found"):
        load_params(tmp_path / "absent.yaml")


def test_stage_cli_one_line_error_no_traceback(tmp_path, params, root):
    params["model"]["batch_size"] = "lots"
    write(tmp_path, params)
    proc = subprocess.run([sys.executable, "-m", "nv.stage", "model_card"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: params: 'model.batch_size' must be int, got str 'lots'"
