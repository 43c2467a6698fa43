"""The sync plan of a vision-language actor, without processes: the vision tower and merger stream
with the language model in the ``hf`` format, owned by pipeline stage 0."""

import pytest

from rlhf_megatron.models.spec import expected_hf_shapes
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.weights import TrainLayout, build_sync_plan


def _arch(**text) -> ModelArch:
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": {
            "num_hidden_layers": 8,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 300,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
            **text,
        },
        "vision_config": {
            "depth": 4,
            "hidden_size": 128,
            "num_heads": 4,
            "intermediate_size": 252,
            "out_hidden_size": 256,
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
        },
    }
    return ModelArch.from_hf_config(config)


@pytest.mark.parametrize("layout", [TrainLayout(2, 2), TrainLayout(1, 2, 2), TrainLayout(4, 1)])
def test_hf_targets_cover_tower_merger_and_language_model_once(layout):
    arch = _arch()
    if (
        layout.tp_size == 4
    ):  # 2 KV heads: only the tower could split 4 ways; the plan checks shapes, not heads
        arch = _arch(num_key_value_heads=4)
    plan = build_sync_plan(arch, layout, rollout_tp=2, load_format="hf", bucket_bytes=1 << 18)
    targets = [t for tr in plan.transfers for t in tr.targets]
    assert {t.name: t.shape for t in targets} == expected_hf_shapes(arch)
    assert len(targets) == len(expected_hf_shapes(arch))
    assert {"visual.patch_embed.proj.weight", "visual.merger.mlp.2.weight", "lm_head.weight"} <= {
        t.name for t in targets
    }
    first = (0, 0 if layout.vpp_size else None)
    for tr in plan.transfers:
        if tr.name.startswith("vision_model."):
            assert (tr.pp_rank, tr.vpp_rank, tr.local_name) == (*first, tr.name), tr.name
        assert tr.mode == ("local" if tr.tp_dim is None or layout.tp_size == 1 else "gather"), tr.name
    by_name = {tr.name: tr for tr in plan.transfers}
    fc1 = by_name["vision_model.decoder.layers.3.mlp.linear_fc1.weight"]
    # megatron's padded MLP (252 -> 256 rows per half) streams trimmed to HF's shapes.
    assert fc1.full_shape == (512, 128)
    assert [t.shape for t in fc1.targets] == [(252, 128), (252, 128)]
    assert by_name["language_model.decoder.layers.7.mlp.linear_fc2.weight"].pp_rank == layout.pp_size - 1


def test_sharded_format_is_refused_for_vision_language_models():
    with pytest.raises(
        ValueError, match="load_format=sharded is not supported for Qwen2_5_VLForConditionalGeneration"
    ):
        build_sync_plan(_arch(), TrainLayout(2, 1), rollout_tp=2, load_format="sharded")


def test_plan_is_deterministic_and_buckets_bounded():
    a = build_sync_plan(_arch(), TrainLayout(2, 2, 2), 2, "hf", bucket_bytes=100_000, dtype_bytes=4)
    assert a == build_sync_plan(_arch(), TrainLayout(2, 2, 2), 2, "hf", bucket_bytes=100_000, dtype_bytes=4)
    for bucket in a.buckets:
        assert bucket.nbytes <= 100_000 or len(bucket.transfers) == 1
    names = [t.name for t in a.transfers]
    assert names[0] == "vision_model.patch_embed.weight" and names[-1] == "language_model.output_layer.weight"
