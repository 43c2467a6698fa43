"""DeepSeek-V3, Kimi-K2, GLM-4.5 and GLM-4.5-Air presets in the planner: architectures as their
config.json files give them, parameter counts (multi-latent attention, shared experts, leading
dense layers) against the published totals and the spec's tensor shapes, the MLA KV cache, and the
expert-bias update key's defaults and validation."""

from __future__ import annotations

import math
import re

import pytest
from cfg_helpers import MOE_ARCH, make_cfg

from rlhf_megatron.config import ConfigError
from rlhf_megatron.planning import load_config, validate_config
from rlhf_megatron.planning.arch import arch_for_role, count_parameters, kv_cache_values_per_token
from rlhf_megatron.planning.memory import plan_memory
from rlhf_megatron.planning.model_arch import ModelArch

DEEPSEEK, KIMI = "models/deepseek_v3_671b.yaml", "models/kimi_k2.yaml"
GLM, AIR = "models/glm4.5_355b.yaml", "models/glm4.5_air_106b.yaml"

# The model cards: total and activated parameters. DeepSeek's 671B leaves out its 14B
# next-token-prediction module (the hub's 685B has it); GLM publishes activated parameters without
# the embeddings and the LM head (355B-A32B, 106B-A12B), DeepSeek and Moonshot with them.
PUBLISHED = {
    DEEPSEEK: dict(total=671e9, active=37e9, active_without_embeddings=False),
    KIMI: dict(total=1.04e12, active=32e9, active_without_embeddings=False),
    GLM: dict(total=355e9, active=32e9, active_without_embeddings=True),
    AIR: dict(total=106e9, active=12e9, active_without_embeddings=True),
}

# From the config.json files: layers, hidden, query heads, KV heads (MLA: one per query head),
# routed experts, per token, expert width, leading dense layers, vocabulary, MTP layers.
ARCHITECTURE = {
    DEEPSEEK: (61, 7168, 128, 128, 256, 8, 2048, 3, 129280, 1),
    KIMI: (61, 7168, 64, 64, 384, 8, 2048, 1, 163840, 0),
    GLM: (92, 5120, 96, 8, 160, 8, 1536, 3, 151552, 1),
    AIR: (46, 4096, 96, 8, 128, 8, 1408, 1, 151552, 1),
}


def _arch(preset: str) -> ModelArch:
    arch, source = arch_for_role(load_config(preset, []), "actor")
    assert source == "model_arch"
    return arch


@pytest.mark.parametrize("preset", sorted(ARCHITECTURE))
def test_preset_architecture_is_the_config_json(preset):
    arch = _arch(preset)
    moe = arch.moe
    layers, hidden, heads, kv_heads, experts, top_k, width, dense, vocab, mtp = ARCHITECTURE[preset]
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (
        layers,
        hidden,
        heads,
        kv_heads,
    )
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size) == (experts, top_k, width)
    assert moe.moe_layers == tuple(range(dense, layers))  # the first `dense` layers keep their MLP
    assert moe.shared_expert_ffn_hidden_size == width and not moe.shared_expert_gate  # one ungated
    assert moe.score_function == "sigmoid" and moe.expert_bias
    assert (arch.vocab_size, arch.mtp_layers) == (vocab, mtp)
    if preset in (DEEPSEEK, KIMI):
        mla = arch.mla
        assert (
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_rope_head_dim,
            mla.qk_nope_head_dim,
            mla.v_head_dim,
        ) == (
            1536,
            512,
            64,
            128,
            128,
        )
        assert (moe.num_groups, moe.group_topk) == ((8, 4) if preset == DEEPSEEK else (None, None))
    else:
        assert arch.mla is None and arch.head_dim == 128 and arch.rotary_percent == 0.5 and arch.qkv_bias
        assert arch.qk_norm == (preset == GLM)  # GLM-4.5 normalises q and k, the Air does not


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_total_and_active_parameters_are_the_published_ones(preset):
    c, published = count_parameters(_arch(preset)), PUBLISHED[preset]
    active = c.active - (c.embedding + c.output if published["active_without_embeddings"] else 0)
    assert abs(c.total - published["total"]) / published["total"] < 0.03, c.total
    assert abs(active - published["active"]) / published["active"] < 0.03, active


@pytest.mark.parametrize("preset", [DEEPSEEK, AIR])
def test_counts_are_the_sums_of_the_checkpoints_tensor_shapes(preset):
    """The HF tensors the weight spec expects of the checkpoint (what loading reads), summed; the
    next-token-prediction layers are not part of the count."""
    from rlhf_megatron.models.spec import expected_hf_shapes

    arch = _arch(preset)
    past = re.compile(r"^model\.layers\.(\d+)\.")
    shapes = {
        n: s
        for n, s in expected_hf_shapes(arch).items()
        if not (m := past.match(n)) or int(m.group(1)) < arch.num_layers
    }
    assert count_parameters(arch).total == sum(math.prod(s) for s in shapes.values())


