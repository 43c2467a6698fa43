"""Calibrate the layout search's cost model (``rlhf_megatron/planning/cost_model.py``) on this machine.

    .venv/bin/python tools/calibrate_cost_model.py [--steps 15] [--rounds 2] [--layouts NAME ...]
                                                   [--from-runs] [--runs-dir DIR] [--out configs/cost_model/cpu.json]
    .venv/bin/python tools/calibrate_cost_model.py --gpu   # configs/cost_model/gpu.json from docs/
    .venv/bin/python tools/calibrate_cost_model.py --check configs/cost_model/cpu.json [--rounds 2]

CPU (default), in three parts:

1. a probe of the hardware the processes share: fp32 matmul throughput of one process at the
   quickstart's shapes (one thread, as each training process has), and the latency and bandwidth
   of a gloo all-reduce between two processes;
2. short runs of the CPU quickstart at several layouts (``LAYOUTS``; each ``--steps`` steps,
   the first ``--warmup`` left out), whose ``metrics.jsonl`` give the median seconds of every
   phase (``timing_s/gen``, ``old_log_prob``, ``ref``, ``update_actor``, ``sync_weights``,
   ``step``); ``--from-runs`` reads the runs of an earlier call instead;
3. a fit: the probe prices the hardware features (``flops``, ``collective_bytes``,
   ``sync_bytes``); non-negative least squares over the runs' phases fits the rest (a layer
   pass, a collective in a step, a vLLM iteration and its TP all-reduces, a re-shard, each
   phase's fixed cost; ``step`` is what a step spends outside the phases).

Writes the constants, the probe, each run's measured and predicted phases, and the measured and
predicted orders of the layouts as JSON. ``--check`` fits nothing: it measures the layouts afresh
(out of sample) and compares their order with stored constants' predictions. ``--gpu`` prices the flops from the H200 MFU
measurements (``docs/gpu_h200_mfu.json``); its collective and engine constants are nominal (no
multi-GPU measurement exists yet) and say so in ``source``.

Boundaries: a measurement tool; starts the training CLI in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import run_train, train_command  # noqa: E402

from rlhf_megatron.planning.cost_model import COST_MODEL_DIR, FEATURES, PHASES, _group  # noqa: E402

# The quickstart's layouts measured (each also pins the micro-batches, so the runs differ only
# where named). One vLLM engine per process at rollout TP 1, one engine over both at TP 2.
TP1 = [
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
]
TP2 = [
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]
MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
]
LAYOUTS: dict[str, list[str]] = {
    "tp1_dp2_vllm_tp1": [*TP1, *MICRO],
    "tp2_sp_vllm_tp2": [*TP2, *MICRO],
    "tp2_nosp_vllm_tp2": [*TP2, "actor_rollout_ref.actor.megatron.sequence_parallel=false", *MICRO],
    "tp1_dp2_vllm_tp2": [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        *MICRO,
    ],
    "tp1_dp2_vllm_tp1_ddp": [
        *TP1,
        *MICRO,
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
    ],
    "tp1_dp2_vllm_tp1_micro8": [
        *TP1,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    ],
}
FIXED_BY_PROBE = {"flops", "collective_bytes", "sharded_bytes", "sync_bytes"}
"""Features the probe prices. A collective's latency is fitted: inside a training step it also
waits for the slower rank, which an all-reduce between idle processes does not show. The
distributed optimizer's reduce-scatter + all-gather pair is priced by the probe like the
all-reduce: six runs cannot separate it from the layer passes (a fit of it came out 0)."""


# ------------------------------------------------------------------------------------- probe
def _gloo_child(rank: int, port: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    half, whole = torch.ones(1 << 19), torch.ones(1 << 20)
    ops = {
        "small": (lambda x: dist.all_reduce(x), 256, 300),
        "large": (lambda x: dist.all_reduce(x), 1 << 20, 30),
        # the distributed optimizer's pair on the same tensor: reduce-scatter, then all-gather
        "sharded": (
            lambda x: (dist.reduce_scatter_tensor(half, x), dist.all_gather_into_tensor(whole, half)),
            1 << 20,
            30,
        ),
    }
    for name, (op, numel, iters) in ops.items():
        x = torch.ones(numel)
        for _ in range(5):
            op(x)
        best = math.inf
        for _ in range(3):  # the best of three, as for the matmul
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                op(x)
            best = min(best, (time.perf_counter() - start) / iters)
        out[name] = (best, numel * 4)
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    dist.destroy_process_group()


def probe() -> dict:
    """fp32 matmul FLOP/s of one thread; gloo all-reduce latency (1 KiB) and bandwidth (4 MiB), and
    the bandwidth of a reduce-scatter + all-gather pair (the distributed optimizer's) of 4 MiB."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1536, 256), torch.randn(256, 512)  # 64 sequences x 24 tokens through an MLP
    for _ in range(3):
        a @ b
    reps, times = 50, []
    for _ in range(5):  # the best of five: a shared machine's slow spell is not its speed
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        times.append(time.perf_counter() - start)
    flops = 2 * 1536 * 256 * 512 * reps / min(times)
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "gloo.json")
        port = 29500 + os.getpid() % 1000
        code = "import sys; sys.path.insert(0, %r); from tools.calibrate_cost_model import _gloo_child; _gloo_child(%d, %d, %r)"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen([sys.executable, "-c", code % (str(ROOT), r, port, result)], env=env)
            for r in (0, 1)
        ]
        for p in procs:
            p.wait(timeout=120)
        gloo = json.loads(Path(result).read_text())
    (t_small, _), (t_large, bytes_large), (t_sharded, _) = gloo["small"], gloo["large"], gloo["sharded"]
    return {
        "matmul_flops_per_s": flops,
        "allreduce_latency_s": t_small,
        "allreduce_bytes_per_s": bytes_large / max(t_large - t_small, 1e-9),
        # reduce-scatter + all-gather of the same tensor, as the all-reduce's bytes are counted
        "sharded_bytes_per_s": bytes_large / max(t_sharded - 2 * t_small, 1e-9),
    }


