"""Step time of the rollout modes at the same batch: sync vs one_step_off, measured and modelled.

    .venv/bin/python tools/bench_async.py [--steps 12] [--warmup 2] [--no-colocated]
                                          [--partial [--slow-rollout-ms MS]]

Runs the CPU quickstart (``configs/quickstart_cpu.yaml``: the actor at TP=2 on two processes,
32 prompts x 8 samples per step) through the real CLI, without validation, as:

- ``colocated``: the default hybrid engine (vLLM TP=2 inside the actor's two processes);
- ``sync``: the rollout on a pool of its own (one process, vLLM TP=1), ``rollout_mode=sync``;
- ``one_step_off``: the same pools, ``rollout_mode=one_step_off``.

``--partial`` runs, instead, ``async`` with ``max_staleness=2`` on the same pools without and
with ``trainer.partial_rollout``; ``--slow-rollout-ms`` stretches every engine step of the
rollout by that much (the test hook ``RLHF_FAULT=rollout_slow:MS``, with ``RLHF_FAULT_HOOKS``
set to this repository's ``tests/fault_hooks.py`` unless already set, as for an ``RLHF_FAULT``
of the caller's: the hooks file the package's ``fault_point`` loads the handlers from),
standing in for a rollout slower than training, where syncs meet generations in flight. Beside
the step time it reports the weight sync's median, the rows' mean lag, and the
interrupted-and-continued rows per step.

For each: the median step time after ``--warmup`` steps and the median of each phase. For
``one_step_off`` the overlap fraction: the share of the rollout's generation time during
which the trainer was running a phase (from the ``timeline/*`` metrics).

The model: on this machine the three processes share two cores, so overlapping generation
with training mostly trades one core's work for another's. On a cluster each pool has its
own devices; from the ``sync`` run's measured phase times (generation G, the trainer's work
T from reward to the actor update, the weight sync S) a sync step takes G + T + S and a
one-step-off step max(G, T) + S (the sync waits for the one generation in flight). The JSON
states both and their ratio. It assumes the phases keep their measured durations when they
no longer share cores, which understates the real gain (both sides speed up too).

Prints one JSON object. Boundaries: a measurement tool; starts the training CLI in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import ensure_tiny_model, run_train, train_command  # noqa: E402

OWN_POOL = [
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
RUNS = {
    "colocated": [],
    "sync": [*OWN_POOL, "trainer.rollout_mode=sync"],
    "one_step_off": [*OWN_POOL, "trainer.rollout_mode=one_step_off"],
}
PARTIAL_RUNS = {
    "async": [*OWN_POOL, "trainer.rollout_mode=async", "trainer.max_staleness=2"],
    "async_partial": [
        *OWN_POOL,
        "trainer.rollout_mode=async",
        "trainer.max_staleness=2",
        "trainer.partial_rollout=true",
    ],
}
TRAINER_PHASES = ("reward", "old_log_prob", "ref", "adv", "update_actor")


def run(name: str, steps: int, out: Path, slow_ms: int = 0) -> list[dict]:
    run_dir = out / name
    command = train_command("quickstart_cpu", run_dir, steps, {**RUNS, **PARTIAL_RUNS}[name])
    env = {**os.environ, "RLHF_FAULT": f"rollout_slow:{slow_ms}"} if slow_ms else {**os.environ}
    return run_train(name, command, run_dir, env)


def _spans(records: list[dict], role: str) -> list[tuple[float, float]]:
    spans = []
    for r in records:
        for key, start in r.items():
            if key.startswith(f"timeline/{role}/") and key.endswith("/start_s"):
                spans.append((start, r[key[: -len("start_s")] + "end_s"]))
    return spans


def overlap_fraction(records: list[dict]) -> float:
    """The share of the rollout's generation time during which a trainer phase was running."""
    trainer = sorted(_spans(records, "trainer"))
    merged: list[list[float]] = []
    for start, end in trainer:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = covered = 0.0
    for start, end in _spans(records, "rollout"):
        total += end - start
        covered += sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)
    return covered / total if total else 0.0


def summary(records: list[dict], warmup: int) -> dict:
    kept = records[warmup:]

    def median(key: str) -> float:
        values = [r[key] for r in kept if key in r]
        return round(statistics.median(values), 3) if values else 0.0

    trainer = [sum(r.get(f"timing_s/{p}", 0.0) for p in TRAINER_PHASES) for r in kept]
    return {
        "median_s_per_step": median("timing_s/step"),
        "median_gen_s": median("timing_s/gen"),
        "median_trainer_s": round(statistics.median(trainer), 3),
        "median_sync_s": median("timing_s/sync_weights"),
        "median_wait_gen_s": median("timing_s/wait_gen"),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
        "staleness_mean": round(statistics.mean(r.get("async/staleness_mean", 0.0) for r in kept), 3),
        "partial_samples_per_step": round(
            statistics.mean(r.get("async/partial_samples", 0.0) for r in kept), 1
        ),
        "overlap_fraction": round(overlap_fraction(kept), 3),
    }


def model(sync: dict) -> dict:
    g, t, s = sync["median_gen_s"], sync["median_trainer_s"], sync["median_sync_s"]
    sync_step, overlapped = g + t + s, max(g, t) + s
    return {
        "assumes": "each pool on its own devices; phases keep the durations measured in the sync run",
        "gen_s": g,
        "trainer_s": t,
        "sync_s": s,
        "sync_step_s": round(sync_step, 3),
        "one_step_off_step_s": round(overlapped, 3),
        "speedup": round(sync_step / overlapped, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated (hybrid engine) run")
    parser.add_argument(
        "--partial", action="store_true", help="async without vs with partial rollout instead"
    )
    parser.add_argument("--slow-rollout-ms", type=int, default=0, help="--partial: stretch each engine step")
    args = parser.parse_args(argv)
    ensure_tiny_model()
    names = [n for n in RUNS if not (args.no_colocated and n == "colocated")]
    if args.partial:
        names = list(PARTIAL_RUNS)
    result: dict = {"steps": args.steps, "warmup": args.warmup}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for name in names:
            start = time.perf_counter()
            result[name] = summary(run(name, args.steps, Path(tmp), args.slow_rollout_ms), args.warmup)
            result[name]["wall_s"] = round(time.perf_counter() - start, 1)
    if args.partial:
        result["slow_rollout_ms"] = args.slow_rollout_ms
        print(json.dumps(result))
        return 0
    result["measured_speedup_one_step_off_vs_sync"] = round(
        result["sync"]["median_s_per_step"] / result["one_step_off"]["median_s_per_step"], 2
    )
    result["model_separate_devices"] = model(result["sync"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
