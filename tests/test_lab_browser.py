"""`make lab` end to end in a real browser: JupyterLab started as the Makefile starts it (as root too), the
inspection notebook opened in headless Chromium, Run All Cells from the Run menu, then one detector slider
dragged with the mouse; the displayed estimates and the displayed figure must both change.

The notebook's input is a tiny synthetic common set (outputs/pruning/common_set.npz, key Y, as the pruning stage
stores it): log-probabilities of a toy LM whose logits have rank R, plus noise, so the robust detector finds the
drop after R at z_min = 8 (params.yaml) and reports "not saturated" at z_min = 50. The project root the server
serves is a temporary folder with params.yaml, that matrix and a verbatim copy of the notebook; the kernel imports
nv from the venv.

Needs Debian's chromium and the `playwright` package (driven with executable_path, never `playwright install`)
and JupyterLab (requirements-interactive.txt); `make test` installs them. Where one is missing the test fails in one line saying
which and how to install it: a skip would let `make test` (and CI) end green without ever opening the notebook.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from nv.models.llama_server import free_port

CHROMIUM = Path(os.environ.get("NV_CHROMIUM", "/usr/bin/chromium"))
# as root, Chromium needs --no-sandbox; the rest keep it off this machine's closed network
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL = "apt-get install -y chromium; .venv/bin/pip install -r requirements-interactive.txt"
NOTEBOOK = "notebooks/90_inspect_spectrum.ipynb"
TOKEN = "nv-lab-browser-test"
R, D, VOCAB = 12, 80, 300
Z_MAX = 50.0  # the notebook's z_min slider maximum: where the drag ends
WAIT_MS = 120_000  # generous: a loaded 2-core machine; every wait is on a condition, none is a sleep


def _missing() -> list[str]:
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"chromium ({CHROMIUM})")
    for module, what in (("playwright", "the playwright package"),
                         ("jupyterlab", "jupyterlab")):
        try:
            __import__(module)
        except ImportError:
            missing.append(what)
    return missing


def _jupyter() -> str:
    local = Path(sys.executable).with_name("jupyter")
    return str(local) if local.exists() else (shutil.which("jupyter") or "jupyter")


def _project(root: Path, dest: Path) -> Path:
    """A project root for the server: params.yaml, the notebook verbatim, a tiny stored common set."""
    (dest / "notebooks").mkdir(parents=True)
    shutil.copy(root / "params.yaml", dest / "params.yaml")
    shutil.copy(root / NOTEBOOK, dest / NOTEBOOK)
    rng = np.random.default_rng(0)
    z = rng.normal(size=(D, R)) @ rng.normal(scale=0.5, size=(VOCAB, R)).T / 2
    Y = z - np.logaddexp.reduce(z, axis=1, keepdims=True) + 0.05 * rng.normal(size=(D, VOCAB))
    (dest / "outputs" / "pruning").mkdir(parents=True)
    np.savez(dest / "outputs" / "pruning" / "common_set.npz", Y=Y.astype(np.float32))
    return dest


def _expected(project: Path, z_min: float | None = None) -> str:
    """The robust detector's line of the notebook's status at this z_min (None: params.yaml's), computed here."""
    from nv.params import load_params
    from nv.phase1.inspect import load_spectra, recompute, summary

    spectrum = load_params(project / "params.yaml", ["spectrum"])["spectrum"]
    z_min = spectrum["robust"]["z_min"] if z_min is None else z_min
    s = summary(recompute(load_spectra(project / "outputs" / "pruning" / "common_set.npz"), spectrum["paper"],
                          {**spectrum["robust"], "z_min": z_min}))["robust"]
    return f"robust: {s['reason']}, d_hat = {s['d_hat']} (raw {s['d_hat_raw']}), lower bound {s['lower_bound']}"


def _start_lab(cwd: Path, home: Path, port: int) -> subprocess.Popen:
    """The Makefile's `lab` line (jupyter lab --no-browser --ip=127.0.0.1, --allow-root as root) on a free port
    with a known token, in its own process group; Jupyter's config, runtime and Lab settings under ``home``."""
    env = {**os.environ, "JUPYTER_PREFER_ENV_PATH": "1", "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "lab-workspaces"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    news = home / "lab-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false", "checkForUpdates": false}\n')  # no news toast over the widgets
    cmd = [_jupyter(), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={TOKEN}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(home / "lab.log", "wb") as log:  # the server keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for_lab(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            pytest.fail(f"jupyter lab exited with {proc.returncode}: {' / '.join(tail)}", pytrace=False)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)  # poll interval of the condition, not a wait for the server
    pytest.fail(f"jupyter lab did not answer {url} within {WAIT_MS // 1000} s (log: {log})", pytrace=False)


def _stop_lab(proc: subprocess.Popen, base: str) -> None:
    """Shut the kernels down through the API (they run in sessions of their own), then end the server's group."""
    import psutil

    try:
        kernels = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        kernels = []
    try:
        urllib.request.urlopen(urllib.request.Request(f"{base}/api/shutdown?token={TOKEN}", method="POST"), timeout=10)
        proc.wait(timeout=30)
    except (urllib.error.URLError, OSError, subprocess.TimeoutExpired):
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    for pid in kernels:  # only the children this server started
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def _image_digest(page, image) -> tuple[str, str]:
    """(src, sha256 of the PNG bytes the <img> shows), read back in the page from its blob URL."""
    src = image.get_attribute("src")
    data = page.evaluate("async src => Array.from(new Uint8Array(await (await fetch(src)).arrayBuffer()))", src)
    assert bytes(data[:4]) == b"\x89PNG"
    return src, hashlib.sha256(bytes(data)).hexdigest()


def test_make_lab_runs_the_inspection_notebook_and_a_slider_redraws_it(root, tmp_path):
    missing = _missing()
    if missing:
        pytest.fail(f"browser test: missing {', '.join(missing)}; install: {INSTALL} (make test installs them)",
                    pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    project = _project(root, tmp_path / "project")
    before_text, after_text = _expected(project), _expected(project, Z_MAX)
    assert before_text != after_text and "not saturated" in after_text  # the data make the slider matter
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_lab(project, tmp_path, port)
    try:
        _wait_for_lab(proc, f"{base}/lab?token={TOKEN}", tmp_path / "lab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1500, "height": 1100})
            browser.set_default_timeout(WAIT_MS)
            try:
                page = browser.pages[0] if browser.pages else browser.new_page()
                page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={TOKEN}")
                expect(page.get_by_text(re.compile(r"\|\s*Idle$"))).to_be_visible(timeout=WAIT_MS)  # kernel up
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

                status = page.locator(".widget-html-content", has_text="robust")
                error = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]',
                                     has_text="Traceback")  # JupyterLab renders an exception as stderr
                expect(status.or_(error).first).to_be_visible(timeout=WAIT_MS)
                if error.count():
                    shot = tmp_path / "lab-error.png"
                    page.screenshot(path=shot)
                    last = [ln for ln in error.first.inner_text().splitlines() if ln.strip()][-1]
                    pytest.fail(f"a notebook cell failed in JupyterLab: {last} (screenshot {shot})", pytrace=False)
                expect(status).to_contain_text(before_text, timeout=WAIT_MS)
                image = page.locator("img.widget-image")
                expect(image).to_have_attribute("src", re.compile(r"^blob:"), timeout=WAIT_MS)
                first_src, first_png = _image_digest(page, image)
                status.scroll_into_view_if_needed()
                page.screenshot(path=tmp_path / "lab-before.png")

                # drag the robust z_min handle past the right end of its track (continuous_update=False: on release)
                slider = page.locator(".widget-slider", has_text="robust z_min")
                handle = slider.locator(".noUi-handle")
                assert float(handle.get_attribute("aria-valuenow")) < Z_MAX
                handle.scroll_into_view_if_needed()
                h, track = handle.bounding_box(), slider.locator(".noUi-base").bounding_box()
                page.mouse.move(h["x"] + h["width"] / 2, h["y"] + h["height"] / 2)
                page.mouse.down()
                page.mouse.move(track["x"] + track["width"] + 40, h["y"] + h["height"] / 2, steps=12)
                page.mouse.up()
                expect(slider.locator(".widget-readout")).to_have_text(f"{Z_MAX:.2f}")
                assert float(handle.get_attribute("aria-valuenow")) == Z_MAX

                expect(status).to_contain_text(after_text, timeout=WAIT_MS)
                expect(image).not_to_have_attribute("src", first_src, timeout=WAIT_MS)
                _, png = _image_digest(page, image)
                assert png != first_png  # the figure itself was redrawn, not only re-sent
                status.scroll_into_view_if_needed()
                page.screenshot(path=tmp_path / "lab-after.png")
            finally:
                browser.close()
    finally:
        _stop_lab(proc, base)
    assert proc.poll() is not None
