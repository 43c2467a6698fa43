"""The training run the measurement tools start: one command line, one way to read its metrics.

    from train_runs import ensure_tiny_model, read_metrics, run_train, train_command   # tools/ on sys.path

``train_command`` spells ``python -m rlhf_megatron.train --config CONFIG`` for a measurement: a
fixed number of steps, metrics to ``metrics.jsonl`` in ``run_dir`` only, no checkpoints, no resume,
validation off unless asked for. ``overrides`` come last, so a tool's own values win (the loader
keeps the last value of a key). ``run_train`` runs it and returns the metric records, or raises
naming the run with the end of its stderr. ``hooks_env`` adds the fault-injection test hook where
an environment asks for a fault. ``ensure_tiny_model`` builds the CPU quickstart's policy the
measured runs start from, when it is not there yet.

Boundaries: the training run's command line, its process and its metrics file; what a tool
measures in them is the tool's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULT_HOOKS = ROOT / "tests" / "fault_hooks.py"
TINY_MODEL = ROOT / "outputs" / "tiny_model"
"""The CPU quickstart's policy (``configs/quickstart_cpu.yaml``), as ``tools/make_tiny_model.py`` writes it."""


def ensure_tiny_model() -> Path:
    """``TINY_MODEL``, built with ``tools/make_tiny_model.py``'s defaults unless its stamp is there
    (the build's JSON report is dropped: a measuring tool's stdout carries its own)."""
    if not (TINY_MODEL / "stamp.json").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "make_tiny_model.py")],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return TINY_MODEL


def train_command(
    config: str,
    run_dir: Path,
    steps: int,
    overrides: Sequence[str] = (),
    *,
    test_freq: int = -1,
    val_before_train: bool = False,
) -> list[str]:
    """The command line of a measured run of ``config`` (see the module doc)."""
    return [
        sys.executable,
        "-m",
        "rlhf_megatron.train",
        "--config",
        config,
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        f"trainer.val_before_train={str(val_before_train).lower()}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.save_freq=-1",
        "trainer.logger=['jsonl']",
        "trainer.resume_mode=disable",
        *overrides,
    ]


def hooks_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``RLHF_FAULT_HOOKS`` pointing at the test hook when it sets a fault."""
    env = dict(env)
    if any(v and (k.startswith("RLHF_FAULT") or k == "RLHF_STOP_AFTER_STEP") for k, v in env.items()):
        env.setdefault("RLHF_FAULT_HOOKS", str(FAULT_HOOKS))
    return env


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (none when the run wrote none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_train(
    name: str, command: list[str], run_dir: Path, env: Mapping[str, str] | None = None
) -> list[dict]:
    """Run ``command`` from the repository root; its metric records, or RuntimeError naming ``name``."""
    proc = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=hooks_env(env if env is not None else os.environ),
    )
    if proc.returncode:
        raise RuntimeError(f"{name}: the training run failed:\n{proc.stderr[-3000:]}")
    return read_metrics(run_dir)
