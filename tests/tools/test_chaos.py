"""``tools/chaos.py``'s own logic: what a trial may draw and how the trials add up (the trials
themselves are real runs: too slow for the suite; docs/reliability.md reports a run)."""

import importlib.util
import random
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "chaos.py"


def _tool():
    spec = importlib.util.spec_from_file_location("chaos", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_draws_cover_every_moment_at_a_step_where_it_occurs():
    chaos = _tool()
    rng = random.Random(0)
    draws = [chaos.draw(rng, 4) for _ in range(400)]
    seen = {(d["layout"], d["phase"]) for d in draws}
    assert seen == {
        (layout, phase) for layout, (_, moments) in chaos.LAYOUTS.items() for phase, _, _ in moments
    }
    for d in draws:
        if d["phase"] == "ckpt":
            assert d["step"] in (2, 4)  # a save every 2 steps
        elif d["phase"] == "val":
            assert d["step"] in (0, 2, 4)  # before training, then every 2 steps
        else:
            assert 1 <= d["step"] <= 4
        if d["phase"].startswith("rollout_"):
            assert d["rank"] == 0  # the one-step-off rollout pool has one process


def test_summary_counts_what_a_user_would_check():
    chaos = _tool()
    row = dict(
        fired=True, finished=True, restarts=1, steps_lost=1, corrupt_checkpoints=0, partial_checkpoints=0
    )
    rows = [
        {**row, "leftover_processes": 0, "leftover_shm": [], "seconds": 40.0},
        {
            **row,
            "steps_lost": 2,
            "finished": False,
            "leftover_processes": 1,
            "leftover_shm": ["x"],
            "seconds": 60.0,
        },
    ]
    summary = chaos.summarize(rows)
    assert summary["trials"] == 2 and summary["finished"] == 1 and summary["restarts"] == 2
    assert summary["steps_lost_max"] == 2 and summary["steps_lost_mean"] == 1.5
    assert summary["leftover_processes"] == 1 and summary["leftover_shm_segments"] == 1
