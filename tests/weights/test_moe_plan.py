"""The sync plan of mixture-of-experts models: pure, checked without processes."""

import pytest
import torch

from rlhf_megatron.models.spec import expected_hf_shapes, expert_owner, local_to_global_expert
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.weights import TrainLayout, build_sync_plan

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
)


def _arch(config) -> ModelArch:
    return ModelArch.from_hf_config(config)


def test_every_expert_key_of_the_hf_checkpoint_is_planned_once():
    for config, block, projs in (
        (QWEN2_MOE, "mlp", ("gate_proj", "up_proj", "down_proj")),
        (MIXTRAL, "block_sparse_moe", ("w1", "w3", "w2")),
    ):
        arch = _arch(config)
        shapes = expected_hf_shapes(arch)
        experts = {n for n in shapes if ".experts." in n}
        sparse = [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]
        assert experts == {
            f"model.layers.{i}.{block}.experts.{e}.{p}.weight"
            for i in sparse
            for e in range(arch.moe.num_experts)
            for p in projs
        }
        plan = build_sync_plan(arch, TrainLayout(1, 2, ep_size=2), 2, "hf", bucket_bytes=1 << 20)
        targets = [t.name for tr in plan.transfers for t in tr.targets]
        assert sorted(targets) == sorted(shapes) and len(targets) == len(set(targets))


def test_plan_records_ep_owners_and_local_expert_names():
    arch = _arch(QWEN2_MOE)
    plan = build_sync_plan(arch, TrainLayout(2, 2, ep_size=4, etp_size=1), 2, "hf", bucket_bytes=1 << 20)
    by_name = {t.name: t for t in plan.transfers}
    t = by_name["decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"]
    # 4 layers over PP2: layer 2 is stage 1's layer 0; 8 experts over EP4: expert 5 is EP rank 2's expert 1.
    assert (t.pp_rank, t.ep_rank, t.local_name) == (
        1,
        2,
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
    )
    assert t.mode == "local"  # ETP=1: each expert whole on its EP rank, no gather
    assert by_name["decoder.layers.0.mlp.router.weight"].ep_rank is None
    assert by_name["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].mode == "gather"  # split by TP
    etp2 = build_sync_plan(arch, TrainLayout(1, 1, ep_size=2, etp_size=2), 2, "hf", bucket_bytes=1 << 20)
    assert {t.mode for t in etp2.transfers if t.ep_rank is not None} == {"gather"}
    assert plan.summary()["experts"] == 3 * 8 * 2 and plan.summary()["train_ep"] == 4
    assert (
        local_to_global_expert(t.local_name, 8, 2, 4)
        == "decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"
    )
    assert expert_owner(t.name, 8, 4) == (2, "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight")


def test_sharded_targets_are_rows_of_vllms_fused_experts():
    arch = _arch(MIXTRAL)
    plan = build_sync_plan(arch, TrainLayout(1, 1, ep_size=2), 2, "sharded", bucket_bytes=1 << 20)
    rows = {
        (t.stream_name, t.rollout_rank): t.shape
        for tr in plan.transfers
        for t in tr.targets
        if t.index is not None
    }
    w13 = "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"
    w2 = "model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight"
    assert rows[(f"{w13}[3]", 1)] == (2 * 90 // 2, 256)  # [gate_r; up_r] of expert 3 for vLLM rank 1
    assert rows[(f"{w2}[0]", 0)] == (256, 90 // 2)
    assert len(rows) == 2 * 4 * 2 * 2  # layers x experts x (w13, w2) x vLLM ranks
    with pytest.raises(ValueError, match="does not divide the experts' width moe_intermediate_size=90"):
        build_sync_plan(arch, TrainLayout(1, 1, ep_size=2), 4, "sharded")
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 does not divide the 4 experts"):
        build_sync_plan(arch, TrainLayout(1, 1, ep_size=3), 1, "hf")


@pytest.mark.parametrize("bucket_bytes", [1, 100_000, 300_000])
def test_experts_are_bucketed_one_by_one(bucket_bytes):
    """A layer's experts (8 x 192 KiB in fp32) exceed these buckets: they spread over several, and a
    bucket exceeds the bound only when it holds a single tensor."""
    arch = _arch(QWEN2_MOE)
    plan = build_sync_plan(
        arch, TrainLayout(1, 1, ep_size=2), 1, "hf", bucket_bytes=bucket_bytes, dtype_bytes=4
    )
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.transfers) == 1
    layer0 = [
        i for i, b in enumerate(plan.buckets) for t in b.transfers if ".layers.0.mlp.experts." in t.name
    ]
    assert len(set(layer0)) > 1
    largest = max(t.nbytes(4) for t in plan.transfers)
    assert max(b.nbytes for b in plan.buckets) <= max(bucket_bytes, largest)


def test_copy_sharded_weights_fills_expert_rows_and_names_misfits():
    from rlhf_megatron.weights import copy_sharded_weights

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w13_weight = torch.nn.Parameter(torch.zeros(3, 4, 2), requires_grad=False)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    row = torch.arange(8.0).view(4, 2)
    touched = copy_sharded_weights(model, [("experts.w13_weight[1]", row), ("norm.weight", torch.ones(2))])
    assert touched == {"experts.w13_weight", "norm.weight"}
    assert torch.equal(model.experts.w13_weight[1], row) and model.experts.w13_weight[[0, 2]].abs().sum() == 0
    with pytest.raises(ValueError, match=r"experts.w13_weight\[2\] has shape \[2, 2\], .* row has \[4, 2\]"):
        copy_sharded_weights(model, [("experts.w13_weight[2]", torch.ones(2, 2))])
    with pytest.raises(KeyError, match="no parameter 'experts.w2_weight'"):
        copy_sharded_weights(model, [("experts.w2_weight[0]", row)])


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_deepseekmoe_families_plan_every_hf_tensor_once_and_vllms_fused_names(family):
    """GLM-4.5 and DeepSeek-V3 from the MoE quickstart's actor layout (TP2 x EP2, experts whole):
    the hf plan carries every checkpoint tensor once (the router's score-correction bias, a megatron
    buffer, included); GLM's sharded plan uses vLLM's names for its shared experts
    (``mlp.shared_experts``, not Qwen2-MoE's ``mlp.shared_expert``), MLA's is refused."""
    from rlhf_megatron.models.tiny import build_tiny_moe_model

    model, _ = build_tiny_moe_model(family, hidden_size=256, num_heads=4, mlp_only_layers=(0,), groups=(2, 1))
    arch = ModelArch.from_hf_config(model.config.to_dict())
    layout = TrainLayout(2, 1, ep_size=2, etp_size=1)
    shapes = expected_hf_shapes(arch)
    plan = build_sync_plan(arch, layout, 1, "hf")
    targets = [t.name for tr in plan.transfers for t in tr.targets]
    assert sorted(targets) == sorted(shapes) and len(targets) == len(set(targets))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in targets
    if family == "deepseek_v3":
        with pytest.raises(ValueError, match="load_format=sharded is not supported for DeepseekV3"):
            build_sync_plan(arch, layout, 1, "sharded")
        return
    sharded = {
        t.name: t.shape for tr in build_sync_plan(arch, layout, 2, "sharded").transfers for t in tr.targets
    }
    assert sharded["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == (2 * 64 // 2, 256)
    assert sharded["model.layers.1.self_attn.qkv_proj.bias"] == ((4 + 2 + 2) * 64 // 2,)
    assert sharded["model.layers.1.mlp.gate.e_score_correction_bias"] == (4,)