# -------------------------------------------------------------------------------------- runs
def run_layout(name: str, overrides: list[str], steps: int, out: Path) -> Path:
    run_dir = out / name
    run_train(
        name, train_command("quickstart_cpu", run_dir, steps, ["parallelism=manual", *overrides]), run_dir
    )
    (run_dir / "overrides.json").write_text(json.dumps(overrides))
    return run_dir


def measured_phases(run_dir: Path, warmup: int) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = records[warmup:]
    out = {}
    for phase in (*PHASES, "step"):
        values = [r[f"timing_s/{phase}"] for r in records if f"timing_s/{phase}" in r]
        if values:
            out[phase] = statistics.median(values)
    return out


def run_features(run_dir: Path) -> dict[str, dict[str, float]]:
    """The cost model's features of a run, from the config it saved."""
    from omegaconf import OmegaConf

    from rlhf_megatron.planning import load_config
    from rlhf_megatron.planning.cost_model import phase_features

    overrides = json.loads((run_dir / "overrides.json").read_text())
    cfg = load_config("quickstart_cpu", ["parallelism=manual", *overrides])
    assert OmegaConf.select(cfg, "trainer.device") == "cpu"
    return phase_features(cfg)


# --------------------------------------------------------------------------------------- fit
def nnls(rows: list[list[float]], target: list[float]) -> list[float]:
    """Non-negative least squares by trying every subset of columns (a phase has at most 4)."""
    import itertools

    import numpy as np

    a, b = np.array(rows, dtype=float), np.array(target, dtype=float)
    best, best_err = [0.0] * a.shape[1], float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), size):
            coef = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = [0.0] * a.shape[1], err
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


def fit(probe_result: dict, runs: dict[str, tuple[dict, dict]]) -> dict[str, dict[str, float]]:
    """Constants per group: the probe's prices, then NNLS of the rest over every run's phases.
    ``runs``: name -> (measured seconds per phase, features per phase)."""
    fixed = {
        "flops": 1.0 / probe_result["matmul_flops_per_s"],
        "collective_bytes": 1.0 / probe_result["allreduce_bytes_per_s"],
        "sync_bytes": 1.0 / probe_result["allreduce_bytes_per_s"],
        "sharded_bytes": 1.0 / probe_result["sharded_bytes_per_s"],
    }
    seconds: dict[str, dict[str, float]] = {}
    for group, names in FEATURES.items():
        if group == "step":
            continue
        free = [n for n in names if n not in FIXED_BY_PROBE]
        rows, target = [], []
        for measured, feats in runs.values():
            for phase, f in feats.items():
                if _group(phase) != group or phase not in measured:
                    continue
                priced = sum(fixed[n] * f.get(n, 0.0) for n in names if n in FIXED_BY_PROBE)
                rows.append([f.get(n, 0.0) for n in free])
                target.append(measured[phase] - priced)
        coef = nnls(rows, target) if rows else [0.0] * len(free)
        seconds[group] = {n: fixed[n] for n in names if n in FIXED_BY_PROBE} | dict(
            zip(free, map(float, coef))
        )
    # What a step spends outside the phases (reward, advantages, the driver), layout-independent.
    rest = [m["step"] - sum(v for k, v in m.items() if k in PHASES) for m, _ in runs.values() if "step" in m]
    seconds["step"] = {"fixed": max(0.0, statistics.median(rest)) if rest else 0.0}
    return seconds


