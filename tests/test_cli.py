"""`nv attack --simulate`: the whole phase 1 from the command line, on the real embedded model."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import write_tiny_params

NV = [sys.executable, "-m", "nv.cli"]


def test_attack_simulate_writes_report_and_says_not_saturated_at_a_tiny_budget(root, tmp_path):
    params = write_tiny_params(root, tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(NV + ["attack", "--simulate", "embedded", "--params", str(params), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "embedded" and report["d_true"] == 576 and report["D"] == 120
    assert report["N"] == 5000 and report["calls"] == 120 * 5000 + 2 * 96
    assert not report["saturated"] and report["reason"] == "not saturated"
    assert report["d_hat"] is None and 0 <= report["lower_bound"] <= 576  # a bound, never a confident number
    assert report["common_set_size"] < 576
    assert (out / "spectrum.png").stat().st_size > 10_000
    assert json.loads(proc.stdout.strip().splitlines()[-1])["saturated"] is False


def test_attack_errors_are_one_line_without_traceback(root, tmp_path):
    params = write_tiny_params(root, tmp_path)
    cases = [
        (["--simulate", "embedded", "--params", str(params), "--out", "/proc/nv-out"], "not writable"),
        (["--simulate", "/no/such/model.gguf", "--params", str(params), "--out", str(tmp_path / "o")], "GGUF file not found"),
        (["--simulate", "embedded", "--params", str(tmp_path / "absent.yaml")], "params file not found"),
    ]
    for args, message in cases:
        proc = subprocess.run(NV + ["attack", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith("error:") and message in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
