"""``models/mtp.py``: a GLM-4.5 checkpoint's next-token-prediction layer is announced as untrained
on stderr, kept as stored beside a model checkpoint, and found there for the export; a run writes
it once into its store and hard-links it into every checkpoint (copies where links fail). (The
conversion round trip that writes it back is in ``test_moe_convert.py``; a trainer-style save and
export through a store in ``test_mtp_export.py``.)"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

from rlhf_megatron.models import mtp as mtp_mod
from rlhf_megatron.models.hf_io import HFCheckpoint
from rlhf_megatron.models.mtp import (
    MTP_DIR,
    MTP_STORE,
    mtp_tensor_names,
    save_mtp_tensors,
    saved_mtp,
    warn_untrained_mtp,
)
from rlhf_megatron.planning.model_arch import ModelArch

from . import tiny_moe


@pytest.fixture(scope="module")
def glm_with_mtp(tmp_path_factory):
    hf = tiny_moe.make_model_dir(tmp_path_factory.mktemp("mtp"), "glm4_moe", hidden_size=128, num_heads=2)
    return hf, tiny_moe.add_mtp_layer(hf)


def test_mtp_tensors_are_announced_as_untrained(glm_with_mtp, capsys):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    assert arch.num_layers == 2 and arch.mtp_layers == 1
    names = warn_untrained_mtp(HFCheckpoint(hf), arch)
    assert names == sorted(mtp) == mtp_tensor_names(HFCheckpoint(hf), arch)
    err = capsys.readouterr().err
    assert f"{len(mtp)} tensor(s) of layer(s) [2]" in err and "NOT trained" in err and MTP_DIR in err


def test_mtp_tensors_are_kept_as_stored(glm_with_mtp, tmp_path):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    assert save_mtp_tensors(hf, arch, tmp_path) == tmp_path / MTP_DIR
    kept = saved_mtp(tmp_path)
    assert sorted(kept.names()) == sorted(mtp)
    for name, t in mtp.items():
        assert kept.dtype(name) == t.dtype and torch.equal(kept.read(name), t), name  # bf16 stays bf16


def test_a_checkpoint_without_mtp_tensors_keeps_nothing(glm_with_mtp, tmp_path, capsys):
    hf, _ = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    deeper = ModelArch.from_dict({**arch.to_dict(), "num_layers": 3})  # layer 2 is a decoder layer now
    assert warn_untrained_mtp(HFCheckpoint(hf), deeper) == [] and capsys.readouterr().err == ""
    assert save_mtp_tensors(hf, deeper, tmp_path) is None and saved_mtp(tmp_path) is None
    (tmp_path / "config-only").mkdir()
    assert save_mtp_tensors(tmp_path / "config-only", arch, tmp_path) is None


def _inodes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in sorted(directory.iterdir())}


def test_a_store_is_written_once_and_hard_linked_into_every_checkpoint(glm_with_mtp, tmp_path, monkeypatch):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    writes = []
    real_write = mtp_mod._write
    monkeypatch.setattr(mtp_mod, "_write", lambda *a: writes.append(a[2]) or real_write(*a))
    store = tmp_path / MTP_STORE / "actor.actor"
    first, second = tmp_path / "global_step_1", tmp_path / "global_step_2"
    assert save_mtp_tensors(hf, arch, first, store=store) == first / MTP_DIR
    assert save_mtp_tensors(hf, arch, second, store=store) == second / MTP_DIR
    assert writes == [store]  # read from the HF checkpoint and written once, into the store
    # Every checkpoint's files are the store's files (same inodes): no bytes written per save.
    assert _inodes(first / MTP_DIR) == _inodes(store) == _inodes(second / MTP_DIR)
    assert all(p.stat().st_nlink == 3 for p in store.iterdir())
    shutil.rmtree(first)  # pruning an older checkpoint leaves the newer one whole
    kept = saved_mtp(second)
    assert sorted(kept.names()) == sorted(mtp)
    for name, t in mtp.items():
        assert torch.equal(kept.read(name), t), name


def test_a_stale_store_is_rewritten_and_links_fall_back_to_copies(glm_with_mtp, tmp_path, monkeypatch):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    store = tmp_path / MTP_STORE / "actor.actor"
    store.mkdir(parents=True)
    (store / "model-00001-of-00001.safetensors").write_bytes(b"torn")  # a save killed mid-write

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    monkeypatch.setattr(mtp_mod.os, "link", refuse)
    out = save_mtp_tensors(hf, arch, tmp_path / "ckpt", store=store)
    assert sorted(HFCheckpoint(store).names()) == sorted(mtp)  # rewritten from the HF checkpoint
    assert set(_inodes(out)) == set(_inodes(store))
    assert not set(_inodes(out).values()) & set(_inodes(store).values())  # copies, not links
    for name, t in mtp.items():
        assert torch.equal(saved_mtp(tmp_path / "ckpt").read(name), t), name
