"""The memory planner: parameter counts, per-role state, activations, vLLM, phases, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from cfg_helpers import make_cfg

from rlhf_megatron import cli
from rlhf_megatron.config import ConfigError
from rlhf_megatron.config.presets import CONFIGS_DIR
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.arch import arch_for_role, count_parameters
from rlhf_megatron.planning.memory import (
    GIB,
    ROLLOUT_POOL,
    TRAINER_POOL,
    _stage_activations,
    format_plan,
    plan_memory,
)
from rlhf_megatron.planning.model_arch import ModelArch

MODEL_PRESETS = sorted(
    p.relative_to(CONFIGS_DIR).as_posix()
    for p in (CONFIGS_DIR / "models").glob("*.yaml")
    if not p.stem.endswith("_auto")  # the searched variants: tests/config/test_auto_presets.py
)
REPO = Path(__file__).resolve().parents[2]


def _arch(preset: str) -> ModelArch:
    arch, source = arch_for_role(load_config(preset, []), "actor")
    assert source == "model_arch"
    return arch


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        ("models/llama3.1_8b.yaml", 8.03e9),
        ("models/llama3.1_70b.yaml", 70.55e9),
        ("models/qwen2.5_7b.yaml", 7.61e9),
        ("models/qwen2.5_72b.yaml", 72.7e9),
        ("models/llama2_7b.yaml", 6.74e9),
        ("models/qwen2.5_14b.yaml", 14.77e9),
        ("models/qwen2.5_32b.yaml", 32.76e9),
        ("models/qwen2.5_vl_7b.yaml", 8.29e9),  # vision tower included
        ("models/qwen2.5_vl_72b.yaml", 73.4e9),
        ("models/qwen3_vl_8b.yaml", 8.77e9),  # DeepStack mergers and learned positions included
        ("models/qwen3_vl_30b_a3b.yaml", 31.1e9),
        ("examples/countdown_grpo.yaml", 3.09e9),
    ],
)
def test_parameter_counts_match_published_totals(preset, published):
    total = count_parameters(_arch(preset)).total
    assert abs(total - published) / published < 0.005, f"{total / 1e9:.3f}B vs {published / 1e9}B"


def test_exact_counts_for_known_checkpoints():
    # Sums of the tensor sizes in the released safetensors.
    assert count_parameters(_arch("models/llama3.1_8b.yaml")).total == 8_030_261_248
    assert count_parameters(_arch("models/qwen2.5_32b.yaml")).total == 32_763_876_352


def test_critic_swaps_the_lm_head_for_a_value_head():
    arch = _arch("models/llama3.1_8b.yaml")
    lm, critic = count_parameters(arch), count_parameters(arch.with_head("value"))
    # the value head is hidden -> 1 plus a bias, as HF's *ForTokenClassification
    assert lm.total - critic.total == arch.vocab_size * arch.hidden_size - arch.hidden_size - 1


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_every_model_preset_fits_its_declared_hardware(preset):
    cfg = load_config(preset, [])
    # 80 GB H100s, or 141 GB H200s (140 GiB as nvidia-smi counts) for the models whose bf16 weights
    # vLLM cannot hold on one node of H100s (DeepSeek-V3, Kimi-K2, GLM-4.5)
    assert cfg.trainer.gpu_memory_gb in (80, 140) and cfg.trainer.n_gpus_per_node == 8
    plan = plan_memory(cfg)
    assert plan.fits, format_plan(plan, preset)
    assert plan.rollout.sequences >= 1
    assert cli.main(["plan", preset]) == 0


def test_there_is_a_preset_for_every_model_the_project_promises():
    assert MODEL_PRESETS == [
        "models/deepseek_v3_671b.yaml",
        "models/glm4.5_355b.yaml",
        "models/glm4.5_air_106b.yaml",
        "models/kimi_k2.yaml",
        "models/llama2_7b.yaml",
        "models/llama3.1_70b.yaml",
        "models/llama3.1_70b_lora.yaml",
        "models/llama3.1_8b.yaml",
        "models/mixtral_8x7b.yaml",
        "models/qwen2.5_14b.yaml",
        "models/qwen2.5_32b.yaml",
        "models/qwen2.5_72b.yaml",
        "models/qwen2.5_7b.yaml",
        "models/qwen2.5_vl_72b.yaml",
        "models/qwen2.5_vl_7b.yaml",
        "models/qwen3_235b_a22b.yaml",
        "models/qwen3_30b_a3b.yaml",
        "models/qwen3_30b_a3b_lora.yaml",
        "models/qwen3_vl_30b_a3b.yaml",
        "models/qwen3_vl_8b.yaml",
    ]


OVERSIZED = [
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
    "critic.megatron.tensor_model_parallel_size=1",
    "critic.megatron.pipeline_model_parallel_size=1",
    "critic.megatron.virtual_pipeline_model_parallel_size=null",
    "trainer.nnodes=1",
]


def test_planner_rejects_70b_without_model_parallelism(capsys):
    plan = plan_memory(load_config("models/llama3.1_70b.yaml", OVERSIZED))
    assert not plan.fits
    assert any("actor update needs" in p for p in plan.problems)
    actor = next(r for r in plan.roles if r.role == "actor")
    assert actor.weights > 130 * GIB  # 70.55B bf16 weights on one GPU
    assert cli.main(["plan", "models/llama3.1_70b.yaml", *OVERSIZED]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_planner_rejects_a_kv_cache_that_cannot_hold_one_sequence():
    plan = plan_memory(
        load_config("models/llama3.1_70b.yaml", ["actor_rollout_ref.rollout.gpu_memory_utilization=0.2"])
    )
    assert not plan.fits
    assert any("cannot hold one 3072-token sequence" in p for p in plan.problems)


def test_optimizer_state_with_and_without_distributed_optimizer():
    plan = plan_memory(load_config("models/llama3.1_8b.yaml", []))  # TP2, DP4, distributed optimizer
    actor = next(r for r in plan.roles if r.role == "actor")
    assert actor.weights == pytest.approx(actor.params * 2)
    assert actor.grads == pytest.approx(actor.params * 4)
    assert actor.optimizer == pytest.approx(actor.params * 12 / 4)
    assert actor.optimizer_other == pytest.approx(actor.params * 12)
    no_dist = plan_memory(
        load_config(
            "models/llama3.1_8b.yaml", ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=False"]
        )
    )
    actor_nd = next(r for r in no_dist.roles if r.role == "actor")
    assert actor_nd.optimizer == pytest.approx(actor.optimizer_other)


def _actor(*overrides: str):
    plan = plan_memory(make_cfg(*overrides, validate=True))
    return next(r for r in plan.roles if r.role == "actor")


def test_activation_formula_by_hand():
    # Tiny arch: h=256, 4 heads x 64, 2 KV heads, ffn 512; bf16, TP=1, micro-batch 4, 1024 tokens.
    actor = _actor("actor_rollout_ref.actor.megatron.recompute_granularity=selective")
    tokens = 4 * 1024
    per_token_layer = 2 * (4 * 256 + 2 * 256 + 2 * 128 + 3 * 512)
    assert actor.activations == pytest.approx(4 * tokens * per_token_layer)
    # Without recompute the softmax probabilities add heads x sequence per token.
    assert actor.activations_other == pytest.approx(4 * tokens * (per_token_layer + 2 * 4 * 1024))


def test_local_attention_terms_measured_on_an_h100():
    """megatron's local (unfused) attention, as measured on an H100 (docs/gpu_h100_measure.json):
    6 bytes per score kept per layer (fp32 softmax output + bf16 copy), one bf16 buffer of a
    layer's scores, K/V repeated to every query head, silu(gate) and up + glu_linear_offset kept
    beside the SwiGLU product (the latter measured on an H200); selective recompute keeps no scores
    but recomputes one layer's softmax (12 bytes a score)."""
    local = (
        "actor_rollout_ref.actor.megatron.transformer_impl=local",
        "actor_rollout_ref.actor.megatron.attention_backend=local",
    )
    tokens, scores = 4 * 1024, 4 * 4 * 1024 * 1024  # micro-batch 4 x 1024: 4 heads x 1024 x 1024 each
    per_token_layer = 2 * (4 * 256 + 2 * 256 + 2 * 128 + 3 * 512)
    local_per_token = per_token_layer + 2 * (2 * (256 - 128) + 2 * 512)
    actor = _actor(*local)
    assert actor.activations == pytest.approx(4 * (tokens * local_per_token + 6 * scores) + 2 * scores)
    selective = 4 * tokens * local_per_token + 2 * scores + 12 * scores
    assert actor.activations_other == pytest.approx(selective)
    rows = make_cfg(*local, validate=True).actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    fwd_tokens, fwd_scores = rows * 1024, rows * 4 * 1024 * 1024
    # a forward-only pass: one layer at a time, at its softmax's peak
    assert actor.forward_activations == pytest.approx(fwd_tokens * local_per_token + (12 + 2) * fwd_scores)
    te = _actor("actor_rollout_ref.actor.megatron.transformer_impl=transformer_engine").activations
    assert te == pytest.approx(4 * (tokens * per_token_layer + 2 * scores))
    with pytest.raises(ConfigError, match="transformer_impl"):
        make_cfg("actor_rollout_ref.actor.megatron.transformer_impl=te", validate=True)


