"""tools/soak.py on the real stack: a healthy run passes its bounds, a leaking and slowing one fails.

The soak runs the CLI on the tiny model for 30 steps (about 40 s here) and fits RSS and weight-sync
time over steps 16-29. The failing case plants a real leak and a real slowdown with the
``RLHF_FAULT`` test hook (``leak:32``: each of the 2 actor workers keeps 32 MiB more per step;
``sync_drift:20``: each sync sleeps 20 ms longer than the one before), so the checks are shown to
catch what they are for.

So short a run has not finished warming up: its healthy RSS slope measured 0.3-0.4 MiB/step here,
5.8 in one fresh-clone CI run and 19 in another (same machine type; that report summed every
process, before the fit left out processes started inside the window). The tests therefore use a
24 MiB/step bound, above that noise and well below the planted 64 MiB/step; the tool's default (5)
is for real soaks of 60+ steps with a 20-step warm-up.
"""

import json
import os
import subprocess
import sys

import pytest
from shared_artifacts import machine_share
from trainer_helpers import ROOT, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SOAK = [sys.executable, str(ROOT / "tools" / "soak.py")]
ARGS = ["--steps", "30", "--warmup", "15", "--max-rss-mb-per-step", "24"]
OWN_KEYS = ("trainer.default_local_dir=", "trainer.total_training_steps=")  # set by soak.py itself


def _soak(inputs, run_dir, env=None):
    overrides = [o for o in train_overrides(inputs, run_dir) if not o.startswith(OWN_KEYS)]
    proc = subprocess.run(
        [*SOAK, *ARGS, "--run-dir", str(run_dir), "--", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def soaks(tiny_run_inputs, tmp_path_factory):
    """Both soaks, one after the other, with the machine to themselves: they bound RSS and
    sync-time slopes, so nothing else may run beside them. Held once for the two, the other
    worker's running test is waited for once and nothing starts between them."""
    root = tmp_path_factory.mktemp("soaks")
    leaking = {**os.environ, "RLHF_FAULT": "leak:32,sync_drift:20"}
    with machine_share(tmp_path_factory, exclusive=True):
        return {
            "healthy": (root / "healthy", *_soak(tiny_run_inputs, root / "healthy")),
            "leaking": (root / "leaking", *_soak(tiny_run_inputs, root / "leaking", leaking)),
        }


def test_soak_of_a_healthy_run_is_flat_and_passes(soaks):
    run_dir, proc, report = soaks["healthy"]
    assert proc.returncode == 0 and report["ok"] is True, report
    assert report["rss_mb_per_step"] <= report["bounds"]["rss_mb_per_step"] == 24.0
    assert report["sync_s_per_step"] <= report["bounds"]["sync_s_per_step"] == 0.01
    assert report["total_rss_mb"][0] > 500, "the workers' memory (models, vLLM) is in the sample"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31)), "30 steps over 8-batch epochs: total_training_steps wins"


def test_soak_catches_a_memory_leak_and_a_slowing_weight_sync(soaks):
    _, proc, report = soaks["leaking"]
    assert proc.returncode == 1 and report["ok"] is False, report
    assert 56 <= report["rss_mb_per_step"] <= 80, report  # 2 workers x 32 MiB = 64 MiB per step
    assert all(h >= 40 for h in report["rss_mb_per_step_by_half"]), report  # sustained, not a step
    grown = report["grew_most"][:2]  # the two leaking actor workers, 32 MiB x 13 steps each
    assert all(p["mb"] >= 350 and p["cmd"].startswith("ray::ActorRolloutRefWorker") for p in grown), report
    assert 0.017 <= report["sync_s_per_step"] <= 0.03, report  # 20 ms per step, plus noise


def test_soak_refuses_too_few_steps_after_warmup():
    proc = subprocess.run([*SOAK, "--steps", "10", "--warmup", "8"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--steps (10) must exceed --warmup (8) by at least 4" in proc.stderr
