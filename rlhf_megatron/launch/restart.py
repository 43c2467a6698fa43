"""Resume a restarted job from the checkpoints it wrote itself, then run the driver.

Role: a scheduler can run the same job more than once: Slurm requeues a batch job after
a node failure (``#SBATCH --requeue``) or on ``scontrol requeue``, and starts the whole
script again under the same job id with ``SLURM_RESTART_COUNT`` one higher. The batch
script runs the driver through this module::

    python3 -m rlhf_megatron.launch.restart --run-dir DIR --marker FILE --restart-count N \\
        -- rlhf-megatron train --config ... overrides...

which appends resume overrides to the driver's command line and ``exec``s it.

The rule:

- First run (``N = 0``): touch ``--marker`` (its mtime is when the job started) and run the
  command unchanged, so the run's own ``trainer.resume_mode`` applies: ``auto`` (the
  default) resumes from the newest complete checkpoint in the run directory; an explicit
  ``resume_path`` or ``disable`` is honoured.
- Restart (``N >= 1``): if a complete checkpoint (``global_step_<k>/trainer_state.json``)
  was written after the marker, that is, by this job, resume from the newest such one:
  ``trainer.resume_mode=resume_path trainer.resume_from_path=<run dir>/global_step_<k>``.
  Otherwise run the command unchanged, as the first run did.

Why not ``resume_mode=auto`` on every restart: a run started from an explicit checkpoint
(``resume_path``) or started fresh (``disable``) in a directory holding an older run's
checkpoints would, on a restart, go back to that checkpoint or pick up the older run. Only
checkpoints newer than the job's start are its own progress.

Boundaries: reads the run directory and the marker; imports nothing from the trainer (the
checkpoint layout below is ``trainer/checkpoint.py``'s, and a test checks they agree).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["CHECKPOINT_PREFIX", "STATE_FILE", "main", "newest_checkpoint_since", "restart_overrides"]

CHECKPOINT_PREFIX = "global_step_"
STATE_FILE = "trainer_state.json"
"""Written into a checkpoint before it is renamed into place: its presence means complete."""


def newest_checkpoint_since(run_dir: Path, since_s: float) -> Path | None:
    """The complete ``global_step_<k>`` with the highest k whose state file is not older than
    ``since_s`` (a file mtime, in seconds); None when there is none."""
    found: list[tuple[int, Path]] = []
    for path in run_dir.glob(f"{CHECKPOINT_PREFIX}*"):
        step = path.name.removeprefix(CHECKPOINT_PREFIX)
        state = path / STATE_FILE
        if step.isdigit() and state.is_file() and state.stat().st_mtime >= since_s:
            found.append((int(step), path))
    return max(found)[1] if found else None


def restart_overrides(run_dir: Path, marker: Path, restart_count: int) -> tuple[list[str], str]:
    """(overrides to append to the driver's command, a log line saying why).

    On the first run this touches ``marker``; see the module docstring for the rule.
    """
    if restart_count == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return [], "first run: resuming as the run config says (trainer.resume_mode)"
    if not marker.is_file():
        return [], (
            f"restart {restart_count}: {marker} (written by the first run) is missing, so this job's "
            "own checkpoints can't be told apart; resuming as the run config says"
        )
    newest = newest_checkpoint_since(run_dir, marker.stat().st_mtime)
    if newest is None:
        return [], (
            f"restart {restart_count}: no checkpoint written since the job started; "
            "resuming as the first run did (trainer.resume_mode)"
        )
    overrides = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={newest}"]
    return (
        overrides,
        f"restart {restart_count}: resuming from {newest} (the newest checkpoint this job wrote)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_megatron.launch.restart",
        description="Run the driver, resuming from this job's own newest checkpoint on a restart.",
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="trainer.default_local_dir")
    parser.add_argument("--marker", type=Path, required=True, help="file whose mtime is the job's start")
    parser.add_argument(
        "--restart-count", type=int, default=0, help="0 on the first run (SLURM_RESTART_COUNT)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the driver command")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no driver command; pass it after `--`")
    overrides, why = restart_overrides(args.run_dir, args.marker, args.restart_count)
    print(f"[rlhf-megatron] {why}", flush=True)
    os.execvp(command[0], [*command, *overrides])
    return 0  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
