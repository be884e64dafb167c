"""nv.outputs: what one stage hands the next, read back; a missing, cut-short or corrupt file is one line naming it
and the stage to rerun (a JSONDecodeError or BadZipFile traceback before, naming neither)."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from nv.errors import NVError
from nv.outputs import read_json, read_npz


def test_json_and_npz_round_trip_and_each_failure_names_the_file_and_its_stage(tmp_path):
    record = tmp_path / "outputs" / "timing_reference" / "ref-512x16" / "inprocess.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"L": 16}))
    assert read_json(record) == {"L": 16}
    record.write_text('{"L": 1')  # cut short
    with pytest.raises(NVError, match=r"inprocess.json is not valid JSON \(cut short or edited\?\): rerun "
                                      r"`dvc repro timing_reference@ref-512x16`"):
        read_json(record)
    with pytest.raises(NVError, match=r"missing .*outputs/pruning/budget.json: rerun `dvc repro pruning`"):
        read_json(tmp_path / "outputs" / "pruning" / "budget.json")
    # a checkout under a folder named outputs: the stage is read after the last one (it was "repo")
    with pytest.raises(NVError, match=r"missing .*budget.json: rerun `dvc repro pruning`$"):
        read_json(tmp_path / "outputs" / "repo" / "outputs" / "pruning" / "budget.json")
    with pytest.raises(NVError, match=r"missing .*outputs/budget.json: rerun the stage that wrote it$"):
        read_json(tmp_path / "outputs" / "budget.json")
    with pytest.raises(NVError, match=r"missing .*hidden_dim.json: rerun `dvc repro spectrum`"):
        read_json(tmp_path / "metrics" / "hidden_dim.json", "spectrum")
    common = tmp_path / "outputs" / "pruning" / "common_set.npz"
    common.parent.mkdir(parents=True, exist_ok=True)
    np.savez(common, Y=np.arange(6.0).reshape(2, 3), rows=np.array([0, 1]))
    got = read_npz(common)
    assert set(got) == {"Y", "rows"} and np.array_equal(got["Y"], np.arange(6.0).reshape(2, 3))
    whole = common.read_bytes()
    common.write_bytes(whole[:200])  # the review's `truncate -s`
    with pytest.raises(NVError, match=r"common_set.npz is corrupt \(.*\): rerun `dvc repro pruning`"):
        read_npz(common)
    common.write_bytes(whole)
    with zipfile.ZipFile(common) as z:
        info = z.getinfo("Y.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size - 16
    damaged = bytearray(whole)
    damaged[start : start + 8] = b"\xff" * 8  # inside Y's data: same size, bad CRC
    common.write_bytes(bytes(damaged))
    with pytest.raises(NVError, match=r"common_set.npz is corrupt"):
        read_npz(common)
