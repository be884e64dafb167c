"""Stage logs carry progress and results, not the kernel's transport warning (nv.stage runs kernels over IPC)."""

from __future__ import annotations

import json
import subprocess
import sys

NOTEBOOK = {"cells": [{"cell_type": "code", "id": "p", "metadata": {"tags": ["parameters"]}, "outputs": [],
                       "execution_count": None, "source": ["x = 1"]},
                      {"cell_type": "code", "id": "c", "metadata": {}, "outputs": [], "execution_count": None,
                       "source": ["print('result', x + 1)"]}],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}

RUN = """
import sys, papermill
from nv.stage import _ipc_kernel_manager
kwargs = {{"kernel_manager_class": _ipc_kernel_manager()}} if sys.argv[1] == "ipc" else {{}}
papermill.execute_notebook({src!r}, {dst!r}, parameters={{"x": 41}}, kernel_name="python3", progress_bar=False, **kwargs)
"""


def _stderr(tmp_path, transport: str) -> str:
    src, dst = tmp_path / "in.ipynb", tmp_path / f"out-{transport}.ipynb"
    src.write_text(json.dumps(NOTEBOOK))
    proc = subprocess.run([sys.executable, "-c", RUN.format(src=str(src), dst=str(dst)), transport],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "result 42" in json.dumps([c["outputs"] for c in json.loads(dst.read_text())["cells"]])
    return proc.stderr


def test_stage_kernel_runs_over_ipc_without_the_transport_warning(tmp_path):
    assert "without encryption" in _stderr(tmp_path, "tcp")  # papermill's default: the warning a stage log had
    assert "without encryption" not in _stderr(tmp_path, "ipc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.ipynb", "out-ipc.ipynb", "out-tcp.ipynb"]  # no sockets left behind


def test_stage_times_reads_this_runs_notebooks_only(tmp_path, capsys):
    """`nv.stage times` over executed notebooks as papermill leaves them: a failed run is labelled so (it was counted
    as a run), an item folder another profile left (not in params.yaml now) is not this run's, and a notebook cut short
    (papermill rewrites it after every cell) is one line on stderr, not a traceback."""
    from nv.stage import stage_times

    def executed(path, duration, exception=False):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"metadata": {"papermill": {"duration": duration, "exception": exception}}}))

    (tmp_path / "params.yaml").write_text("timing_family:\n  ref-a: {d: 64, L: 2, n_kv_heads: 1, d_ffn: 128}\n")
    executed(tmp_path / "outputs" / "model_card" / "model_card.ipynb", 60.0)
    executed(tmp_path / "outputs" / "spectrum" / "spectrum.ipynb", 120.0, exception=True)
    executed(tmp_path / "outputs" / "timing_reference" / "ref-a" / "timing_reference.ipynb", 30.0)
    executed(tmp_path / "outputs" / "timing_reference" / "ref-old" / "timing_reference.ipynb", 3600.0)
    (tmp_path / "outputs" / "pruning").mkdir(parents=True)
    (tmp_path / "outputs" / "pruning" / "pruning.ipynb").write_text('{"metadata": {"papermill": {"dur')
    assert sorted(stage_times(tmp_path)) == [("model_card", 60.0), ("spectrum (failed)", 120.0), ("timing_reference@ref-a", 30.0)]
    assert "pruning.ipynb is unreadable (a run cut short?): left out" in capsys.readouterr().err
