"""Chaos statistics: the CPU quickstart, N times, each run losing a random worker at a random moment.

    .venv/bin/python tools/chaos.py --trials 100 [--steps 4] [--seed 0] [--out chaos.json]

Each trial draws (with ``--seed``) a layout, a moment and a victim, and runs the quickstart
through the real CLI with in-job recovery on (``trainer.max_restarts=2``, no backoff, a
checkpoint and a validation every 2 steps):

- colocated (``configs/quickstart_cpu.yaml``): an actor rank (0 or 1) is SIGKILLed during a
  training generation, an update, a weight sync, a checkpoint save or a validation, or hangs
  in an update;
- one step off (``configs/quickstart_cpu_one_step_off.yaml``): the rollout pool's process is
  SIGKILLed during a generation or while it receives weights, or hangs in a generation; or an
  actor rank is SIGKILLed during an update, a save or its end of a weight sync, or hangs in an
  update.

A hung process sleeps for an hour: ``trainer.step_timeout_s`` (``HANG_TIMEOUT_S`` here) must
catch it and name it, and the restart must take it down.

The step is drawn among those where the moment occurs; the kill fires once per run
(``RLHF_FAULT_ONCE_DIR``: the restarted workers count their steps from 1 again). After the run the
tool checks what a user would: whether it finished (exit 0, every step logged once); the steps
lost and the restarts of the run (``recovery.jsonl``) and of the rollout pool alone
(``recovery/engine_restarts``); complete checkpoints that fail their sha256 manifest
(corrupt) and ``.global_step_*.tmp`` directories left (partial); Ray and worker processes still
alive from the trial's own Ray session (leftover processes; another Ray user on the machine
does not count); and ``/dev/shm`` entries the trial created
that no live process maps (leftover segments). Prints one JSON object: the totals (goal: every run
finished, 0 corrupt or partial checkpoints, 0 leftover processes and segments), steps lost per
trial (max and mean) and one row per trial.

Boundaries: a measurement tool; starts the training CLI in subprocesses with the repository's
fault hooks (``tests/fault_hooks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import hooks_env, read_metrics, train_command  # noqa: E402

from rlhf_megatron.platform.shm import left_behind, shm_names  # noqa: E402

STEPS_DEFAULT = 4
EVERY = 2  # save_freq and test_freq
HANG_TIMEOUT_S = 30  # trainer.step_timeout_s: a quickstart call takes ~1 s, start-up is not timed

# layout -> (config, [(phase, ranks, which steps it can strike at)])
LAYOUTS = {
    "colocated": (
        "quickstart_cpu",
        [
            ("gen", (0, 1), "steps"),
            ("update", (0, 1), "steps"),
            ("sync", (0, 1), "steps"),
            ("ckpt", (0, 1), "saves"),
            ("val", (0, 1), "validations"),
            ("hang", (0, 1), "steps"),
        ],
    ),
    "one_step_off": (
        "quickstart_cpu_one_step_off",
        [
            ("rollout_gen", (0,), "steps"),
            ("rollout_sync", (0,), "steps"),
            ("rollout_hang", (0,), "steps"),
            ("update", (0, 1), "steps"),
            ("ckpt", (0, 1), "saves"),
            ("sync", (0, 1), "steps"),
            ("hang", (0, 1), "steps"),
        ],
    ),
}


def draw(rng: random.Random, steps: int) -> dict:
    """One trial's layout, phase, step and rank."""
    layout = rng.choice(sorted(LAYOUTS))
    phase, ranks, when = rng.choice(LAYOUTS[layout][1])
    moments = {
        "steps": list(range(1, steps + 1)),
        "saves": list(range(EVERY, steps + 1, EVERY)),
        "validations": [0, *range(EVERY, steps + 1, EVERY)],
    }[when]
    return {"layout": layout, "phase": phase, "step": rng.choice(moments), "rank": rng.choice(ranks)}


def _session_pids(driver_pid: int) -> set[int]:
    """Live processes of the Ray session the trial's driver started (``/tmp/ray/session_*_<pid>``):
    those naming it on their command line (raylet, GCS, agents) or writing their output into it
    (Ray's workers). Another Ray user on the machine does not count."""
    sessions = [p.name for p in Path("/tmp/ray").glob(f"session_*_{driver_pid}")]
    if not sessions:
        return set()
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            seen = proc.joinpath("cmdline").read_bytes().decode(errors="replace")
            seen += " ".join(
                os.readlink(proc / "fd" / fd) for fd in ("1", "2") if (proc / "fd" / fd).exists()
            )
        except OSError:
            continue
        if any(name in seen for name in sessions):
            pids.add(int(proc.name))
    return pids


