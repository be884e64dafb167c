"""Loading: the embedded model's true architecture, the cache, errors, prompt formatting, memory release."""

import ctypes
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nv.errors import NVError
from nv.models.loading import architecture, load_model, resolve
from nv.models.packaged import PACKAGED
from nv.oracle.prompts import PromptFormat


def test_embedded_architecture_from_config(lm32):
    a = lm32.arch
    assert (a.d, a.L, a.vocab_size, a.n_heads, a.n_kv_heads, a.d_ffn) == (576, 30, 49152, 9, 3, 1536)
    assert a.tied_embeddings and a.params == 134_515_008


def test_the_registry_and_the_packaged_table_agree_with_the_model(lm32, root):
    from nv.models.packaged import PACKAGED
    from nv.registry import load_registry

    facts = PACKAGED["embedded"].facts
    assert (facts["d"], facts["L"], facts["vocab_size"], facts["d_ffn"]) == (lm32.arch.d, lm32.arch.L, lm32.arch.vocab_size, lm32.arch.d_ffn)
    table = load_registry(root / "data")
    assert len(table) == 39 and (table.role == "development").sum() == 7
    row = table.set_index("model_id").loc["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert (row.d, row.L, row.vocab_size, row.d_ffn, row.n_heads, row.n_kv_heads) == tuple(
        facts[k] for k in ("d", "L", "vocab_size", "d_ffn", "n_heads", "n_kv_heads"))


def test_chat_template_uses_the_default_system_prompt(lm32):
    text = PromptFormat(lm32.tokenizer, template=True).text("abc")
    assert "You are a helpful AI assistant named SmolLM" in text and text.endswith("assistant\n")
    assert PromptFormat(lm32.tokenizer, template=False).text("abc") == "abc"


def test_model_without_chat_template_falls_back_to_raw(lm32, caplog, monkeypatch):
    monkeypatch.setattr(lm32.tokenizer, "chat_template", None)  # the real tokenizer without its template, restored after
    with caplog.at_level(logging.WARNING):
        fmt = PromptFormat(lm32.tokenizer, template=True)
    assert not fmt.template and fmt.text("xyz") == "xyz"
    assert "no chat template" in caplog.text


def test_corrupt_cache_is_rebuilt(lm32, tmp_path):
    """The session's cache entry of the embedded model (lm32 built or read it), copied and corrupted in place (4 bytes
    every MB, the size unchanged: it used to load, silently wrong), is rebuilt from the GGUF: one dequantisation
    (~3 min on a degraded machine), not two."""
    import torch

    from nv.models.loading import _gguf_cache_folder, default_cache_dir

    source, gguf = resolve("embedded")
    cached = _gguf_cache_folder("embedded", Path(source) / gguf, default_cache_dir())
    folder = tmp_path / cached.name
    shutil.copytree(cached, folder)  # times kept: the copy's stamp holds
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        for offset in range(2**20, size, 2**20):
            f.seek(offset)
            f.write(b"\xff\xff\xff\x7f")
    assert weights.stat().st_size == size
    again = load_model("embedded", dtype="float32", cache_dir=tmp_path)
    assert again.arch == lm32.arch
    for mine, theirs in zip(again.model.parameters(), lm32.model.parameters()):
        assert torch.equal(mine, theirs)


def test_cache_is_float32_and_keyed_by_content(lm32, tmp_path):
    """The embedded GGUF copied elsewhere and loaded first in bf16 shares one cache entry with the packaged file, and
    a float32 load from it has the float32 weights (lm32's), not bf16-rounded ones; its bf16 load is lm32's, rounded."""
    import torch

    source, gguf = resolve("embedded")
    copy = tmp_path / "elsewhere" / gguf
    copy.parent.mkdir()
    shutil.copy(Path(source) / gguf, copy)
    cache = tmp_path / "cache"
    bf16 = load_model(str(copy), dtype="bfloat16", cache_dir=cache)
    f32 = load_model("embedded", dtype="float32", cache_dir=cache)
    assert [p.name for p in cache.iterdir()] == [f"{copy.stem}-{PACKAGED['embedded'].sha256[:16]}"]
    want = lm32.model.model.layers[0].mlp.down_proj.weight
    got = f32.model.model.layers[0].mlp.down_proj.weight
    assert got.dtype == torch.float32 and torch.equal(got, want) and not torch.equal(want, want.bfloat16().float())
    assert torch.equal(bf16.model.model.layers[0].mlp.down_proj.weight, want.bfloat16())


@pytest.mark.parametrize(
    "spec, message",
    [
        # the hub is offline here (HF_HUB_OFFLINE=1, conftest): an uncached hub id fails on that, and says so
        ("no-such-org/no-such-model", r"cannot load model 'no-such-org/no-such-model' \(offline: HF_HUB_OFFLINE=1\)"),
        ("/nonexistent/model.gguf", "GGUF file not found"),
    ],
)
def test_an_uncached_hub_model_or_a_missing_file_is_a_one_line_error(spec, message):
    with pytest.raises(NVError, match=message) as err:
        resolve(spec) if spec.endswith(".gguf") else load_model(spec)
    assert "\n" not in str(err.value)


