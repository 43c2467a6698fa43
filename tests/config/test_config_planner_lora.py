"""The memory planner with LoRA: adapter counts per TP rank and pipeline stage, frozen base
weights counted once, a reference without weights of its own, and the LoRA presets' verdicts."""

from __future__ import annotations

import pytest
from cfg_helpers import MOE_ARCH, make_cfg

from rlhf_megatron import cli
from rlhf_megatron.config import ConfigError
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.memory import GIB, TRAINER_POOL, format_plan, plan_memory, transformer_impl

# GRPO with a KL loss (so the reference runs) on the tiny arch of cfg_helpers: 4 layers, hidden
# 256, 4 query heads and 2 KV heads of 64, ffn 512; TP2 x DP4, bf16, distributed optimizer,
# sequence parallel, micro-batches of 4 x 1024 tokens. Local layers in both runs, so LoRA's own
# terms are all that differ.
GRPO = (
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.transformer_impl=local",
    "actor_rollout_ref.ref.megatron.transformer_impl=local",
)
LORA = ("actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32")

# Adapter parameters of one layer, rank 16, by hand. Whole: r x (in + out) per projection.
WHOLE_LAYER = 16 * (
    (256 + 256)  # q_proj
    + 2 * (256 + 128)  # k_proj, v_proj
    + (256 + 256)  # o_proj
    + 2 * (256 + 512)  # gate_proj, up_proj
    + (512 + 256)  # down_proj
)
# On one of 2 TP ranks: column-parallel A [r, in] whole and B [out/2, r]; row-parallel A
# [r, in/2] and B [out, r] whole.
TP2_LAYER = (
    (16 * 256 + 256 * 16 // 2)  # q_proj
    + 2 * (16 * 256 + 128 * 16 // 2)  # k_proj, v_proj
    + (16 * 256 // 2 + 256 * 16)  # o_proj
    + 2 * (16 * 256 + 512 * 16 // 2)  # gate_proj, up_proj
    + (16 * 512 // 2 + 256 * 16)  # down_proj
)


def _plan(*overrides: str):
    plan = plan_memory(make_cfg(*GRPO, *overrides, validate=True))
    return plan, {r.role: r for r in plan.roles}, {p.name: p for p in plan.phases}


def test_adapter_counts_by_hand():
    assert (WHOLE_LAYER, TP2_LAYER) == (65_536, 47_104)
    plan, roles, _ = _plan(*LORA)
    assert plan.adapters.total == 4 * WHOLE_LAYER
    assert roles["actor"].adapter_params == 4 * TP2_LAYER
    assert plan.adapters.params(range(2), tp=2) == 2 * TP2_LAYER
    # A pipeline rank holds its own layers' adapters: PP2 puts two layers on each.
    _, roles_pp, _ = _plan(*LORA, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2")
    assert roles_pp["actor"].adapter_params == 2 * TP2_LAYER
    # A list of names adapts those projections only: q and v.
    _, roles_qv, _ = _plan(*LORA, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]")
    assert roles_qv["actor"].adapter_params == 4 * ((16 * 256 + 256 * 8) + (16 * 256 + 128 * 8))


def test_lora_state_is_the_adapters_and_the_reference_holds_no_weights():
    full_plan, full, _ = _plan()
    lora_plan, lora, _ = _plan(*LORA)
    base = full["actor"].params  # this rank's base parameters, the same in both runs
    assert lora["actor"].params == base and full_plan.adapters is None
    n = 4 * TP2_LAYER
    # Full fine-tuning: bf16 weights, fp32 grads, fp32 master + Adam m, v sharded over DP4.
    assert full["actor"].weights == pytest.approx(2 * base)
    assert full["actor"].grads + full["actor"].optimizer == pytest.approx(4 * base + 12 * base / 4)
    # LoRA: the frozen base once in bf16 plus the fp32 adapters; fp32 grads and Adam m, v (8 B,
    # sharded over DP4, no master copy) for the adapters only.
    assert lora["actor"].weights == pytest.approx(2 * base + 4 * n)
    assert lora["actor"].grads == pytest.approx(4 * n)
    assert lora["actor"].optimizer == pytest.approx(8 * n / 4)
    assert lora["actor"].optimizer_other == pytest.approx(8 * n)
    # The reference: its own bf16 copy without LoRA, none with it; its forward pass remains.
    assert full["ref"].weights == pytest.approx(2 * base) and full["ref"].params == base
    assert lora["ref"].weights == 0 and lora["ref"].params == 0
    assert lora["ref"].shares_weights == "actor" and full["ref"].shares_weights is None
    assert lora["ref"].forward_logits == pytest.approx(full["ref"].forward_logits)
    assert lora["ref"].forward_activations == pytest.approx(full["ref"].forward_activations)


def test_lora_activations_add_each_adapted_linears_fp32_input():
    # Per token and layer at TP2 with sequence parallelism: the fp32 copy of each adapted
    # linear's input (/2: the sequence under SP for column-parallel, the features for
    # row-parallel) plus x A^T, r fp32 values per adapted projection.
    per_token_layer = 4 * (
        (256 / 2 + 3 * 16)  # linear_qkv: q, k, v
        + (256 / 2 + 16)  # linear_proj: o
        + (256 / 2 + 2 * 16)  # linear_fc1: gate, up
        + (512 / 2 + 16)  # linear_fc2: down
    )
    assert per_token_layer == 3008
    _, full, _ = _plan()
    _, lora, _ = _plan(*LORA)
    tokens = 4 * 1024  # no recompute: every layer of the micro-batch keeps it
    assert lora["actor"].activations - full["actor"].activations == pytest.approx(
        4 * tokens * per_token_layer
    )
    # Forward-only passes keep nothing for backward.
    assert lora["actor"].forward_activations == pytest.approx(full["actor"].forward_activations)


def test_reference_pass_brings_the_actors_offloaded_weights_back():
    offload = "actor_rollout_ref.actor.megatron.param_offload=true"
    _, roles, phases = _plan(*LORA, offload)
    actor, ref = roles["actor"], roles["ref"]
    assert phases["generate"].parts["actor"] == pytest.approx(actor.grads + actor.optimizer)  # weights away
    assert phases["ref log-prob"].parts["actor"] == pytest.approx(actor.with_weights())
    assert phases["ref log-prob"].parts["ref"] == pytest.approx(
        max(ref.forward_activations, ref.forward_logits)
    )
    # Without LoRA the reference brings its own weights and the actor's stay away.
    _, full_roles, full_phases = _plan(offload)
    assert full_phases["ref log-prob"].parts["actor"] == pytest.approx(full_roles["actor"].resident())


def test_disaggregated_reference_pass_runs_on_the_actors_weights():
    own_pool = (
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=8",
        "actor_rollout_ref.actor.megatron.param_offload=true",
    )
    plan = plan_memory(make_cfg(*GRPO, *LORA, *own_pool))
    actor = next(r for r in plan.roles if r.role == "actor")
    ref_phase = next(p for p in plan.phases if p.name == "ref log-prob")
    assert ref_phase.pool == TRAINER_POOL and ref_phase.parts["actor"] == pytest.approx(actor.with_weights())


def test_lora_runs_local_layers():
    cfg = make_cfg(*LORA, validate=True)
    m = cfg.actor_rollout_ref.actor.megatron
    assert m.transformer_impl == "auto"
    assert transformer_impl(cfg, m) == "transformer_engine"
    assert transformer_impl(cfg, m, lora=True) == "sdpa"  # local layers, torch's fused attention on GPU


def test_moe_experts_get_no_adapters_and_naming_them_is_an_error():
    plan = plan_memory(make_cfg(*GRPO[:4], *MOE_ARCH, *LORA))
    attention = 16 * ((256 + 256) + 2 * (256 + 128) + (256 + 256))  # q, k, v, o; every layer sparse
    assert plan.adapters.total == 4 * attention
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.target_modules.*experts"):
        plan_memory(
            make_cfg(*GRPO[:4], *MOE_ARCH, *LORA, "actor_rollout_ref.model.target_modules=[gate_proj]")
        )


def test_format_plan_shows_the_adapters_and_the_shared_reference():
    plan, _, _ = _plan(*LORA)
    text = format_plan(plan)
    assert "LoRA rank 16, alpha 32, target_modules all-linear: 0.3M adapter parameters" in text
    assert "the reference is the actor with its adapters off: it shares the actor's weights" in text
    assert "(actor's weights)" in text
    assert "LoRA" not in format_plan(_plan()[0])


# Llama-3.1-70B's 4-node preset squeezed onto one node of 8 x 80 GB for GRPO: TP8, no pipeline.
ONE_NODE_70B = [
    "trainer.nnodes=1",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
]


def test_rank_16_makes_70b_fit_one_node():
    full = plan_memory(load_config("models/llama3.1_70b.yaml", ONE_NODE_70B))
    lora = plan_memory(
        load_config("models/llama3.1_70b.yaml", [*ONE_NODE_70B, "actor_rollout_ref.model.lora_rank=16"])
    )
    assert not full.fits and lora.fits, format_plan(lora)
    f, r = ({x.role: x for x in p.roles} for p in (full, lora))
    assert f["ref"].weights == pytest.approx(f["actor"].weights) and f["ref"].weights > 16 * GIB
    assert r["ref"].weights == 0
    base = f["actor"].params  # 70.55B / TP8 on the one stage, DP1
    n = r["actor"].adapter_params
    assert n == 80 * (  # rank 16, all-linear, one of 8 TP ranks
        (16 * 8192 + 8192 * 2)  # q_proj
        + 2 * (16 * 8192 + 1024 * 2)  # k_proj, v_proj
        + (16 * 1024 + 8192 * 16)  # o_proj
        + 2 * (16 * 8192 + 28672 * 2)  # gate_proj, up_proj
        + (16 * 3584 + 8192 * 16)  # down_proj
    )
    assert f["actor"].grads + f["actor"].optimizer == pytest.approx(16 * base)  # > 130 GiB
    assert r["actor"].grads + r["actor"].optimizer == pytest.approx(12 * n)  # < 1 GiB
    assert r["actor"].weights == pytest.approx(f["actor"].weights + 4 * n)


LORA_PRESETS = ["models/llama3.1_70b_lora.yaml", "models/qwen3_30b_a3b_lora.yaml"]
EVERY_OFFLOAD = [
    f"actor_rollout_ref.actor.megatron.{flag}_offload=true" for flag in ("param", "grad", "optimizer")
]


@pytest.mark.parametrize("preset", LORA_PRESETS)
def test_lora_presets_fit_one_node_where_full_fine_tuning_does_not(preset, capsys):
    cfg = load_config(preset, [])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.gpu_memory_gb) == (1, 8, 80)
    assert cfg.actor_rollout_ref.hybrid_engine and cfg.actor_rollout_ref.rollout.name == "vllm"
    lora = plan_memory(cfg)
    assert lora.fits and lora.adapters is not None, format_plan(lora, preset)
    assert lora.peak.total < 0.9 * lora.gpu_memory  # headroom beside the plan's estimate
    assert cli.main(["plan", preset]) == 0
    assert "it shares the actor's weights" in capsys.readouterr().out
    full = plan_memory(load_config(preset, ["actor_rollout_ref.model.lora_rank=0"]))
    assert not full.fits and full.adapters is None
    # Not even with everything the actor can offload to the host: its update holds it all.
    offloaded = plan_memory(load_config(preset, ["actor_rollout_ref.model.lora_rank=0", *EVERY_OFFLOAD]))
    assert not offloaded.fits
    assert any(p.startswith("actor update needs") for p in offloaded.problems), offloaded.problems
    assert cli.main(["plan", preset, "actor_rollout_ref.model.lora_rank=0"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
