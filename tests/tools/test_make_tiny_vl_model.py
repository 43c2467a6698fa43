"""tools/make_tiny_vl_model.py pre-trains through the SFT trainer: its image rows must give the SFT
trainer the token ids and pixel values RL's dataset gives the rollout, plus the target answer."""

import importlib.util
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rlhf_megatron.config.loader import load_stage_config
from rlhf_megatron.config.schema_stages import SFTConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.multimodal import load_vision_processor
from rlhf_megatron.models.tiny import build_tiny_qwen2_5_vl
from rlhf_megatron.stages.data import sft_samples

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_vl_model.py"


def _builder():
    spec = importlib.util.spec_from_file_location("tools_make_tiny_vl_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_sft_rows_are_the_rl_prompts_and_images_with_the_target(tmp_path):
    builder = _builder()
    args = builder.parse_args(
        ["--data-dir", str(tmp_path / "rl"), "--train-size", "4", "--test-size", "2"]
        + ["--pool-size", "6", "--probe-size", "2"]
    )
    model_dir = tmp_path / "model"
    model, processor = build_tiny_qwen2_5_vl(seed=0)
    model.save_pretrained(model_dir, safe_serialization=True)
    processor.save_pretrained(model_dir)
    _, pool_dir = builder.write_datasets(args, tmp_path)
    rows = builder.write_sft_rows(pool_dir, tmp_path / "sft" / "train.parquet")

    vision, tokenizer = load_vision_processor(model_dir), processor.tokenizer
    rl = RLHFDataset(f"{pool_dir}@train", tokenizer, builder.data_config(args), vision, limit_images=1)
    pixels = args.size * args.size
    overrides = [
        *builder.SFT_DATA_KEYS,
        f"data.min_pixels={pixels}",
        f"data.max_pixels={pixels}",
    ]
    data = OmegaConf.to_object(load_stage_config(SFTConfig, None, overrides)).data
    samples = sft_samples(data, tokenizer, rows, "data.train_files", vision)
    assert len(samples) == len(rl) == 6
    for i, sample in enumerate(samples):
        item = rl[i]
        prompt = item["input_ids"][item["attention_mask"].bool()].tolist()
        answer = str(item["reward_model"]["ground_truth"])
        target = tokenizer.encode(builder.target(answer), add_special_tokens=False) + [tokenizer.eos_token_id]
        # Qwen's template closes the turn with a newline after <|im_end|>; generation ends at the eos
        ids, mask, end = list(sample.input_ids), list(sample.loss_mask), len(prompt) + len(target)
        assert ids[:end] == prompt + target and tokenizer.decode(ids[end:]) == "\n"
        assert mask[:end] == [0] * len(prompt) + [1] * len(target)
        got = sample.images.pixel_inputs(vision)
        want = item["multi_modal_inputs"]
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
        assert torch.allclose(got["pixel_values"], want["pixel_values"])