def test_truncated_or_foreign_gguf_and_a_bare_folder_are_one_line_errors(tmp_path):
    """A model file the user names is checked before transformers reads it: a GGUF cut short (a download stopped at
    5 MB of the embedded model's file) and a file that is not a GGUF each give one line; so does a folder without
    config.json (transformers' tokenizer raised a ValueError there)."""
    from nv.models.loading import embedded_gguf

    with embedded_gguf().open("rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(5 << 20))
    (tmp_path / "text.gguf").write_text("not a model\n")
    cache = tmp_path / "cache"
    for name in ("cut.gguf", "text.gguf"):
        with pytest.raises(NVError, match=f"{name} is not a readable GGUF file \\(.+\\): a truncated or corrupt") as err:
            load_model(str(tmp_path / name), dtype="float32", cache_dir=cache)
        assert "\n" not in str(err.value)
    (tmp_path / "folder").mkdir()
    with pytest.raises(NVError, match="has no config.json"):
        resolve(str(tmp_path / "folder"))
    # a model transformers cannot build (an unknown model_type) and one without attention (a state-space model) were
    # tracebacks (ValueError, AttributeError: a review)
    (tmp_path / "folder" / "config.json").write_text('{"model_type": "foo"}')
    with pytest.raises(NVError, match="cannot load model .*folder") as err:
        load_model(str(tmp_path / "folder"), dtype="float32", cache_dir=cache)
    assert "\n" not in str(err.value)
    from transformers import MambaConfig, MambaForCausalLM

    with pytest.raises(NVError, match="model type 'mamba' is not a transformer decoder"):
        architecture(MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=64, state_size=4)))


def test_bad_dtype_is_refused():
    with pytest.raises(NVError, match="dtype must be one of"):
        load_model("embedded", dtype="float16")


def test_cli_reports_unknown_model_without_traceback(tmp_path, root):
    params = (root / "params.yaml").read_text().replace("spec: embedded", "spec: no-such-org/no-such-model")
    (tmp_path / "params.yaml").write_text(params)
    shutil.copytree(root / "notebooks", tmp_path / "notebooks")
    proc = subprocess.run(
        [sys.executable, "-m", "nv.stage", "model_card"], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and "no-such-org/no-such-model" in lines[-1]
    assert "Traceback" not in proc.stderr


RELEASE = """
import gc
import numpy as np
from nv.models.loading import release_memory
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
big = np.ones(16 << 20, dtype=np.uint8); del big  # a freed mmapped block: glibc raises its mmap threshold past 8 MB
blocks = [np.ones(8 << 20, dtype=np.uint8) for _ in range(100)]
del blocks[::2]  # 50 freed 8 MB heap blocks between live ones
a = rss(); gc.collect(); b = rss(); release_memory(); c = rss()
print(a - b, b - c)
"""


def test_release_memory_hands_freed_heap_blocks_back():
    """What a stage does after ``del oracle``: glibc keeps freed heap blocks that sit between live ones (a model's
    activations), so the process stays as large; ``release_memory`` trims them. A fresh process: its heap is this
    test's alone."""
    if getattr(ctypes.CDLL(None), "malloc_trim", None) is None:
        pytest.skip("no glibc malloc_trim here: release_memory is a garbage collection only")
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True, timeout=120).stdout
    by_gc, by_release = map(float, out.split())
    assert by_gc < 50 and by_release > 300  # MiB: 400 MiB of holes, held until trimmed


def test_float32_linear_is_a_bf16_gemm():
    """``_float32_linear`` (hosts without a bf16 GEMM): the float32 product of bf16 values, rounded to bf16, is the
    correctly rounded product of those values, as torch's own bf16 GEMM returns up to the order of the sums; float32
    inputs pass through ``F.linear`` unchanged."""
    import torch
    import torch.nn.functional as F

    from nv.models.loading import _float32_linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(2048, 512).to(torch.bfloat16)
    x = torch.randn(64, 2048).to(torch.bfloat16)
    with torch.no_grad():
        exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        ours, theirs = _float32_linear(layer, x), layer(x)
        assert ours.dtype == torch.bfloat16
        ulp = exact.abs() * 2.0**-7 + 1e-6  # one bf16 spacing, or more
        for y in (ours, theirs):
            assert (y.double() == exact.to(torch.bfloat16).double()).float().mean() > 0.999
            assert ((y.double() - exact).abs() <= 2 * ulp).all()  # at most one rounding step off
        layer32, x32 = layer.float(), x.float()
        assert torch.equal(_float32_linear(layer32, x32), layer32(x32))


