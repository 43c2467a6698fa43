"""CheckpointManager: atomic commits, markers, pruning and resume resolution (no processes)."""

import json

import pytest

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
