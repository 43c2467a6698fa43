"""A real verl command line (TinyZero's train_tiny_zero.sh) parses and validates unchanged.

Only ``verl.trainer.main_ppo`` becomes ``rlhf_megatron.train`` and the shell variables get
concrete values: DATA_DIR and BASE_MODEL point into tmp_path (BASE_MODEL holds a Qwen2.5-3B
config.json), ROLLOUT_TP_SIZE=2, N_GPUS=2, EXPERIMENT_NAME=countdown-qwen2.5-3b.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from cfg_helpers import write_hf_config
from omegaconf import OmegaConf

from rlhf_megatron import cli, train
from rlhf_megatron.config import RunConfig
from rlhf_megatron.config.loader import RESOLVED_CONFIG_NAME
from rlhf_megatron.planning import load_config

SEED_ARGS = [
    "data.train_files=$DATA_DIR/train.parquet",
    "data.val_files=$DATA_DIR/test.parquet",
    "data.train_batch_size=256",
    "data.val_batch_size=1312",
    "data.max_prompt_length=256",
    "data.max_response_length=1024",
    "actor_rollout_ref.model.path=$BASE_MODEL",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "actor_rollout_ref.actor.ppo_micro_batch_size=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP_SIZE",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=$BASE_MODEL",
    "critic.ppo_micro_batch_size=8",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=['wandb']",
    "trainer.val_before_train=False",
    "trainer.default_hdfs_dir=null",
    "trainer.n_gpus_per_node=$N_GPUS",
    "trainer.nnodes=1",
    "trainer.save_freq=100",
    "trainer.test_freq=100",
    "trainer.project_name=TinyZero",
    "trainer.experiment_name=$EXPERIMENT_NAME",
    "trainer.total_epochs=15",
]


@pytest.fixture
def seed_args(tmp_path: Path) -> list[str]:
    model = write_hf_config(tmp_path / "Qwen2.5-3B")
    values = {
        "$DATA_DIR": str(tmp_path / "data"),
        "$BASE_MODEL": str(model),
        "$ROLLOUT_TP_SIZE": "2",
        "$N_GPUS": "2",
        "$EXPERIMENT_NAME": "countdown-qwen2.5-3b",
    }
    out = []
    for arg in SEED_ARGS:
        for var, value in values.items():
            arg = arg.replace(var, value)
        out.append(arg)
    return out


def test_seed_command_has_the_exact_key_list():
    keys = [arg.split("=", 1)[0] for arg in SEED_ARGS]
    assert len(keys) == 28
    assert keys[0] == "data.train_files" and keys[-1] == "trainer.total_epochs"


def test_seed_command_loads_validates_and_normalises(seed_args, tmp_path):
    with pytest.warns(UserWarning, match="trainer.default_hdfs_dir"):
        cfg = load_config(None, seed_args)
    assert OmegaConf.get_type(cfg) is RunConfig
    assert cfg.data.train_files == f"{tmp_path}/data/train.parquet"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert list(cfg.trainer.logger) == ["wandb"]
    assert cfg.trainer.val_before_train is False
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.actor_rollout_ref.rollout.response_length == 1024
    # verl's global micro-batches become per-GPU sizes: world 2, TP=PP=CP=1, so DP=2.
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4
    assert cfg.critic.forward_micro_batch_size_per_gpu == 4
    # TP=1 switches sequence parallelism off, as verl does.
    assert cfg.actor_rollout_ref.actor.megatron.sequence_parallel is False


def test_seed_command_dry_run_prints_and_writes_nothing(seed_args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train.main([*seed_args, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "experiment_name: countdown-qwen2.5-3b" in out
    assert "ppo_micro_batch_size_per_gpu: 4" in out
    assert "warning: 1 config key(s) have no effect" in err and "trainer.default_hdfs_dir" in err
    assert "dry run" in err
    assert not (tmp_path / "checkpoints").exists()


def test_seed_command_through_python_dash_m(seed_args, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.train", *seed_args, "--validate-only"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "project_name: TinyZero" in result.stdout


def test_seed_command_through_rlhf_megatron_train(seed_args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--dry-run", *seed_args]) == 0
    assert "tensor_model_parallel_size: 2" in capsys.readouterr().out


def test_train_saves_resolved_config_and_calls_the_trainer(seed_args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []
    fake = types.ModuleType("rlhf_megatron.trainer")
    fake.run_training = calls.append
    monkeypatch.setitem(sys.modules, "rlhf_megatron.trainer", fake)
    assert train.main(seed_args) == 0
    saved = tmp_path / "checkpoints" / "TinyZero" / "countdown-qwen2.5-3b" / RESOLVED_CONFIG_NAME
    assert saved.is_file()
    assert len(calls) == 1 and calls[0].trainer.experiment_name == "countdown-qwen2.5-3b"
    assert OmegaConf.load(saved) == calls[0]


def test_train_without_a_trainer_raises_a_clear_error(seed_args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "rlhf_megatron.trainer", None)  # import fails
    with pytest.raises(
        train.TrainerUnavailableError, match="rlhf_megatron.trainer.run_training is not available"
    ):
        train.main(seed_args)
    # Validation and saving happened before the trainer was needed.
    assert (tmp_path / "checkpoints" / "TinyZero" / "countdown-qwen2.5-3b" / RESOLVED_CONFIG_NAME).is_file()


def test_invalid_command_line_exits_2_with_the_problems(seed_args, capsys):
    assert (
        train.main([*seed_args, "actor_rollout_ref.rollout.tensor_model_parallel_size=3", "--dry-run"]) == 2
    )
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide the world size 2" in err
