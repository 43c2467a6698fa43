"""Soak test: run the quickstart for many steps and check that memory and weight-sync time stay flat.

Starts `python -m rlhf_megatron.train` (default: configs/quickstart_cpu.yaml), follows its
metrics.jsonl, and after every step samples the resident memory of the driver and of every process
under it (Ray's raylet and workers, where the Megatron models and vLLM live). After a warm-up it
fits a line through RSS and through `timing_s/sync_weights` per step and prints one JSON object.
The warm-up matters: the workers' RSS climbs fastest over the first steps on the CPU quickstart
(native caches filling as sequence lengths vary; see the Soak section of docs/reliability.md) and levels off.
The last step is left out too: it includes the final checkpoint save.

    {"steps": ..., "rss_mb_per_step": ..., "rss_mb_per_step_by_half": [a, b],
     "total_rss_mb": [first, last], "driver_rss_mb": [first, last],
     "grew_most": [{"cmd": ..., "mb": ...}], "started_in_window": [...], "ended_in_window": [...],
     "sync_s_per_step": ..., "ok": true|false, ...}

The RSS slope is fitted over the processes alive through the whole window: a process that starts
inside it (a Ray worker started lazily, a compile worker) is a one-time step, not a leak, and is
listed in `started_in_window` with its size instead. `grew_most` names the three processes whose
RSS grew most over the window, so a failing soak says where to look.

Memory figures are MiB. Exit status 1 when the RSS slope exceeds --max-rss-mb-per-step or the
sync-time slope exceeds --max-sync-slope (seconds per step), 2 when the run itself fails.

    .venv/bin/python tools/soak.py --steps 60 --warmup 20 [--config ...] [-- extra overrides]

With the fault-injection test hook in the environment (``RLHF_FAULT``, e.g. ``leak:32`` or
``sync_drift:20``, which tests/reliability/test_soak.py plants), the run also gets
``RLHF_FAULT_HOOKS`` set to this repository's ``tests/fault_hooks.py`` (unless already set): the
hooks file the package's ``fault_point`` loads the handlers from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import hooks_env, train_command  # noqa: E402


def _tree_rss_mb(pid: int) -> dict[int, tuple[str, float]]:
    """RSS in MiB of the driver and of every process under it: {pid: (command, MiB)}."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for proc in procs:
        try:
            out[proc.pid] = (
                " ".join(proc.cmdline())[:80].strip() or proc.name(),
                proc.memory_info().rss / 2**20,
            )
        except psutil.Error:
            continue
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart_cpu.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="first steps left out of the fits")
    parser.add_argument("--max-rss-mb-per-step", type=float, default=5.0)
    parser.add_argument("--max-sync-slope", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument(
        "--run-dir", type=Path, help="keep the run here (default: a temporary directory, removed)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 4:
        parser.error(
            f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 4 (the last step is not fitted)"
        )

    keep = args.run_dir is not None
    run_dir = args.run_dir.absolute() if keep else Path(tempfile.mkdtemp(prefix="soak_"))
    try:
        return _soak(args, run_dir)
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _soak(args: argparse.Namespace, run_dir: Path) -> int:
    cmd = train_command(args.config, run_dir, args.steps, args.overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "soak_stderr.log"  # a file, not a pipe: a long run's logs would fill a pipe and block it
    env = hooks_env({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    samples: dict[int, tuple[dict[int, tuple[str, float]], float]] = {}  # step: (processes, sync s)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if not metrics.exists():
            continue
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line still being written: read it next time
                break
            step = record.get("step", 0)
            if step and step not in samples:
                samples[step] = (_tree_rss_mb(proc.pid), float(record.get("timing_s/sync_weights", 0.0)))
    timed_out = proc.poll() is None
    if timed_out:
        proc.kill()
    stderr = log.read_text(errors="replace")
    if proc.wait() != 0 or len(samples) < args.steps:
        why = f"timed out after {args.timeout:.0f} s" if timed_out else f"exit {proc.returncode}"
        print(
            json.dumps(
                {
                    "ok": False,
                    "error": f"run failed ({why}) after {len(samples)} of {args.steps} steps",
                    "stderr_tail": stderr[-2000:],
                }
            )
        )
        return 2
    steps = sorted(s for s in samples if args.warmup < s < args.steps)
    first, last = samples[steps[0]][0], samples[steps[-1]][0]
    total = [sum(rss for _, rss in samples[s][0].values()) for s in steps]
    # The fit is over the processes alive through the whole window, so a process that starts in it
    # (a Ray worker started lazily, a compile worker) is a step, not a slope; it is listed instead.
    kept = set.intersection(*(set(samples[s][0]) for s in steps))
    steady = [sum(samples[s][0][pid][1] for pid in kept) for s in steps]
    sync = [samples[s][1] for s in steps]
    rss_slope, sync_slope = _slope(steps, steady), _slope(steps, sync)
    half = len(steps) // 2
    grew = sorted(kept, key=lambda pid: first[pid][1] - last[pid][1])[:3]
    ok = rss_slope <= args.max_rss_mb_per_step and sync_slope <= args.max_sync_slope
    print(
        json.dumps(
            {
                "steps": args.steps,
                "warmup": args.warmup,
                "rss_mb_per_step": round(rss_slope, 3),
                "rss_mb_per_step_by_half": [
                    round(_slope(steps[:half], steady[:half]), 3),
                    round(_slope(steps[half:], steady[half:]), 3),
                ],
                "total_rss_mb": [round(total[0], 1), round(total[-1], 1)],
                "driver_rss_mb": [
                    round(first.get(proc.pid, ("", 0.0))[1], 1),
                    round(last.get(proc.pid, ("", 0.0))[1], 1),
                ],
                "grew_most": [
                    {"cmd": last[pid][0], "mb": round(last[pid][1] - first[pid][1], 1)} for pid in grew
                ],
                "started_in_window": [
                    {"cmd": cmd, "mb": round(rss, 1)} for pid, (cmd, rss) in last.items() if pid not in first
                ],
                "ended_in_window": [
                    {"cmd": cmd, "mb": round(rss, 1)} for pid, (cmd, rss) in first.items() if pid not in last
                ],
                "sync_s_per_step": round(sync_slope, 5),
                "sync_s": [round(sync[0], 4), round(sync[-1], 4)],
                "bounds": {
                    "rss_mb_per_step": args.max_rss_mb_per_step,
                    "sync_s_per_step": args.max_sync_slope,
                },
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
