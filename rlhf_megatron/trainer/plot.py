"""Plot a run's metrics.jsonl: reward, KL, response length and phase timings, to one PNG.

Used at the end of every run (``<run dir>/metrics.png``) and by ``tools/plot_metrics.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PHASES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "sync_weights",
)


def load_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the run directory (trainer.default_local_dir)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e}); the file may be truncated") from e
    if not records:
        raise ValueError(f"{path} is empty: the run logged no step")
    return records


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(records: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [
        (axes[0][0], "reward", ["critic/score/mean", "val/reward_mean"]),
        (axes[0][1], "KL", ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
        (axes[1][0], "response length", ["response_length/mean", "response_length/max"]),
    ]
    for ax, title, keys in panels:
        for key in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    train = [r for r in records if "timing_s/step" in r]
    bottom = [0.0] * len(train)
    for phase in PHASES:
        ys = [float(r.get(f"timing_s/{phase}", 0.0)) for r in train]
        if any(ys):
            ax.bar([r["step"] for r in train], ys, bottom=bottom, label=phase)
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_title("phase timings (s)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out