def test_sdpa_attention_keeps_no_scores_and_no_repeated_kv():
    """Local layers with torch's fused attention: the local MLP's silu(gate) and up + offset stay,
    the scores, the score buffer, the softmax peak and the K/V repeated to every query head go.
    ``attention_backend=auto`` (the default) is sdpa on GPU and local on CPU."""
    sdpa = (
        "actor_rollout_ref.actor.megatron.transformer_impl=local",
        "actor_rollout_ref.actor.megatron.attention_backend=sdpa",
    )
    tokens = 4 * 1024
    per_token_layer = 2 * (4 * 256 + 2 * 256 + 2 * 128 + 3 * 512) + 2 * 2 * 512  # + silu(gate), up + 0
    actor = _actor(*sdpa)
    assert actor.activations == pytest.approx(4 * tokens * per_token_layer)
    assert actor.activations_other == pytest.approx(4 * tokens * per_token_layer)
    rows = make_cfg(*sdpa, validate=True).actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    assert actor.forward_activations == pytest.approx(rows * 1024 * per_token_layer)
    assert _actor(sdpa[0]).activations == actor.activations  # auto on GPU
    cpu = ("trainer.device=cpu", "trainer.n_gpus_per_node=2")
    local = _actor(*cpu, sdpa[0], "actor_rollout_ref.actor.megatron.attention_backend=local").activations
    assert _actor(*cpu, sdpa[0]).activations == local != _actor(*cpu, *sdpa).activations
    # transformer-engine layers bring their own attention: the key changes nothing there
    te = "actor_rollout_ref.actor.megatron.transformer_impl=transformer_engine"
    assert _actor(te, sdpa[1]).activations == _actor(te).activations
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron.attention_backend.*flash"):
        make_cfg("actor_rollout_ref.actor.megatron.attention_backend=flash", validate=True)


