"""What a restarted (requeued) job resumes from: rlhf_megatron/launch/restart.py.

Checkpoints are written with the trainer's own CheckpointManager, so the launcher's idea of
the layout (global_step_<k>/trainer_state.json) is checked against the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlhf_megatron.launch import restart
from rlhf_megatron.launch.restart import newest_checkpoint_since, restart_overrides
from rlhf_megatron.trainer import checkpoint


def _save(root: Path, step: int, mtime: float | None = None) -> Path:
    """A complete checkpoint of `step`, its state file dated `mtime` (default: now)."""
    manager = checkpoint.CheckpointManager(root)
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights.bin").write_bytes(b"w")
    path = manager.commit(step, tmp, {"global_step": step})
    if mtime is not None:
        os.utime(path / checkpoint.STATE_FILE, (mtime, mtime))
    return path


def test_layout_matches_the_trainer():
    assert restart.STATE_FILE == checkpoint.STATE_FILE
    assert checkpoint.CheckpointManager("/r").step_dir(7).name == f"{restart.CHECKPOINT_PREFIX}7"


def test_first_run_marks_the_start_and_keeps_the_config(tmp_path):
    marker = tmp_path / "run" / ".slurm-job-1.started"
    _save(tmp_path / "run", 5)  # an earlier job's checkpoint: the config's resume_mode decides
    overrides, why = restart_overrides(tmp_path / "run", marker, restart_count=0)
    assert overrides == [] and "first run" in why
    assert marker.is_file()


def test_restart_resumes_from_the_newest_checkpoint_the_job_wrote(tmp_path):
    run = tmp_path / "run"
    marker = run / ".started"
    old = time.time() - 3600
    _save(run, 40, mtime=old)  # an older run's checkpoint, with a higher step
    restart_overrides(run, marker, restart_count=0)
    _save(run, 2)
    newest = _save(run, 4)
    (run / "global_step_6").mkdir()  # a save cut short: no trainer_state.json
    overrides, why = restart_overrides(run, marker, restart_count=1)
    assert overrides == ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={newest}"]
    assert why == f"restart 1: resuming from {newest} (the newest checkpoint this job wrote)"


def test_restart_before_any_save_runs_as_the_first_run_did(tmp_path):
    run = tmp_path / "run"
    _save(run, 40, mtime=time.time() - 3600)
    restart_overrides(run, run / ".started", restart_count=0)
    overrides, why = restart_overrides(run, run / ".started", restart_count=2)
    assert overrides == [] and "no checkpoint written since the job started" in why


def test_restart_without_the_marker_keeps_the_config(tmp_path):
    _save(tmp_path, 3)
    overrides, why = restart_overrides(tmp_path, tmp_path / "missing", restart_count=1)
    assert overrides == [] and "is missing" in why


def test_newest_checkpoint_since_ignores_other_names(tmp_path):
    (tmp_path / "global_step_x").mkdir()
    (tmp_path / "global_step_x" / checkpoint.STATE_FILE).write_text("{}")
    assert newest_checkpoint_since(tmp_path, 0.0) is None
    assert newest_checkpoint_since(tmp_path / "absent", 0.0) is None


def test_main_appends_the_overrides_and_execs_the_driver(tmp_path):
    run = tmp_path / "run"
    marker = run / ".started"
    restart_overrides(run, marker, restart_count=0)
    newest = _save(run, 1)
    driver = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "trainer.total_training_steps=2"]
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.launch.restart", "--run-dir", str(run), "--marker", str(marker)]
        + ["--restart-count", "1", "--", *driver],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert (
        out[0] == f"[rlhf-megatron] restart 1: resuming from {newest} (the newest checkpoint this job wrote)"
    )
    assert out[1] == str(
        [
            "trainer.total_training_steps=2",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={newest}",
        ]
    )