def predict(seconds: dict, feats: dict) -> dict[str, float]:
    return {
        phase: sum(seconds.get(_group(phase), {}).get(n, 0.0) * v for n, v in f.items())
        for phase, f in feats.items()
    }


def gpu_constants() -> dict:
    """GPU constants: Megatron's achieved FLOP/s from the H200 MFU runs; the rest nominal."""
    mfu = json.loads((ROOT / "docs" / "gpu_h200_mfu.json").read_text())
    peak = mfu["args"]["peak_tflops"] * 1e12
    update = mfu["variants"]["after"]["update"]["mfu"] * peak
    log_prob = mfu["variants"]["after"]["log_prob"]["mfu"] * peak
    flops = 2 / (1 / update + 1 / log_prob)
    return {
        "device": "cuda",
        "source": (
            "docs/gpu_h200_mfu.json (variant 'after': update and log-prob MFU x 989 TFLOP/s -> "
            f"{flops / 1e12:.0f} TFLOP/s); collectives, vLLM iterations and sync are NOMINAL "
            "(NVLink NCCL ~20 us, ~150 GB/s; 15 ms per vLLM iteration; Adam 10 ps a parameter) until a "
            "multi-GPU calibration runs"
        ),
        "seconds": {
            **{
                group: {
                    "flops": 1 / flops,
                    "layer_passes": 2e-4,
                    "collectives": 2e-5,
                    "collective_bytes": 1 / 150e9,
                    # NCCL's ring all-reduce is a reduce-scatter + all-gather: the same bytes
                    **({"sharded_bytes": 1 / 150e9} if group == "update" else {}),
                    # fused Adam reads and writes ~30 bytes a parameter at ~3 TB/s of HBM
                    **({"optimizer_params": 1e-11} if group == "update" else {}),
                    "fixed": 0.05,
                }
                for group in ("forward", "update")
            },
            "gen": {
                "flops": 1 / (0.3 * flops),
                "engine_steps": 0.015,
                "engine_collectives": 2e-5,
                "fixed": 0.5,
            },
            "sync_weights": {"sync_bytes": 1 / 150e9, "reshards": 0.5, "fixed": 0.2},
            "step": {"fixed": 0.5},
        },
    }


def _order(times: dict[str, float]) -> list[str]:
    return sorted(times, key=times.get)