def test_logits_and_their_gradients_with_chunked_loss_functions():
    from rlhf_megatron.models.forward import CHUNK_ELEMENTS
    from rlhf_megatron.planning.memory import LOSS_CHUNK_BYTES

    assert LOSS_CHUNK_BYTES == 4 * 4 * CHUNK_ELEMENTS  # the planner knows the loss functions' block
    actor = _actor()
    cfg = make_cfg(validate=True)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    share = cfg.data.max_response_length / seq
    vocab = arch_for_role(cfg, "actor")[0].vocab_size
    train = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu * seq
    fwd = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu * seq
    blocks = lambda n: min(LOSS_CHUNK_BYTES, 16 * n * share * vocab)  # noqa: E731
    # bf16 logits, the fp32 blocks and (update) one gradient of the logits' size
    assert actor.logits == pytest.approx(train * vocab * 2 + blocks(train) + train * vocab * 2)
    # forward only: the logits sequence-first and their batch-first copy, or one copy and the blocks
    assert actor.forward_logits == pytest.approx(fwd * vocab * 2 + max(fwd * vocab * 2, blocks(fwd)))
    # a forward-only pass frees each layer before the logits exist: the larger of the two counts
    assert actor.forward_phase() == pytest.approx(
        actor.with_weights() + max(actor.forward_activations, actor.forward_logits)
    )


def test_recompute_and_tensor_parallelism_shrink_activations():
    none = _actor().activations
    selective = _actor("actor_rollout_ref.actor.megatron.recompute_granularity=selective").activations
    full = _actor("actor_rollout_ref.actor.megatron.recompute_granularity=full").activations
    assert full < selective < none
    tp2 = _actor(
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.recompute_granularity=selective",
    ).activations
    assert tp2 == pytest.approx(selective / 2)  # sequence parallel splits the norm activations too


