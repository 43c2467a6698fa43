"""Mixture-of-experts in the HF⇄mcore spec and the model config: pure, checked without processes."""

import json

import pytest
import torch

from rlhf_megatron.models.spec import (
    DictTensorSource,
    SpecError,
    expected_hf_shapes,
    hf_names,
    hf_to_mcore,
    is_expert_param,
    mcore_param_names,
    mcore_to_hf,
    split_tp_shard,
)
from rlhf_megatron.planning.model_arch import ModelArch

QWEN2_MOE = dict(
    architectures=["Qwen2MoeForCausalLM"],
    model_type="qwen2_moe",
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    vocab_size=100,
)
MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    hidden_size=256,
    intermediate_size=90,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    vocab_size=100,
    router_aux_loss_coef=0.02,
)


def _arch(config) -> ModelArch:
    return ModelArch.from_hf_config(config)


def test_sparse_and_dense_layers_have_their_own_parameters():
    arch = _arch(QWEN2_MOE)
    names = mcore_param_names(arch)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # layer 1 is dense (mlp_only_layers)
    assert not any(n.startswith("decoder.layers.1.mlp.") and "experts" in n for n in names)
    experts = [n for n in names if n.startswith("decoder.layers.0.mlp.experts.")]
    assert len(experts) == 8 * 2 and all(is_expert_param(n, arch) for n in experts)
    assert hf_names("decoder.layers.0.mlp.shared_experts.gate_weight", arch) == (
        "model.layers.0.mlp.shared_expert_gate.weight",
    )
    with pytest.raises(SpecError, match="which layers are dense and which have experts"):
        hf_names("decoder.layers.1.mlp.router.weight", arch)
    with pytest.raises(SpecError, match="expert 8 is outside the model's 8 experts"):
        hf_names("decoder.layers.0.mlp.experts.local_experts.8.linear_fc1.weight", arch)
    # The transformer-engine spelling: grouped experts and the sparse layer's separate norm.
    te = mcore_param_names(arch, fused_norms=True)
    assert (
        "decoder.layers.0.mlp.experts.linear_fc1.weight7" in te
        and "decoder.layers.0.pre_mlp_layernorm.weight" in te
    )
    # The local spec's checkpoint key of the sparse layer's norm maps to the same HF tensor.
    assert hf_names("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", arch) == (
        "model.layers.0.post_attention_layernorm.weight",
    )


def test_expert_gate_up_split_over_etp_like_a_dense_mlp():
    arch = _arch(MIXTRAL)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(arch).items()}
    full = hf_to_mcore(name, arch, DictTensorSource(hf))
    gate, up = (
        hf["model.layers.1.block_sparse_moe.experts.3.w1.weight"],
        hf["model.layers.1.block_sparse_moe.experts.3.w3.weight"],
    )
    assert torch.equal(full, torch.cat([gate, up]))
    for rank in range(2):
        shard = hf_to_mcore(name, arch, DictTensorSource(hf), rank, 2)
        assert torch.equal(shard, split_tp_shard(name, full, arch, rank, 2))
        assert torch.equal(shard, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
    assert [n for n, _ in mcore_to_hf(name, full, arch)] == [
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    ]


def test_router_matches_the_family_and_the_aux_loss_coefficient_can_be_overridden(tmp_path):
    from rlhf_megatron.models.builder import ParallelConfig, build_transformer_config
    from rlhf_megatron.workers.role import MegatronRoleWorker

    arch = _arch(MIXTRAL)
    config = build_transformer_config(arch, ParallelConfig(expert_model_parallel_size=2), use_te=False)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 90)
    assert not config.moe_router_pre_softmax  # Mixtral renormalises: softmax over the top-k logits
    assert config.moe_router_dtype == "fp32" and config.moe_token_dispatcher_type == "alltoall"
    assert config.moe_expert_capacity_factor is None and config.moe_aux_loss_coeff == 0.02
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    qwen2 = build_transformer_config(_arch(QWEN2_MOE), ParallelConfig(), use_te=False)
    assert qwen2.moe_router_pre_softmax and qwen2.moe_layer_freq == [1, 0, 1, 1]  # layer 1 dense
    assert qwen2.moe_shared_expert_intermediate_size == 96 and qwen2.moe_shared_expert_gate
    # Overrides: a TransformerConfig field for the builder, an HF key for a role's override_config.
    assert (
        build_transformer_config(
            arch, ParallelConfig(), use_te=False, moe_aux_loss_coeff=0.5
        ).moe_aux_loss_coeff
        == 0.5
    )
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    overridden = MegatronRoleWorker.load_arch(str(tmp_path), "lm", {"router_aux_loss_coef": 0.1})
    assert overridden.moe.aux_loss_coef == 0.1 and MegatronRoleWorker.load_arch(str(tmp_path), "lm") == arch
