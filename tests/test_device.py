"""model.device (params.yaml): the target and every model built beside it land on one device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from nv.errors import NVError
from nv.models.loading import torch_device
from nv.params import load_params
from nv.phase2.platforms import reference_model, target_model

REFERENCE = {"d": 128, "L": 2, "n_kv_heads": 1, "d_ffn": 256}


def test_target_and_reference_from_one_params_file_share_the_device(root):
    params = load_params(root / "params.yaml", ["model", "timing", "timing_target"])
    target = target_model(params["model"], params["timing"], params["timing_target"], d_hat=576)
    reference = reference_model("tiny", REFERENCE, target.lm, seed=0)
    expected = "cuda" if torch.cuda.is_available() else "cpu"  # model.device: auto
    assert target.lm.model.device.type == expected
    assert {p.device.type for p in reference.lm.model.parameters()} == {expected}
    assert {p.device.type for p in target.lm.model.parameters()} == {expected}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is a valid choice here")
def test_cuda_without_a_gpu_is_a_one_line_error(root, tmp_path):
    with pytest.raises(NVError, match="model.device is cuda, but torch sees no CUDA GPU"):
        torch_device("cuda")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["model"]["device"] = "cuda"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    proc = subprocess.run([sys.executable, "-m", "nv.cli", "attack", "--simulate", "embedded", "--params", str(path),
                           "--out", str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: model.device is cuda, but torch sees no CUDA GPU on this machine: "
                                                "set model.device to auto or cpu"]


def test_bad_device_value_names_the_key(root, tmp_path):
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["model"]["device"] = "tpu"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(NVError, match=r"model\.device.*one of \('auto', 'cpu', 'cuda'\)"):
        load_params(path, ["model"])


def test_auto_picks_cuda_where_torch_sees_a_gpu(monkeypatch):
    # Mocked: no GPU exists on this machine or in CI, so torch's answer is the only thing faked here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_device("auto") == "cuda"
    assert torch_device("cpu") == "cpu"
