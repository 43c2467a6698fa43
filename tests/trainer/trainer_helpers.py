"""A tiny random Llama, the arith task, and a helper that runs the real `rlhf-megatron train` CLI.

A uniquely named module (not conftest) so tests of other directories can import it unambiguously.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("trainer_inputs")
    subprocess.run([sys.executable, str(ROOT / "tools/data/arith.py"), "--output-dir", str(root / "data"),
                    "--train-size", "64", "--test-size", "8", "--seed", "0"], check=True, capture_output=True)  # fmt: skip
    # The quickstart preset's architecture (its model_arch must match the checkpoint), random weights.
    model = make_tiny_hf_model(root / "model", "llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=512, max_position_embeddings=128)  # fmt: skip
    return {"model": str(model), "data": str(root / "data")}


def train_overrides(inputs, run_dir, **extra):
    base = {
        "actor_rollout_ref.model.path": inputs["model"],
        "critic.model.path": inputs["model"],
        "data.train_files": f"{inputs['data']}/train.parquet",
        "data.val_files": f"{inputs['data']}/test.parquet",
        "trainer.default_local_dir": str(run_dir),
        # Small, fast steps, independent of the quickstart's tuning: 8 prompts x n=4, 2 mini-batches.
        "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 16,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 16,
        "trainer.logger": "['jsonl']",
        "trainer.total_training_steps": 2,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run_train(config, overrides, env=None, timeout=600):
    """Run the real CLI in a fresh process; returns (CompletedProcess, metric records by step)."""
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    config_args = ["--config", config] if config else []
    proc = subprocess.run([sys.executable, "-m", "rlhf_megatron.train", *config_args, *overrides],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.default_local_dir="))
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc, records