def test_first_pipeline_stage_holds_pp_microbatches_in_flight():
    selective = "actor_rollout_ref.actor.megatron.recompute_granularity=selective"
    pp1 = _actor(selective).activations
    cfg = make_cfg(selective, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2")
    arch, m = arch_for_role(cfg, "actor")[0], cfg.actor_rollout_ref.actor.megatron
    first, last = _stage_activations(arch, m, 4 * 1024, 1024, "selective", "transformer_engine")
    assert first == pytest.approx(pp1)  # half the layers x 2 micro-batches in flight
    assert last == pytest.approx(pp1 / 2)  # half the layers x 1
    m.virtual_pipeline_model_parallel_size = 2
    first_vpp, _ = _stage_activations(arch, m, 4 * 1024, 1024, "selective", "transformer_engine")
    assert first_vpp == pytest.approx(pp1 * (1 + 1 / 4))  # interleaving: x (1 + (pp - 1) / (pp * vpp))


def test_kv_cache_per_token_and_capacity():
    plan = plan_memory(load_config("models/llama3.1_70b.yaml", []))
    ro = plan.rollout
    assert ro.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # K and V, 80 layers, 8 KV heads / TP 8, bf16
    assert ro.weights == pytest.approx(count_parameters(_arch("models/llama3.1_70b.yaml")).total * 2 / 8)
    assert ro.kv_cache == pytest.approx(0.5 * 80 * GIB - ro.weights - ro.overhead)
    assert ro.sequences == int(ro.kv_cache // (ro.kv_bytes_per_token * 3072))


def test_offload_flags_take_state_out_of_other_phases():
    base = plan_memory(load_config("models/llama3.1_8b.yaml", []))
    kept = plan_memory(
        load_config(
            "models/llama3.1_8b.yaml",
            [
                "actor_rollout_ref.actor.megatron.grad_offload=False",
                "actor_rollout_ref.actor.megatron.optimizer_offload=False",
            ],
        )
    )
    gen = {p.name: p for p in base.phases}["generate"]
    gen_kept = {p.name: p for p in kept.phases}["generate"]
    actor = next(r for r in kept.roles if r.role == "actor")
    assert gen_kept.parts["actor"] - gen.parts["actor"] == pytest.approx(actor.grads + actor.optimizer)
    # During its own update everything is back on the GPU either way.
    update = {p.name: p for p in base.phases}["actor update"]
    assert update.parts["actor"] == pytest.approx(
        actor.weights + actor.grads + actor.optimizer + actor.activations + actor.logits
    )


def test_plan_needs_an_architecture():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/nonexistent",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ],
        validate=False,
    )
    with pytest.raises(ConfigError, match="cannot plan memory: no model_arch section"):
        plan_memory(cfg)


def test_docs_plan_of_llama_70b_is_current(capsys):
    """docs/plan_llama3.1_70b.txt is the CLI's output; regenerate it when the planner changes:
    rlhf-megatron plan models/llama3.1_70b > docs/plan_llama3.1_70b.txt"""
    assert cli.main(["plan", "models/llama3.1_70b"]) == 0
    current = capsys.readouterr().out
    assert (REPO / "docs" / "plan_llama3.1_70b.txt").read_text() == current


OWN_POOL = [
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=8",
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]


def test_disaggregated_plan_keeps_vllm_off_the_trainer_pool():
    colocated = plan_memory(load_config("models/llama3.1_8b.yaml", OWN_POOL[:2] + OWN_POOL[-1:]))
    plan = plan_memory(load_config("models/llama3.1_8b.yaml", OWN_POOL))
    assert plan.rollout_world == 8 and plan.world == 16 and colocated.rollout_world is None
    assert {p.pool for p in colocated.phases} == {None}
    trainer = {p.name: p for p in plan.phases if p.pool == TRAINER_POOL}
    rollout = [p for p in plan.phases if p.pool == ROLLOUT_POOL]
    assert "generate" not in trainer and all("vllm" not in p.parts for p in trainer.values())
    assert [p.name for p in rollout] == ["rollout: generate", "rollout: sync"]
    assert all(set(p.parts) <= {"vllm", "stream", "runtime"} for p in rollout)
    # Each trainer phase is its colocated twin less vLLM's idle memory.
    for p in colocated.phases:
        if p.name in trainer:
            same = {k: v for k, v in trainer[p.name].parts.items() if k != "stream"}
            assert same == {k: v for k, v in p.parts.items() if k != "vllm"}, p.name
    peaks = plan.pool_peaks()
    assert set(peaks) == {TRAINER_POOL, ROLLOUT_POOL}
    # the critic update: the actor update is smaller since its loss works in blocks of logits
    assert peaks[TRAINER_POOL].name == "critic update" and "vllm" not in peaks[TRAINER_POOL].parts
    # The rollout pool: vLLM's whole budget (weights / rollout TP inside it) and the runtime.
    arch = _arch("models/llama3.1_8b.yaml")
    assert plan.rollout.weights == count_parameters(arch).total * 2 / 2
    assert rollout[0].total == pytest.approx(plan.rollout.budget + 3 * GIB)
    assert plan.pool_world(ROLLOUT_POOL) == 8 and plan.pool_world(TRAINER_POOL) == 16


def test_plan_cli_prints_both_pools(capsys):
    assert cli.main(["plan", "models/llama3.1_8b", *OWN_POOL]) == 0
    text = capsys.readouterr().out
    assert "trainer pool 16 GPUs + rollout pool 8 GPUs (disaggregated)" in text
    assert "vLLM (TP2, on the rollout pool: 4 engines)" in text
    assert "peak, trainer pool (16 GPUs): critic update, " in text
    assert "peak, rollout pool (8 GPUs): rollout: sync, " in text
    assert text.rstrip().endswith("-> fits")
    rows = [line for line in text.splitlines() if line.startswith("rollout: ")]
    assert len({len(r) for r in rows}) == 1  # the phase column is wide enough for the pool prefix
