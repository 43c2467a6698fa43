"""GLM-4.5 (``Glm4MoeForCausalLM``) read from config.json: DeepSeekMoE's sigmoid router, shared
experts, leading dense layers, partial rotary, q/k/v biases and q/k norms; the options the engine
cannot honour are refused naming the key; the HF⇄mcore spec's shapes equal transformers' tensors."""

from __future__ import annotations

import json

import pytest

from rlhf_megatron.planning.model_arch import ModelArch, UnsupportedModelError


def _config(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm4MoeConfig(
        vocab_size=200,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ).to_dict()
    config["architectures"] = ["Glm4MoeForCausalLM"]
    config.update(overrides)
    return config


def test_glm4_moe_fields():
    arch = ModelArch.from_hf_config(_config())
    assert (arch.model_type, arch.num_kv_heads, arch.head_dim) == ("glm4_moe", 2, 32)
    assert arch.qkv_bias and arch.qk_norm and arch.rotary_percent == 0.5 and arch.mla is None
    moe = arch.moe
    assert moe.moe_layers == (1, 2) and not arch.is_moe_layer(0)
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size) == (8, 4, 64)
    assert moe.shared_expert_ffn_hidden_size == 128 and not moe.shared_expert_gate
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk) == ("sigmoid", True, 4, 2)
    assert moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob
    assert arch.mtp_layers == 1  # transformers' default num_nextn_predict_layers
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch


def test_glm4_moe_without_bias_norms_or_groups():
    arch = ModelArch.from_hf_config(_config(attention_bias=False, use_qk_norm=False, n_group=1, topk_group=1))
    assert not arch.qkv_bias and not arch.qk_norm
    assert arch.moe.num_groups is None and arch.moe.group_topk is None


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"n_group": 4, "topk_group": 1}, "topk_group"),  # 4 // 1 != 2: megatron scores groups otherwise
        ({"n_group": 3}, "n_group"),  # 8 experts do not split in 3 groups
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ],
)
def test_glm4_moe_refuses_what_the_engine_cannot_honour(overrides, key):
    with pytest.raises(UnsupportedModelError, match=key) as err:
        ModelArch.from_hf_config(_config(**overrides), source="ckpt/config.json")
    assert "ckpt/config.json" in str(err.value)


def test_spec_shapes_equal_transformers_tensors(tmp_path):
    from safetensors import safe_open

    from rlhf_megatron.models.spec import expected_hf_shapes, mcore_param_names
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    hf = make_tiny_moe_model(tmp_path / "glm", "glm4_moe", num_experts=4, mlp_only_layers=(0,))
    arch = ModelArch.from_hf_dir(hf)
    got = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            got.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})  # noqa: SIM118
    assert expected_hf_shapes(arch) == got
    names = mcore_param_names(arch)
    assert "decoder.layers.1.mlp.router.expert_bias" in names
    assert "decoder.layers.0.mlp.router.expert_bias" not in names  # layer 0 is dense
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
