"""Plot a run's metrics.jsonl: reward, KL, response length and phase timings, to one PNG; for a
multi-turn run, turns per trajectory and tool calls too.

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
"""Steps the Gantt panel shows: enough to see one step's generation overlap the next's training."""


def _timed_records(records: list[dict], last_steps: int) -> list[dict]:
    return [r for r in records if any(k.startswith("timeline/") for k in r)][-last_steps:]


def timeline_spans(records: list[dict], last_steps: int = GANTT_STEPS) -> list[tuple[str, str, float, float]]:
    """(role, phase, start_s, end_s) of the last ``last_steps`` steps that logged a timeline."""
    spans = []
    for r in _timed_records(records, last_steps):
        for key, start in r.items():
            if key.startswith("timeline/") and key.endswith("/start_s"):
                _, role, phase, _ = key.split("/", 3)
                end = r.get(key[: -len("start_s")] + "end_s")
                if isinstance(start, (int, float)) and isinstance(end, (int, float)):
                    spans.append((role, phase, float(start), float(end)))
    return spans


def phase_colours(phases) -> dict[str, tuple]:
    """One colour per phase, the same in the timings and the Gantt panels: a known phase takes
    tab10's colour at its place in ``PHASES``; others, in name order, tab20's light shades."""
    import matplotlib

    known, light = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
    others = sorted(set(phases) - set(PHASES))
    return {
        p: known(PHASES.index(p)) if p in PHASES else light((2 * others.index(p) + 1) % light.N)
        for p in phases
    }


def _gantt(ax, spans, steps: list[tuple[int, float]]) -> None:
    """One lane per role (the rollout's on top), a bar per phase; a dotted line where each step begins."""
    roles = sorted({role for role, *_ in spans}, key=lambda r: (r != "rollout", r))
    phases = [p for p in PHASES if any(s[1] == p for s in spans)]
    phases += sorted({s[1] for s in spans} - set(phases))
    colours = phase_colours(phases)
    for phase in phases:
        for lane, role in enumerate(roles):
            bars = [(a, b - a) for r, p, a, b in spans if r == role and p == phase]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=colours[phase], label=phase)
    for step, begin in steps:
        ax.axvline(begin, color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(
            f"step {step}",
            (begin, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -2),
            textcoords="offset points",
            va="top",
            fontsize=7,
            color="grey",
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_yticks(range(len(roles)), roles)
    ax.set_ylim(len(roles) - 0.5, -0.9)  # lane 0 (the rollout) on top, room above it for step labels
    ax.set_xlabel("seconds since the run started")
    first, last = steps[0][0], steps[-1][0]
    ax.set_title(f"timeline of step {first}" if first == last else f"timeline of steps {first}-{last}")


def _step_starts(records: list[dict]) -> list[tuple[int, float]]:
    """(step, earliest start_s) of the steps the Gantt panel shows."""
    out = []
    for r in _timed_records(records, GANTT_STEPS):
        starts = [v for k, v in r.items() if k.startswith("timeline/") and k.endswith("/start_s")]
        if starts:
            out.append((r.get("step", len(out) + 1), float(min(starts))))
    return out


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _legend(ax, **kwargs) -> None:
    """A legend only where something is labelled (an empty one is a warning and a blank box)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def build_figure(records: list[dict]):
    """The metrics figure: reward, KL, response length, phase timings, turns and tool calls when
    the records carry them (multi-turn runs), and, when they carry ``timeline/*`` keys, a full-width Gantt row of the last ``GANTT_STEPS`` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = timeline_spans(records)
    agent = any("tool_calls/mean" in r for r in records)  # multi-turn runs
    rows = 2 + agent + bool(spans)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows))
    if spans:
        gs = axes[rows - 1][0].get_gridspec()
        for ax in axes[rows - 1]:
            ax.remove()
        _gantt(fig.add_subplot(gs[rows - 1, :]), spans, _step_starts(records))
    panels = [
        (axes[0][0], "reward", ["critic/score/mean", "val/reward_mean"]),
        (axes[0][1], "KL", ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
        (axes[1][0], "response length", ["response_length/mean", "response_length/max"]),
    ]
    if agent:
        panels += [
            (axes[2][0], "turns per trajectory", ["num_turns/mean", "num_turns/max"]),
            (axes[2][1], "tool calls", ["tool_calls/mean", "tool_calls/rate", "tool_calls/error_rate"]),
        ]
    for ax, title, keys in panels:
        for key in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        _legend(ax, fontsize=8)
    ax = axes[1][1]
    train = [r for r in records if "timing_s/step" in r]
    bottom = [0.0] * len(train)
    colours = phase_colours(PHASES)
    for phase in PHASES:
        ys = [float(r.get(f"timing_s/{phase}", 0.0)) for r in train]
        if any(ys):
            ax.bar([r["step"] for r in train], ys, bottom=bottom, label=phase, color=colours[phase])
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_title("phase timings (s)")
    ax.set_xlabel("step")
    _legend(ax, fontsize=7)
    fig.tight_layout()
    return fig


def build_stage_figure(records: list[dict]):
    """The figure of a stage before RL (SFT, reward-model training): losses, the reward model's
    pairwise accuracy and margin, learning rate and gradient norm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rm = any("train/accuracy" in r for r in records)
    panels = [
        ("loss", ["train/loss", "val/loss"]),
        ("learning rate", ["train/lr"]),
        ("gradient norm", ["train/grad_norm"]),
    ]
    if rm:
        panels.insert(1, ("pairwise accuracy and margin", ["train/accuracy", "val/accuracy", "val/margin"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    return fig


def plot(records: list[dict], out: Path) -> Path:
    """Draw ``build_figure(records)`` (a stage's run: ``build_stage_figure``) to ``out`` (PNG),
    replacing it atomically."""
    stage = any("train/loss" in r for r in records) and not any("critic/score/mean" in r for r in records)
    fig = (build_stage_figure if stage else build_figure)(records)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out
