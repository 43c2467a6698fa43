"""The HF⇄mcore spec, without processes: layouts, TP slices, round trips, layer offsets, errors."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.models import ModelArch
from rlhf_megatron.models.spec import (
    DictTensorSource,
    SpecError,
    StageError,
    expected_hf_shapes,
    gather_tp_shards,
    global_to_local_layer,
    hf_names,
    hf_to_mcore,
    layer_offset,
    local_to_global_layer,
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
    split_tp_shard,
    tp_partition_dim,
    tp_shard_slices,
)

from . import tiny_hf


def _arch_and_state(family: str, head=None):
    model = tiny_hf.make_hf_model(family)
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    arch = ModelArch.from_hf_config(config, head=head)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if arch.head != "lm":
        g = torch.Generator().manual_seed(5)
        state["score.weight"] = torch.randn(1, arch.hidden_size, generator=g)
        if arch.head_bias:
            state["score.bias"] = torch.randn(1, generator=g)
        state.pop("lm_head.weight", None)
    return arch, state


@pytest.mark.parametrize(
    "family, head",
    [("llama", None), ("qwen2", None), ("qwen3", None), ("llama", "value"), ("qwen2", "reward")],
)
def test_hf_to_mcore_to_hf_is_bit_exact_and_complete(family, head):
    arch, state = _arch_and_state(family, head)
    source = DictTensorSource(state)
    exported = {}
    for name in mcore_param_names(arch):
        full = hf_to_mcore(name, arch, source)
        assert tuple(full.shape) == mcore_full_shape(name, arch), name
        for hf_name, t in mcore_to_hf(name, full, arch):
            assert hf_name not in exported, f"{hf_name} produced twice"
            exported[hf_name] = t
    # Everything HF stores comes back, bit for bit; a tied lm_head is stored once, as the embedding.
    expected_names = set(state) - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    assert set(exported) == expected_names
    for hf_name, t in exported.items():
        assert torch.equal(t, state[hf_name]), hf_name
    assert set(expected_hf_shapes(arch)) == expected_names


def test_qkv_interleaving_is_megatron_layout():
    # 2 kv groups, 2 query heads per group, head_dim 1: rows labelled by their meaning.
    arch = ModelArch.from_hf_config(
        {
            **tiny_hf.hf_config("qwen2").to_dict(),
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 1,
            "num_hidden_layers": 1,
        }
    )
    q = torch.tensor([10.0, 11, 12, 13])
    k = torch.tensor([20.0, 21])
    v = torch.tensor([30.0, 31])
    src = DictTensorSource({f"model.layers.0.self_attn.{p}_proj.bias": t for p, t in zip("qkv", (q, k, v))})
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert hf_to_mcore(name, arch, src).tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # TP=2 splits whole groups: rank 1 holds group 1.
    assert hf_to_mcore(name, arch, src, tp_rank=1, tp_size=2).tolist() == [12, 13, 21, 31]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp_size", [2])  # the tiny models have 2 kv heads
def test_sliced_reads_equal_slices_of_the_full_tensor(family, tp_size):
    arch, state = _arch_and_state(family)
    source = DictTensorSource(state)
    for name in mcore_param_names(arch):
        full = hf_to_mcore(name, arch, source, 0, 1)
        # The full tensor at this TP size: vocabulary rows padded further (384 -> 512 rows).
        extra_rows = mcore_full_shape(name, arch, tp_size)[0] - full.shape[0]
        full_tp = torch.cat([full, full.new_zeros(extra_rows, *full.shape[1:])])
        shards = [hf_to_mcore(name, arch, source, r, tp_size) for r in range(tp_size)]
        for r, shard in enumerate(shards):
            assert torch.equal(shard, split_tp_shard(name, full_tp, arch, r, tp_size)), (name, r)
        assert torch.equal(gather_tp_shards(name, shards, arch), full_tp), name


def test_fc1_shard_is_gate_then_up_of_that_rank():
    arch, state = _arch_and_state("llama")
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    shard = hf_to_mcore(name, arch, DictTensorSource(state), tp_rank=1, tp_size=2)
    f = arch.ffn_hidden_size // 2
    assert torch.equal(shard, torch.cat([gate[f:], up[f:]]))
    assert [(s.local_start, s.full_start, s.length) for s in tp_shard_slices(name, arch, 1, 2)] == [
        (0, f, f),
        (f, 2 * f + f, f),
    ]


def test_partition_dims_and_names_of_both_megatron_specs():
    arch, _ = _arch_and_state("qwen3")
    dims = {
        "embedding.word_embeddings.weight": 0,
        "decoder.layers.0.self_attention.linear_qkv.weight": 0,
        "decoder.layers.0.self_attention.linear_proj.weight": 1,
        "decoder.layers.0.mlp.linear_fc1.weight": 0,
        "decoder.layers.0.mlp.linear_fc2.weight": 1,
        "decoder.layers.0.input_layernorm.weight": None,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": None,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": None,
        "decoder.layers.0.self_attention.q_layernorm.weight": None,
        "decoder.final_layernorm.weight": None,
        "output_layer.weight": 0,
    }
    assert {n: tp_partition_dim(n, arch) for n in dims} == dims
    local, te = mcore_param_names(arch), mcore_param_names(arch, fused_norms=True)
    assert len(local) == len(te) == 2 + 8 * arch.num_layers + 1  # 8 = 2 norms, qkv, q/k norms, proj, fc1, fc2
    assert "decoder.layers.3.pre_mlp_layernorm.weight" in local
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in te
    assert hf_names("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", arch) == (
        "model.layers.3.post_attention_layernorm.weight",
    )
    assert mcore_full_shape("output_layer.weight", arch, tp_size=2) == (512, 128)


def test_layer_offsets_agree_with_megatron():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for pp, vpp in [(1, None), (2, None), (4, None), (2, 2), (2, 4)]:
        config = TransformerConfig(
            num_layers=16,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
        )
        for p in range(pp):
            for v in range(vpp or 1):
                stage = v if vpp else None
                assert layer_offset(16, p, pp, stage, vpp) == get_transformer_layer_offset(config, stage, p)


def test_local_global_layer_names_round_trip():
    name = local_to_global_layer(
        "decoder.layers.1.mlp.linear_fc2.weight", 16, pp_rank=1, pp_size=2, vpp_rank=1, vpp_size=2
    )
    assert name == "decoder.layers.13.mlp.linear_fc2.weight"  # chunk 1*2+1 = 3, 4 layers per chunk
    assert global_to_local_layer(name, 16, 2, 2) == (1, 1, "decoder.layers.1.mlp.linear_fc2.weight")
    assert local_to_global_layer("output_layer.weight", 16, 1, 2) == "output_layer.weight"
    with pytest.raises(StageError, match="do not split evenly"):
        layer_offset(6, 0, 4)
    with pytest.raises(StageError, match="beyond this chunk"):
        local_to_global_layer("decoder.layers.8.mlp.linear_fc2.weight", 16, 0, 2)


def test_errors_name_the_parameter_and_the_reason():
    arch, state = _arch_and_state("llama")
    with pytest.raises(SpecError, match="does not exist for this configuration"):
        hf_names("decoder.layers.0.self_attention.linear_qkv.bias", arch)  # Llama has no qkv bias
    with pytest.raises(SpecError, match="not a known parameter name"):
        hf_names("decoder.layers.0.self_attention.rotary.weight", arch)
    with pytest.raises(SpecError, match="layer 9 is outside"):
        hf_names("decoder.layers.9.mlp.linear_fc2.weight", arch)
    with pytest.raises(SpecError, match=r"num_key_value_heads \(2\) is not divisible by the TP size 4"):
        tp_shard_slices("decoder.layers.0.self_attention.linear_qkv.weight", arch, 0, 4)
    state["model.layers.2.self_attn.k_proj.weight"] = state["model.layers.2.self_attn.k_proj.weight"][:-1]
    with pytest.raises(
        SpecError, match=r"model.layers.2.self_attn.k_proj.weight has shape \[63, 128\].*\[64, 128\]"
    ):
        hf_to_mcore("decoder.layers.2.self_attention.linear_qkv.weight", arch, DictTensorSource(state))


def test_asking_for_transformer_engine_without_it_names_the_key():
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model, transformer_engine_installed

    if transformer_engine_installed():
        pytest.skip("transformer_engine is installed here")
    arch, _ = _arch_and_state("llama")
    with pytest.raises(
        ValueError, match="transformer_engine is not installed.*megatron.transformer_impl=local"
    ):
        build_gpt_model(arch, ParallelConfig(1), use_te=True)


def test_sdpa_attention_with_transformer_engine_layers_names_both_keys():
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model

    arch, _ = _arch_and_state("llama")
    with pytest.raises(ValueError, match="attention_backend=sdpa.*megatron.transformer_impl=local"):
        build_gpt_model(arch, ParallelConfig(1), use_te=True, attention_backend="sdpa")