def test_mla_attention_counts_the_latent_projections():
    """DeepSeek-V3's layer 0 attention, tensor by tensor as its safetensors hold them."""
    arch = _arch(DEEPSEEK)
    attention = (
        7168 * 1536  # q_a_proj
        + 1536  # q_a_layernorm
        + 1536 * 128 * (128 + 64)  # q_b_proj: every head's [nope | rope] query
        + 7168 * (512 + 64)  # kv_a_proj_with_mqa: the latent and the shared rotary key
        + 512  # kv_a_layernorm
        + 512 * 128 * (128 + 128)  # kv_b_proj: every head's key (nope) and value
        + 128 * 128 * 7168  # o_proj
    )
    dense_layer = attention + 2 * 7168 + 3 * 7168 * 18432
    assert count_parameters(arch).layers[0] == dense_layer == 187_107_328 + 14_336 + 396_361_728


def test_mla_kv_cache_holds_the_latent_once_per_token_and_layer():
    # DeepSeek-V3: 61 layers x (512 latent + 64 rotary key) bf16 values, whatever the rollout TP
    # (every rank keeps the whole latent); grouped-query attention would hold 2 x 128 x 192 a layer.
    for tp in (8, 16):
        cfg = load_config(DEEPSEEK, [f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"])
        assert plan_memory(cfg).rollout.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    # GLM-4.5 (grouped-query): 92 layers x K and V of one of the 8 KV heads per rank at TP 8.
    assert plan_memory(load_config(GLM, [])).rollout.kv_bytes_per_token == 92 * 2 * 128 * 2
    assert kv_cache_values_per_token(_arch(GLM), tp=1) == 92 * 2 * 8 * 128


def test_mla_activations_count_the_latents_not_grouped_query_widths():
    from rlhf_megatron.planning.memory import _attention_width

    arch = _arch(DEEPSEEK)
    # replicated over TP: q latent (+ normed), kv latent (+ normed), rotary key; per head: q, kv_b's
    # key and value, the assembled key, the attention output
    per_head = 2 * 192 + (128 + 128) + 128
    assert _attention_width(arch, 8) == 2 * 1536 + 2 * 512 + 64 + 128 * per_head / 8
    glm = _arch(GLM)
    assert _attention_width(glm, 8) == (2 * 96 * 128 + 2 * 8 * 128) / 8


def test_expert_bias_update_is_validated():
    with pytest.raises(ConfigError, match=r"moe_router_bias_update_rate=0.0 must be a number > 0"):
        validate_config(make_cfg("actor_rollout_ref.actor.megatron.moe_router_bias_update_rate=0.0"))
    with pytest.raises(ConfigError, match=r"actor.megatron.moe_router_bias_update=true .* has no experts"):
        validate_config(make_cfg("actor_rollout_ref.actor.megatron.moe_router_bias_update=true"))
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM of model_arch routes without an expert bias"):
        validate_config(make_cfg(*MOE_ARCH, "actor_rollout_ref.actor.megatron.moe_router_bias_update=true"))
    # null (the default) is on exactly where the checkpoint carries the bias; true passes there.
    deepseek = load_config(DEEPSEEK, ["actor_rollout_ref.actor.megatron.moe_router_bias_update=true"])
    assert deepseek.actor_rollout_ref.actor.megatron.moe_router_bias_update is True
    assert load_config(GLM, []).actor_rollout_ref.actor.megatron.moe_router_bias_update is None


def test_expert_bias_update_reaches_the_transformer_config_only_where_the_bias_is():
    from rlhf_megatron.models.moe import expert_bias_update_kwargs

    deepseek, qwen = _arch(DEEPSEEK), _arch("models/qwen3_30b_a3b.yaml")
    assert expert_bias_update_kwargs(deepseek, None, 1e-3) == {"moe_router_bias_update_rate": 1e-3}
    assert expert_bias_update_kwargs(deepseek, False, 1e-3) == {}
    assert expert_bias_update_kwargs(qwen, None, 1e-3) == {}
    with pytest.raises(ValueError, match="no expert bias to update"):
        expert_bias_update_kwargs(qwen, True, 1e-3)


def test_auto_search_offers_vllm_tp_across_nodes_only_where_a_node_cannot_hold_the_weights():
    from rlhf_megatron.config.auto_keys import ROLLOUT_TP
    from rlhf_megatron.planning.auto_layout import _layout_values

    def values(preset):
        cfg = load_config(preset, [])
        return _layout_values(cfg, ROLLOUT_TP, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)

    # bf16 weights per GPU at TP 8 against vLLM's share: DeepSeek-V3 156 > 112 GiB, so 16 nodes' worth
    # is offered (78 GiB); Kimi-K2 239 and 120 > 98 GiB, so 32 (60 GiB); GLM-4.5's 82 GiB fit a node
    assert values(DEEPSEEK) == [1, 2, 4, 8, 16]
    assert values(KIMI) == [1, 2, 4, 8, 32]
    assert values(GLM) == values("models/qwen3_235b_a22b.yaml") == [1, 2, 4, 8]
