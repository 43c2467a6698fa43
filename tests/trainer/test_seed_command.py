"""The TinyZero command line from the seed documents runs one step, unchanged except for
`verl.trainer.main_ppo` -> `rlhf_megatron.train`, local paths for $DATA_DIR/$BASE_MODEL, 2 processes for
$N_GPUS/$ROLLOUT_TP_SIZE, and one training step (the seed trains 15 epochs)."""

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import ROOT, run_train

from rlhf_megatron.data.preprocess import COUNTDOWN_PROMPT_WORDS

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_tinyzero_seed_command_runs_one_step(tmp_path):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    data = tmp_path / "countdown"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/data/countdown.py"),
            "--output-dir",
            str(data),
            "--train-size",
            "256",
            "--test-size",
            "16",
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    model = make_tiny_hf_model(
        tmp_path / "base",
        "qwen2",
        num_layers=2,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
        ffn_hidden_size=256,
        max_position_embeddings=2048,
        extra_words=COUNTDOWN_PROMPT_WORDS,
        eos_logit=5.0,  # answers end after a few tokens, not at the seed's 1024-token limit
    )
    command = f"""
        data.train_files={data}/train.parquet data.val_files={data}/test.parquet data.train_batch_size=256
        data.val_batch_size=1312 data.max_prompt_length=256 data.max_response_length=1024
        actor_rollout_ref.model.path={model} actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.ppo_micro_batch_size=8
        actor_rollout_ref.rollout.log_prob_micro_batch_size=8 actor_rollout_ref.rollout.tensor_model_parallel_size=2
        actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.ref.log_prob_micro_batch_size=4
        critic.optim.lr=1e-5 critic.model.path={model} critic.ppo_micro_batch_size=8 algorithm.kl_ctrl.kl_coef=0.001
        trainer.logger=['wandb'] trainer.val_before_train=False trainer.default_hdfs_dir=null
        trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.save_freq=100 trainer.test_freq=100
        trainer.project_name=TinyZero trainer.experiment_name=countdown-tiny trainer.total_epochs=15
    """.split()
    run_dir = tmp_path / "run"
    overrides = [*command, f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.train", "--dry-run", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, records = run_train(None, overrides, timeout=1200, own_ray=True)  # as its users run it
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1]
    assert records[0]["response_length/mean"] > 0 and "critic/vf_loss" in records[0]
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb (offline) logged the run"
    assert Path(run_dir / "global_step_1" / "critic").is_dir()
