"""The transformers rollout engine on video prompts (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): it
generates from the dataset's rows of clips and images, and the log-probs it reports are those of
a teacher-forced transformers forward over the whole sequence with the rows' own M-RoPE
positions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf_megatron.config.schema import DataConfig, RolloutConfig
from rlhf_megatron.data.dataset import RLHFDataset, collate_fn
from rlhf_megatron.data.multimodal import concat_vision_inputs, load_vision_processor
from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl
from rlhf_megatron.rollout import RolloutSampling, build_rollout_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from vl_helpers import png, write_clip  # noqa: E402

RESPONSE_LEN = 6


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """EasyR1-layout rows: a 4-frame clip, a 2-frame clip beside an image, and text only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hf_video")
    clips = [write_clip(root / f"clip{n}.mp4", frames=n, rate=2) for n in (4, 2)]
    (root / "still.png").write_bytes(png(56, 56))
    table = [
        {"problem": "<video>Which way?", "answer": "right", "images": [], "videos": [clips[0]]},
        {
            "problem": "<image>then<video>Same?",
            "answer": "yes",
            "images": ["still.png"],
            "videos": [clips[1]],
        },
        {"problem": "Just text.", "answer": "ok", "images": [], "videos": []},
    ]
    path = root / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    return str(path), root


def _prompts(model_dir: str, data: str):
    from transformers import AutoTokenizer

    cfg = DataConfig(
        prompt_key="problem",
        answer_key="answer",
        image_key="images",
        video_key="videos",
        max_prompt_length=160,
        return_raw_chat=False,
    )
    dataset = RLHFDataset(
        data, AutoTokenizer.from_pretrained(model_dir), cfg, load_vision_processor(model_dir)
    )
    return collate_fn([dataset[i] for i in range(len(dataset))])


def _teacher_forced(model, out) -> torch.Tensor:
    vision = concat_vision_inputs(list(out["multi_modal_inputs"]))
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"].transpose(0, 1),  # [B, 3, S] -> transformers' [3, B, S]
            **vision,
        ).logits.float()
    p = out["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1)
    return lp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_hf_engine_generates_from_clips_with_the_rows_positions(rows, family):
    data, root = rows
    model_dir = str(make_tiny_qwen2_5_vl(root / family, family=family))
    prompts = _prompts(model_dir, data)
    assert [len(m.get("video", [])) for m in prompts["multi_modal_data"]] == [1, 1, 0]
    engine = build_rollout_engine("hf", model_dir, RolloutConfig(), seed=0, pad_token_id=0)
    out = engine.generate_sequences(prompts, RolloutSampling(n=2, response_length=RESPONSE_LEN))
    assert len(out) == 6 and out["position_ids"].shape[1] == 3  # M-RoPE positions over prompt + response
    assert (out["response_mask"].sum(-1) > 0).all()
    err = ((out["rollout_log_probs"] - _teacher_forced(engine.model, out)).abs() * out["response_mask"]).max()
    assert err < 1e-4, f"{family}: the engine's log-probs differ from a teacher-forced forward by {err}"
