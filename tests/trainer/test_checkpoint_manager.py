"""CheckpointManager: atomic commits, markers, pruning and resume resolution (no processes)."""

import hashlib
import json

import pytest

from rlhf_megatron.trainer import checkpoint
from rlhf_megatron.trainer.checkpoint import MARKER, CheckpointError, CheckpointManager


def _save(mgr, step, payload="x"):
    tmp = mgr.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights.bin").write_text(payload)
    return mgr.commit(step, tmp, {"global_step": step})


def test_commit_renames_into_place_and_moves_the_marker(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = _save(mgr, 3)
    assert path == tmp_path / "global_step_3" and (path / "actor" / "weights.bin").is_file()
    assert (tmp_path / MARKER).read_text().strip() == "3"
    assert mgr.latest() == path and json.loads((path / "trainer_state.json").read_text())["global_step"] == 3
    assert not list(tmp_path.glob(".global_step_*"))


def test_an_interrupted_save_is_never_taken_for_a_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 1)
    tmp = mgr.begin(2)  # the process dies here: workers wrote half a checkpoint
    (tmp / "actor").mkdir()
    assert mgr.latest() == good
    assert mgr.complete_steps() == [1]
    assert mgr.resolve("auto", None) == good
    _save(mgr, 2)  # the next save clears the leftover
    assert mgr.complete_steps() == [1, 2]


def test_prune_keeps_the_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    assert mgr.complete_steps() == [3, 4]


def test_resolve_modes_and_errors(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.resolve("auto", None) is None
    path = _save(mgr, 5)
    assert mgr.resolve("disable", None) is None
    assert mgr.resolve("auto", str(path)) == path
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        mgr.resolve("auto", str(tmp_path / "nope"))
    (tmp_path / MARKER).write_text("7\n")
    with pytest.raises(CheckpointError, match="points at step 7.*incomplete"):
        mgr.latest()
    (tmp_path / MARKER).write_text("garbage")
    with pytest.raises(CheckpointError, match="should hold a step number"):
        mgr.latest()


def test_read_only_root_is_refused(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        import os

        if os.access(root, os.W_OK):  # root ignores permissions
            pytest.skip("running as root: directory permissions are not enforced")
        with pytest.raises(CheckpointError, match="not writable"):
            CheckpointManager(root).begin(1)
    finally:
        root.chmod(0o700)


def test_the_manifest_takes_the_workers_digests_and_verify_still_reads_every_file(tmp_path, monkeypatch):
    """A model checkpoint's metadata lists the sha256 its worker took while saving: the manifest
    reuses them (a save reads the model once), except where a file's size no longer matches."""
    from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE

    assert checkpoint.MODEL_METADATA_FILE == CKPT_METADATA_FILE
    mgr = CheckpointManager(tmp_path)
    tmp = mgr.begin(1)
    model = tmp / "actor" / "model"
    model.mkdir(parents=True)
    (model / "shard.distcp").write_bytes(b"weights" * 100)
    (model / "changed.bin").write_bytes(b"v2, longer than v1")
    digests = {
        n: hashlib.sha256((model / n).read_bytes()).hexdigest() for n in ("shard.distcp", "changed.bin")
    }
    meta = {"files": digests, "sizes": {"shard.distcp": 700, "changed.bin": 2}}  # changed.bin: stale size
    (model / CKPT_METADATA_FILE).write_text(json.dumps(meta))
    read = []
    real = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: (read.append(p.name), real(p))[1])
    path = mgr.commit(1, tmp, {"global_step": 1})
    assert "shard.distcp" not in read and {"changed.bin", CKPT_METADATA_FILE, "trainer_state.json"} <= set(
        read
    )
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["actor/model/shard.distcp"]["sha256"] == digests["shard.distcp"]
    CheckpointManager.verify(path, "sha256")
    read.clear()
    (path / "actor" / "model" / "shard.distcp").write_bytes(b"garbage" * 100)  # same size, other bytes
    with pytest.raises(CheckpointError, match="shard.distcp fails its sha256 check"):
        CheckpointManager.verify(path, "sha256")
    assert "shard.distcp" in read
