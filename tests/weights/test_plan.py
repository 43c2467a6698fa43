"""The sync plan is pure: checked without processes."""

import pytest
import torch

from rlhf_megatron.models.spec import expected_hf_shapes
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.weights import TrainLayout, build_sync_plan
from rlhf_megatron.weights.execute import _vllm_slice
from rlhf_megatron.weights.plan import vllm_kv_heads_per_rank


def _arch(**kw):
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=110,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    cfg.update(kw)
    return ModelArch.from_hf_config(cfg)


def test_hf_targets_cover_every_exported_tensor_once():
    arch = _arch()
    plan = build_sync_plan(arch, TrainLayout(2, 2), rollout_tp=2, load_format="hf", bucket_bytes=1 << 20)
    targets = {t.name: t.shape for tr in plan.transfers for t in tr.targets}
    assert targets == expected_hf_shapes(arch)
    # Every TP-split parameter needs a gather for the hf format; replicated ones are local.
    for tr in plan.transfers:
        assert tr.mode == ("local" if tr.tp_dim is None else "gather"), tr.name


def test_plan_is_deterministic_and_owners_follow_pp_and_vpp():
    arch = _arch(num_hidden_layers=8)
    a = build_sync_plan(arch, TrainLayout(2, 2, 2), 2, "hf", bucket_bytes=1 << 20)
    b = build_sync_plan(arch, TrainLayout(2, 2, 2), 2, "hf", bucket_bytes=1 << 20)
    assert a == b
    owners = {t.name: (t.pp_rank, t.vpp_rank, t.local_name) for t in a.transfers}
    # 8 layers, PP=2 x VPP=2 -> chunks of 2 layers: layer 2 is chunk 1 = pp 1, vpp 0.
    assert owners["decoder.layers.2.mlp.linear_fc1.weight"] == (
        1,
        0,
        "decoder.layers.0.mlp.linear_fc1.weight",
    )
    assert owners["decoder.layers.5.mlp.linear_fc2.weight"] == (
        0,
        1,
        "decoder.layers.1.mlp.linear_fc2.weight",
    )
    assert owners["embedding.word_embeddings.weight"][:2] == (0, 0)
    assert owners["output_layer.weight"][:2] == (1, 1)


@pytest.mark.parametrize("bucket_bytes", [1, 200_000, 1 << 20, 1 << 30])
def test_buckets_respect_the_bound_except_single_large_tensors(bucket_bytes):
    plan = build_sync_plan(_arch(), TrainLayout(1, 1), 1, "hf", bucket_bytes=bucket_bytes, dtype_bytes=4)
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.transfers) == 1
    assert [t.name for t in plan.transfers] == [t.name for b in plan.buckets for t in b.transfers]


def test_sharded_aligned_layout_needs_no_communication_except_vocab():
    plan = build_sync_plan(_arch(), TrainLayout(2, 1), rollout_tp=2, load_format="sharded")
    modes = {t.name: t.mode for t in plan.transfers}
    assert modes["decoder.layers.0.self_attention.linear_qkv.weight"] == "local"
    assert modes["decoder.layers.0.mlp.linear_fc1.weight"] == "local"
    assert modes["decoder.layers.0.mlp.linear_fc2.weight"] == "local"
    assert modes["embedding.word_embeddings.weight"] == "gather"
    mismatched = build_sync_plan(_arch(), TrainLayout(2, 1), rollout_tp=4, load_format="sharded")
    assert {t.mode for t in mismatched.transfers if t.tp_dim is not None} == {"gather"}


def test_sharded_targets_replicate_kv_heads_when_rollout_tp_exceeds_them():
    arch = _arch()  # 2 KV heads
    assert vllm_kv_heads_per_rank(arch, 4) == 1
    plan = build_sync_plan(arch, TrainLayout(1, 1), rollout_tp=4, load_format="sharded")
    qkv = next(t for t in plan.transfers if t.name == "decoder.layers.0.self_attention.linear_qkv.weight")
    # per rank: 1 query head + 1 (replicated) key head + 1 value head, 64 each
    assert [t.shape for t in qkv.targets] == [(192, 256)] * 4
    k = torch.arange(2 * 64, dtype=torch.float32)[:, None].expand(-1, 3)
    slices = [_vllm_slice("model.layers.0.self_attn.k_proj.weight", k, arch, r, 4) for r in range(4)]
    assert torch.equal(slices[0], slices[1]) and torch.equal(slices[2], slices[3])
    assert not torch.equal(slices[1], slices[2])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"load_format": "safetensors"}, "load_format='safetensors' is not one of"),
        ({"rollout_tp": 0}, "must be >= 1"),
        ({"rollout_tp": 3, "load_format": "sharded"}, "does not divide the 4 attention heads"),
        ({"bucket_bytes": 0}, "update_weights_bucket_megabytes must be positive"),
    ],
)
def test_bad_plan_arguments(kwargs, message):
    args = {"rollout_tp": 2, "load_format": "hf", **kwargs}
    with pytest.raises(ValueError, match=message):
        build_sync_plan(_arch(), TrainLayout(2, 1), **args)
