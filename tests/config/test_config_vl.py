"""Vision-language models in config/: published parameter counts from config.json, the stage split,
and the planner's first line."""

from __future__ import annotations

import copy

import pytest

from rlhf_megatron import cli
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.arch import arch_for_role, count_parameters
from rlhf_megatron.planning.memory import _stage_params
from rlhf_megatron.planning.model_arch import ModelArch

# Qwen/Qwen2.5-VL-7B-Instruct config.json, as released (the hub's layout).
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
# Qwen/Qwen2.5-VL-3B-Instruct differs in the language model (tied embeddings) and the merger's output.
QWEN2_5_VL_3B = copy.deepcopy(QWEN2_5_VL_7B)
QWEN2_5_VL_3B.update(
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    vocab_size=151936,
    max_window_layers=70,
)
QWEN2_5_VL_3B["vision_config"]["out_hidden_size"] = 2048


@pytest.mark.parametrize(("config", "published"), [(QWEN2_5_VL_7B, 8.29e9), (QWEN2_5_VL_3B, 3.75e9)])
def test_parameter_counts_match_published_totals(config, published):
    count = count_parameters(ModelArch.from_hf_config(config))
    assert abs(count.total - published) / published < 0.005, f"{count.total / 1e9:.3f}B vs {published / 1e9}B"
    assert 0.66e9 < count.vision < 0.68e9  # the tower and merger, the same for both but the merger's output


def test_the_vision_tower_counts_on_the_first_pipeline_stage():
    arch = ModelArch.from_hf_config(QWEN2_5_VL_7B)
    c = count_parameters(arch)
    first, last = _stage_params(arch, 4)  # (dense, routed experts) of the first and last stage
    layers = c.layers[0] * arch.num_layers // 4
    assert first == (layers + c.embedding + c.vision, 0)
    assert last == (layers + c.final_norm + c.output, 0)
    assert _stage_params(arch, 1) == [(c.total, 0)]


def test_plan_prints_the_total_first_and_the_vl_presets_fit(capsys):
    assert cli.main(["plan", "models/qwen2.5_vl_7b"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "memory plan: models/qwen2.5_vl_7b (8.29B parameters, of which vision tower 0.68B)"
    arch, source = arch_for_role(load_config("models/qwen2.5_vl_7b", []), "actor")
    assert source == "model_arch" and arch == ModelArch.from_hf_config(
        QWEN2_5_VL_7B
    )  # config.json's keys verbatim
