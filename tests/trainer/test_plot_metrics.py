"""tools/plot_metrics.py draws a PNG from metrics.jsonl and refuses bad input clearly."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools/plot_metrics.py"), *map(str, args)], capture_output=True, text=True
    )


def test_plot_writes_png(tmp_path):
    rows = [
        {
            "step": s,
            "critic/score/mean": s / 10,
            "val/reward_mean": s / 9,
            "actor/ppo_kl": 0.01,
            "response_length/mean": 5 + s,
            "timing_s/step": 1.0,
            "timing_s/gen": 0.5,
            "timing_s/update_actor": 0.3,
        }
        for s in range(1, 5)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_errors_name_the_file(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 2 and "metrics.jsonl does not exist" in proc.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, ')
    proc = _run(tmp_path)
    assert proc.returncode == 2 and "metrics.jsonl:2 is not JSON" in proc.stderr


def test_timeline_records_add_a_gantt_panel_and_old_runs_keep_their_layout(tmp_path):
    import matplotlib.pyplot as plt

    from rlhf_megatron.trainer.plot import build_figure, phase_colours, plot, timeline_spans

    rows = [
        {"step": s, "critic/score/mean": s / 10, "timing_s/step": 1.0, "timing_s/gen": 0.5}
        for s in range(1, 5)
    ]
    titles = ["reward", "KL", "response length", "phase timings (s)"]
    old = build_figure(rows)
    assert [ax.get_title() for ax in old.axes] == titles
    plt.close(old)
    old_png = plot(rows, tmp_path / "old.png")
    for r in rows:  # one-step-off: batch k+1 generated while the trainer updates on batch k
        k = r["step"]
        r.update(
            {
                "timeline/rollout/gen/start_s": k - 0.5,
                "timeline/rollout/gen/end_s": k + 0.2,
                "timeline/trainer/update_actor/start_s": k,
                "timeline/trainer/update_actor/end_s": k + 0.9,
            }
        )
    spans = timeline_spans(rows)
    assert len(spans) == 6 and ("rollout", "gen", 3.5, 4.2) in spans  # the last 3 steps
    fig = build_figure(rows)
    gantt = fig.axes[-1]
    assert [ax.get_title() for ax in fig.axes] == [*titles, "timeline of steps 2-4"]
    assert [t.get_text() for t in gantt.get_yticklabels()] == ["rollout", "trainer"]
    assert [t.get_text() for t in gantt.get_legend().get_texts()] == ["gen", "update_actor"]
    # One bar collection per (role, phase), coloured as the phase is in the timings panel.
    bars = {c.get_label(): c for c in gantt.collections}
    assert len(gantt.collections) == 2
    assert tuple(bars["gen"].get_facecolor()[0]) == phase_colours(["gen"])["gen"]
    plt.close(fig)
    new_png = plot(rows, tmp_path / "new.png")
    from PIL import Image

    assert Image.open(new_png).size[1] > Image.open(old_png).size[1]  # a third row: the Gantt panel


def test_multi_turn_records_add_turn_and_tool_call_panels():
    from rlhf_megatron.trainer.plot import build_figure

    rows = [
        {"step": s, "critic/score/mean": 0.1 * s, "num_turns/mean": 1 + s / 4, "tool_calls/mean": s / 4}
        for s in (1, 2, 3)
    ]
    titles = [ax.get_title() for ax in build_figure(rows).axes]
    assert "turns per trajectory" in titles and "tool calls" in titles
    plain = [{k: v for k, v in r.items() if k in ("step", "critic/score/mean")} for r in rows]
    assert "tool calls" not in [ax.get_title() for ax in build_figure(plain).axes]