def run_rounds(layouts: list[str], steps: int, rounds: int, runs_dir: Path) -> None:
    """Every layout ``rounds`` times, alternating so the machine's slow spells hit all alike, into
    ``runs_dir/round<k>/<name>``."""
    for round_ in range(rounds):
        for name in layouts:
            start = time.perf_counter()
            run_layout(name, LAYOUTS[name], steps, runs_dir / f"round{round_}")
            print(f"{name} round {round_}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def round_dirs(runs_dir: Path, name: str, rounds: int | None = None) -> list[Path]:
    """``name``'s runs under ``runs_dir/round<k>/``, round 0 first: the first ``rounds`` (the ones
    ``run_rounds`` just wrote, not those an earlier call with more rounds left behind), else all."""

    def round_of(run_dir: Path) -> int:
        return int(run_dir.parent.name.removeprefix("round"))

    dirs = sorted(runs_dir.glob(f"round*/{name}"), key=round_of)
    if rounds is not None:
        dirs = [d for d in dirs if round_of(d) < rounds]
    if not dirs:
        raise SystemExit(f"no run of {name} under {runs_dir}/round*/: run the layouts (without --from-runs)")
    return dirs


def fastest(per_round: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's fastest round: a shared machine's slow spells (a whole run at half speed here)
    only ever add time."""
    return {k: min(m[k] for m in per_round if k in m) for k in per_round[0]}


def check(constants: Path, layouts: list[str], steps: int, warmup: int, rounds: int, runs_dir: Path) -> dict:
    """Out of sample: the stored constants' predicted step of each layout (``predict_step`` on the
    layout's config, as ``plan --auto`` ranks it) against fresh runs, ``rounds`` alternating
    rounds (each layout's measured step: the fastest of its rounds' medians). Reports both
    orders and how many pairs of layouts the prediction orders as measured."""
    from rlhf_megatron.planning.cost_model import CostConstants

    stored = CostConstants.from_json(constants)
    run_rounds(layouts, steps, rounds, runs_dir)
    dirs = {name: round_dirs(runs_dir, name, rounds) for name in layouts}
    per_round = {name: [measured_phases(d, warmup) for d in dirs[name]] for name in layouts}
    measured = {name: [m["step"] for m in v] for name, v in per_round.items()}
    predicted = {name: sum(predict(stored.seconds, run_features(dirs[name][0])).values()) for name in layouts}
    steps_s = {name: fastest(v)["step"] for name, v in per_round.items()}
    pairs = [(a, b) for i, a in enumerate(layouts) for b in layouts[i + 1 :]]
    agree = sum((steps_s[a] < steps_s[b]) == (predicted[a] < predicted[b]) for a, b in pairs)
    return {
        "constants": stored.source,
        "steps": steps,
        "rounds": rounds,
        "layouts": {
            name: {
                "measured_step_s": round(steps_s[name], 4),
                "measured_rounds_s": [round(v, 4) for v in measured[name]],
                "predicted_step_s": round(predicted[name], 4),
            }
            for name in layouts
        },
        "measured_order": _order(steps_s),
        "predicted_order": _order(predicted),
        "order_matches": _order(steps_s) == _order(predicted),
        "pairs_ordered_as_measured": f"{agree}/{len(pairs)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "outputs" / "calibrate_cost_model")
    parser.add_argument("--from-runs", action="store_true", help="fit the runs already in --runs-dir")
    parser.add_argument("--gpu", action="store_true", help="write gpu.json from the H200 measurements")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--check",
        type=Path,
        default=None,
        metavar="CONSTANTS",
        help="no fit: measure the layouts afresh and compare their order with CONSTANTS' predictions",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternating rounds of every layout; a phase's time is the fastest of the rounds' medians",
    )
    args = parser.parse_args(argv)
    if args.check:
        result = check(
            args.check, args.layouts, args.steps, args.warmup, args.rounds, args.runs_dir / "check"
        )
        text = json.dumps(result, indent=1) + "\n"
        if args.out:
            args.out.write_text(text)
        print(text, end="")
        return 0 if result["order_matches"] else 1
    if args.gpu:
        out = args.out or COST_MODEL_DIR / "gpu.json"
        out.write_text(json.dumps(gpu_constants(), indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    probe_path = args.runs_dir / "probe.json"  # --from-runs fits with the probe of the runs' machine
    if args.from_runs and probe_path.is_file():
        probe_result = json.loads(probe_path.read_text())
    else:
        probe_result = probe()
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        probe_path.write_text(json.dumps(probe_result))
    print(f"probe: {probe_result}", file=sys.stderr)
    if not args.from_runs:
        run_rounds(args.layouts, args.steps, args.rounds, args.runs_dir)
    runs, n_rounds = {}, 0
    for name in args.layouts:
        dirs = round_dirs(args.runs_dir, name, None if args.from_runs else args.rounds)
        n_rounds = max(n_rounds, len(dirs))
        runs[name] = (fastest([measured_phases(d, args.warmup) for d in dirs]), run_features(dirs[0]))
    seconds = fit(probe_result, runs)
    report = {}
    for name, (measured, feats) in runs.items():
        predicted = predict(seconds, feats)
        report[name] = {
            "overrides": LAYOUTS[name],
            "measured_s": {k: round(v, 4) for k, v in measured.items()},
            "predicted_s": {k: round(v, 4) for k, v in predicted.items()},
            "measured_step_s": round(measured["step"], 4),
            "predicted_step_s": round(sum(predicted.values()), 4),
        }
    measured_order = _order({n: r["measured_step_s"] for n, r in report.items()})
    predicted_order = _order({n: r["predicted_step_s"] for n, r in report.items()})
    result = {
        "device": "cpu",
        "source": (
            f"tools/calibrate_cost_model.py on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: "
            f"probe + {len(runs)} quickstart layouts x {args.steps} steps x {n_rounds} rounds"
        ),
        "seconds": seconds,
        "probe": probe_result,
        "runs": report,
        "measured_order": measured_order,
        "predicted_order": predicted_order,
        "order_matches": measured_order == predicted_order,
    }
    out = args.out or COST_MODEL_DIR / "cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("measured_order", "predicted_order", "order_matches")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