@pytest.mark.parametrize("native", [True, False])
def test_models_take_float32_gemms_only_where_torch_has_no_bf16_gemm(lm32, monkeypatch, native):
    """Both kinds of CPU, one of which this machine is not: ``bf16_gemm_native`` is mocked to each answer. Without a
    bf16 GEMM every linear layer of a built model is switched and its logits are still bf16 and near the native ones;
    with one, nothing changes."""
    import torch

    from nv.models import loading
    from nv.models.reference_family import random_llama, shape_from_entry

    monkeypatch.setattr(loading, "bf16_gemm_native", lambda: native)
    shape = shape_from_entry({"d": 64, "L": 2, "n_kv_heads": 1, "d_ffn": 128}, lm32.arch.vocab_size, 512)
    lm = random_llama(shape, lm32.tokenizer, "bfloat16", 0, "tiny")
    layers = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    switched = [m for m in layers if "forward" in vars(m)]
    assert len(switched) == (0 if native else len(layers)) and len(layers) == 2 * 7 + 1
    ids = torch.randint(0, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = lm.model(ids).logits
        for m in switched:
            del m.forward
        z_native = lm.model(ids).logits
    assert z.dtype == torch.bfloat16
    if not native:  # with a native bf16 GEMM nothing was switched (above): there is nothing to compare
        assert torch.allclose(z.float(), z_native.float(), atol=0.05) and not torch.equal(z, z_native)


def test_a_full_disk_under_the_float32_cache_falls_back_to_the_file(lm32, tmp_path, caplog):
    """The float32 cache's write on a real full disk (a 2 MB tmpfs under a tiny random model's 13 MB of weights):
    safetensors reports it in its own error, not an OSError, which went past the fallback as a traceback; now a
    warning, no entry and no temporary folder, and the load goes on from the file."""
    import subprocess

    from nv.models import loading
    from nv.models.reference_family import random_llama, shape_from_entry

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs (the full disk) needs root")
    try:
        shape = shape_from_entry({"d": 64, "L": 2, "n_kv_heads": 1, "d_ffn": 128}, lm32.arch.vocab_size, 512)
        lm = random_llama(shape, lm32.tokenizer, "float32", 0, "tiny")
        with caplog.at_level("WARNING"):
            assert loading._write_cache(lm.model, lm32.tokenizer, disk / "cache" / "tiny-0123") is False
        assert "could not cache the dequantised model" in caplog.text and "serializ" in caplog.text.lower()
        assert list((disk / "cache").iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_cache_folder_that_is_a_file_falls_back_to_the_file(lm32, tmp_path, caplog):
    """``$NV_CACHE`` naming a file: the float32 cache's write was a NotADirectoryError traceback (its folder was made
    outside the fallback's try); now a warning naming NV_CACHE, and the load goes on from the file."""
    from nv.models import loading
    from nv.models.reference_family import random_llama, shape_from_entry

    cache = tmp_path / "cache"
    cache.write_text("")
    shape = shape_from_entry({"d": 64, "L": 2, "n_kv_heads": 1, "d_ffn": 128}, lm32.arch.vocab_size, 512)
    lm = random_llama(shape, lm32.tokenizer, "float32", 0, "tiny")
    with caplog.at_level("WARNING"):
        assert loading._write_cache(lm.model, lm32.tokenizer, cache / "tiny-0123") is False
    assert f"cannot write the model cache {cache} (" in caplog.text and "set NV_CACHE to a writable folder" in caplog.text
    assert cache.read_text() == ""


def test_a_cache_write_stopped_midway_leaves_no_folder_and_a_sound_entry_survives_a_memory_error(tmp_path, monkeypatch):
    """The float32 cache's writer removes its temporary folder whatever stops it (it was removed on an OSError alone:
    Ctrl-C, SIGTERM or a MemoryError during a minutes-long save left up to 6.7 GB of .tmp-* in the cache); and an
    entry whose stamp holds is kept when reading it runs out of memory (it was deleted and rebuilt, which needs more).
    The save's failures and the MemoryError are raised by stand-ins: a real MemoryError (a subprocess under
    RLIMIT_AS) strikes wherever an allocation first fails (torch's import, the tokenizer), not at the one step this
    test is about, and a real minutes-long save would cost the suite minutes."""
    from nv.models import loading

    class Model:
        class config:
            quantization_config = "q"

        def __init__(self, error):
            self.error = error

        def save_pretrained(self, folder):
            (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
            raise self.error

    for error in (RuntimeError("a failed save"), MemoryError(), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            loading._write_cache(Model(error), None, tmp_path / "cache" / "m-0123")
        assert list((tmp_path / "cache").iterdir()) == [], error
    entry = tmp_path / "cache" / "m-4567"
    entry.mkdir()
    (entry / "model.safetensors").write_bytes(b"\0" * 1000)
    (entry / loading.STAMP).write_text(loading.json.dumps(loading._stamp(entry)))
    monkeypatch.setattr(loading, "_gguf_cache_folder", lambda spec, path, cache_dir: entry)

    for error in (MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")):
        def out_of_memory(source, gguf, dtype, error=error):  # torch says it in a RuntimeError
            raise error

        monkeypatch.setattr(loading, "_from_pretrained", out_of_memory)
        with pytest.raises(type(error)):
            loading._load_gguf("m", str(tmp_path), "m.gguf", "bfloat16", tmp_path / "cache")
        assert (entry / "model.safetensors").is_file()
