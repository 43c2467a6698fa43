"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, Kimi-K2's ``kimi_k2`` spelling too) read from config.json:
multi-latent attention, YaRN, DeepSeekMoE routing, next-token-prediction layers counted; the
HF⇄mcore spec's shapes equal transformers' tensors, and MLA's rotary rows load as stored when HF
interleaves them (megatron's MLA de-interleaves them itself) and are paired up when HF rotates
halves. (Logits against transformers: ``test_moe_equivalence.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_megatron.planning.model_arch import ModelArch


def _config(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=200,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ).to_dict()
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    config.update(overrides)
    return config


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2"])
def test_deepseek_v3_fields(model_type):
    arch = ModelArch.from_hf_config(_config(model_type=model_type))
    assert (arch.model_type, arch.architecture) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    mla = arch.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim) == (64, 32, 32, 16)
    assert mla.v_head_dim == 24 and mla.q_head_dim == 48 and mla.rope_interleave
    assert arch.rope_scaling.rope_type == "yarn" and arch.rope_scaling.factor == 4.0
    moe = arch.moe
    assert moe.moe_layers == (1, 2) and (moe.num_experts, moe.top_k) == (8, 4)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk) == ("sigmoid", True, 4, 2)
    assert moe.routed_scaling_factor == 2.5 and moe.shared_expert_ffn_hidden_size == 64
    assert arch.mtp_layers == 1  # transformers' default num_nextn_predict_layers
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch


def _rope_rows(arch: ModelArch, hf: torch.Tensor) -> torch.Tensor:
    """megatron's ``linear_kv_down_proj`` rows loaded from an HF ``kv_a_proj_with_mqa`` ``hf``."""
    from rlhf_megatron.models.spec import DictTensorSource, hf_to_mcore, mcore_to_hf

    name = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    mcore = hf_to_mcore(
        name, arch, DictTensorSource({"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": hf})
    )
    ((hf_name, back),) = mcore_to_hf(name, mcore, arch)
    assert hf_name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" and torch.equal(back, hf)
    return mcore


def test_mla_rotary_rows_follow_megatrons_own_deinterleaving():
    interleaved = ModelArch.from_hf_config(_config())
    halves = ModelArch.from_hf_config(_config(rope_interleave=False))
    assert not halves.mla.rope_interleave
    hf = torch.arange(32 + 16, dtype=torch.float32)[:, None].expand(-1, 128).clone()
    assert torch.equal(_rope_rows(interleaved, hf), hf)  # megatron de-interleaves in its RoPE
    pairs = _rope_rows(halves, hf)
    assert torch.equal(pairs[:32], hf[:32])  # the latent rows as stored
    # halves h0..h7 | h8..h15 stored as pairs (h0, h8), (h1, h9), ..: megatron's [0::2 | 1::2] undoes it
    rope = pairs[32:, 0] - 32
    assert rope.tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    assert torch.equal(torch.cat((rope[0::2], rope[1::2])), torch.arange(16.0))


def test_spec_shapes_equal_transformers_tensors(tmp_path):
    from safetensors import safe_open

    from rlhf_megatron.models.spec import expected_hf_shapes, mcore_param_names
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    hf = make_tiny_moe_model(
        tmp_path / "ds", "deepseek_v3", num_experts=4, mlp_only_layers=(0,), hidden_size=128, num_heads=2
    )
    arch = ModelArch.from_hf_dir(hf)
    got = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            got.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})  # noqa: SIM118
    assert expected_hf_shapes(arch) == got
    names = mcore_param_names(arch)
    assert "decoder.layers.1.mlp.router.expert_bias" in names
    assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in names


def test_mla_never_packs_shared_prompts_even_without_experts():
    """Megatron's MLA takes rotary positions from the column index: packed responses would not
    restart theirs, so shared-prompt packing stays off for it (as for MoE, VL and CP)."""
    import dataclasses

    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.workers.megatron_engine import packs_prompts

    arch = ModelArch.from_hf_config(_config(model_type="deepseek_v3"))
    dense_mla = dataclasses.replace(arch, moe=None)
    assert not packs_prompts(arch, ParallelConfig()) and not packs_prompts(dense_mla, ParallelConfig())
    assert packs_prompts(dataclasses.replace(dense_mla, mla=None), ParallelConfig())
