"""Plot a run's metrics.jsonl: reward, KL, response length and phase timings, to one PNG.

When the records carry ``timeline/<role>/<phase>/start_s|end_s`` (every run since the rollout
scheduler), a Gantt panel of the last ``GANTT_STEPS`` steps shows, one lane per role, when each
phase ran: with the rollout on its own pool, generation overlapping training.

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


GANTT_STEPS = 3


def timeline_spans(records: list[dict], last_steps: int = GANTT_STEPS) -> list[tuple[str, str, float, float]]:
    """(role, phase, start_s, end_s) of the last ``last_steps`` steps that logged a timeline."""
    timed = [r for r in records if any(k.startswith("timeline/") for k in r)][-last_steps:]
    spans = []
    for r in timed:
        for key, start in r.items():
            if key.startswith("timeline/") and key.endswith("/start_s"):
                _, role, phase, _ = key.split("/", 3)
                end = r.get(key[: -len("start_s")] + "end_s")
                if isinstance(start, (int, float)) and isinstance(end, (int, float)):
                    spans.append((role, phase, float(start), float(end)))
    return spans


def _gantt(ax, spans) -> None:
    import matplotlib.pyplot as plt

    roles = sorted({role for role, *_ in spans}, key=lambda r: (r != "rollout", r))
    colours = plt.get_cmap("tab10")
    phases = [p for p in PHASES if any(s[1] == p for s in spans)]
    phases += sorted({s[1] for s in spans} - set(phases))
    for i, phase in enumerate(phases):
        for lane, role in enumerate(roles):
            bars = [(a, b - a) for r, p, a, b in spans if r == role and p == phase]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=colours(i % 10), label=phase)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=3)
    ax.set_yticks(range(len(roles)), roles)
    ax.set_xlabel("seconds since the run started")
    ax.set_title(f"timeline of the last {GANTT_STEPS} steps")


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(records: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = timeline_spans(records)
    rows = 3 if spans else 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows))
    if spans:
        gs = axes[2][0].get_gridspec()
        for ax in axes[2]:
            ax.remove()
        _gantt(fig.add_subplot(gs[2, :]), spans)
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
