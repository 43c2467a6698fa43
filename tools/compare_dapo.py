"""DAPO vs plain GRPO on the CPU quickstart task, per generated sample.

    .venv/bin/python tools/compare_dapo.py [--steps 60] [--test-freq 5] [--seeds 1 2]
                                           [--plot docs/dapo_vs_grpo_curve.png]

Runs ``configs/quickstart_cpu.yaml`` (GRPO) and ``configs/quickstart_cpu_dapo.yaml`` (DAPO: dynamic
sampling, clip-higher, token-mean, no KL, overlong buffer) through the real training CLI, one after
the other, for the same number of steps, validating every ``--test-freq`` steps. A DAPO step
generates more responses than it trains on (the dropped groups and the last round's surplus), so
the x-axis is the responses generated so far: GRPO's ``train_batch_size x n`` per step, DAPO's
``dynamic_sampling/generated_samples``. Prints one JSON object: each run's validation curve
(step, generated responses, ``val/reward_mean``), wall time and mean rounds per step, and the
comparison over the sample range both runs cover: each run's mean validation reward over that
range (trapezoid area / width) and its value at the range's end (linear interpolation). With
several ``--seeds`` (``trainer.seed`` and ``data.seed``: initial sampling and data order), each pair
runs once per seed and the comparison gives every seed's numbers and their mean.

Boundaries: a measurement tool; the runs start the training CLI in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import run_train, train_command  # noqa: E402

RUNS = {"grpo": "quickstart_cpu", "dapo": "quickstart_cpu_dapo"}


def _run(name: str, config: str, steps: int, test_freq: int, seed: int, out: Path) -> dict:
    run_dir = out / f"{name}_{seed}"
    seeds = [f"trainer.seed={seed}", f"data.seed={seed}"]
    command = train_command(config, run_dir, steps, seeds, test_freq=test_freq, val_before_train=True)
    start = time.perf_counter()
    records = run_train(name, command, run_dir)
    resolved = (run_dir / "resolved_config.yaml").read_text()
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(resolved)
    per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    generated, curve, rounds = 0, [], []
    for r in records:
        if r["step"] > 0:
            generated += int(r.get("dynamic_sampling/generated_samples", per_step))
            rounds.append(r.get("train/num_gen_batches", 1.0))
        if "val/reward_mean" in r:
            curve.append({"step": r["step"], "generated": generated, "val": r["val/reward_mean"]})
    return {
        "config": f"configs/{config}.yaml",
        "wall_s": round(time.perf_counter() - start, 1),
        "mean_rounds_per_step": round(float(np.mean(rounds)), 2),
        "generated": generated,
        "curve": curve,
    }


def _over(curve: list[dict], end: int) -> tuple[float, float]:
    """(mean validation reward over [0, end] generated responses, the value at ``end``)."""
    x = np.array([p["generated"] for p in curve], dtype=float)
    y = np.array([p["val"] for p in curve], dtype=float)
    grid = np.linspace(0, end, 201)
    values = np.interp(grid, x, y)
    return float(np.trapezoid(values, grid) / end), float(values[-1])


def _plot(results: dict, end: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {"grpo": "tab:blue", "dapo": "tab:orange"}
    for key, run in results.items():
        name, seed = key.rsplit("_", 1)
        curve = run["curve"]
        x, y = [p["generated"] for p in curve], [p["val"] for p in curve]
        ax.plot(x, y, marker="o", markersize=3, color=colours[name], label=f"{name.upper()} seed {seed}")
    ax.axvline(end, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("responses generated")
    ax.set_ylabel("val/reward_mean")
    ax.set_title("CPU quickstart (arith): DAPO vs GRPO per generated sample")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="compare_dapo_") as tmp:
        for seed in args.seeds:
            for name, config in RUNS.items():
                results[f"{name}_{seed}"] = _run(name, config, args.steps, args.test_freq, seed, Path(tmp))
    end = min(run["generated"] for run in results.values())
    comparison: dict[str, dict] = {}
    for name in RUNS:
        per_seed = {seed: _over(results[f"{name}_{seed}"]["curve"], end) for seed in args.seeds}
        comparison[name] = {
            "mean_val_over_range": {s: round(m, 4) for s, (m, _) in per_seed.items()},
            "val_at_range_end": {s: round(v, 4) for s, (_, v) in per_seed.items()},
            "mean_over_seeds": {
                "mean_val_over_range": round(float(np.mean([m for m, _ in per_seed.values()])), 4),
                "val_at_range_end": round(float(np.mean([v for _, v in per_seed.values()])), 4),
            },
        }
    report = {
        "steps": args.steps,
        "seeds": args.seeds,
        "common_generated_range": end,
        "runs": results,
        "comparison": comparison,
    }
    if args.plot is not None:
        _plot(results, end, args.plot)
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