def check_checkpoints(run_dir: Path) -> tuple[int, int]:
    """(corrupt, partial): complete checkpoints failing their manifest, temporary dirs left."""
    from rlhf_megatron.trainer.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(run_dir)
    corrupt = 0
    for step in manager.complete_steps():
        try:
            CheckpointManager.verify(manager.step_dir(step), "sha256")
        except CheckpointError:
            corrupt += 1
    return corrupt, len(list(run_dir.glob(".global_step_*.tmp")))


def trial(n: int, fault: dict, steps: int, out: Path) -> dict:
    config = LAYOUTS[fault["layout"]][0]
    run_dir, once = out / f"trial_{n}", out / f"once_{n}"
    once.mkdir(parents=True)
    entry = f"{fault['phase']}:{fault['step']}:{fault['rank']}"
    command = train_command(
        config,
        run_dir,
        steps,
        [
            f"trainer.save_freq={EVERY}",
            "trainer.max_restarts=2",
            "trainer.restart_backoff_s=0",
            f"trainer.step_timeout_s={HANG_TIMEOUT_S}",
        ],
        test_freq=EVERY,
        val_before_train=True,
    )
    env = hooks_env(
        {**os.environ, "RLHF_FAULT": entry, "RLHF_FAULT_ONCE_DIR": str(once), "WANDB_MODE": "offline"}
    )
    shm_before = shm_names()
    start = time.monotonic()
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        _, stderr = proc.communicate(timeout=1800)
    seconds = time.monotonic() - start
    time.sleep(2)  # Ray's processes exit just after the driver
    records = read_metrics(run_dir)
    trained = [r["step"] for r in records if "actor/pg_loss" in r]
    events = []
    if (run_dir / "recovery.jsonl").is_file():
        events = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    corrupt, partial = check_checkpoints(run_dir)
    leftover_shm = sorted(left_behind(shm_before))
    return {
        "trial": n,
        **fault,
        "fault": entry,
        "fired": any(once.iterdir()),
        "finished": proc.returncode == 0 and trained == list(range(1, steps + 1)),
        "returncode": proc.returncode,
        "restarts": len(events),
        "engine_restarts": int(max((r.get("recovery/engine_restarts", 0) for r in records), default=0)),
        "causes": [e["cause"] for e in events],
        "steps_lost": sum(e["steps_lost"] for e in events),
        "corrupt_checkpoints": corrupt,
        "partial_checkpoints": partial,
        "leftover_processes": len(_session_pids(proc.pid)),
        "leftover_shm": leftover_shm,
        "seconds": round(seconds, 1),
        "error": "" if proc.returncode == 0 else stderr.strip().splitlines()[-1][:300],
    }


def summarize(rows: list[dict]) -> dict:
    lost = [r["steps_lost"] for r in rows]
    return {
        "trials": len(rows),
        "faults_fired": sum(r["fired"] for r in rows),
        "finished": sum(r["finished"] for r in rows),
        "restarts": sum(r["restarts"] for r in rows),
        "engine_restarts": sum(r.get("engine_restarts", 0) for r in rows),
        "steps_lost_max": max(lost, default=0),
        "steps_lost_mean": round(sum(lost) / max(len(lost), 1), 3),
        "corrupt_checkpoints": sum(r["corrupt_checkpoints"] for r in rows),
        "partial_checkpoints": sum(r["partial_checkpoints"] for r in rows),
        "leftover_processes": sum(r["leftover_processes"] for r in rows),
        "leftover_shm_segments": sum(len(r["leftover_shm"]) for r in rows),
        "seconds_mean": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="chaos_") as tmp:
        for n in range(args.trials):
            rows.append(trial(n, draw(rng, args.steps), args.steps, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report = {"steps": args.steps, "seed": args.seed, **summarize(rows), "rows": rows}
    text = json.dumps(report, indent=1)
    if args.out is not None:
        tmp_out = args.out.with_suffix(".tmp")
        tmp_out.write_text(text)
        tmp_out.replace(args.out)
    print(text)
    return report


if __name__ == "__main__":
    main()
