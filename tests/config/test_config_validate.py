"""Validation rules: each section's own rules and each cross-section rule is triggered on its own
and its message is checked. (Closed-choice values are refused by the loader: test_config_choices.py.)"""

from __future__ import annotations

import warnings

import pytest
from cfg_helpers import MOE_ARCH, VALID, make_cfg, write_hf_config
from omegaconf import OmegaConf

from rlhf_megatron.config import (
    ArchUnknownWarning,
    ConfigError,
    MegatronConfig,
    RolloutConfig,
    RunConfig,
    roles,
)
from rlhf_megatron.config.keys import schema_dataclasses
from rlhf_megatron.planning import load_config, validate_config
from rlhf_megatron.planning import validate as V

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
RC = "algorithm.rollout_correction"
# The tiny GQA model as a Qwen2.5-VL: M-RoPE sections for head_dim 64, a 2-block vision tower.
VL_ARCH = [
    "model_arch.architectures=[Qwen2_5_VLForConditionalGeneration]",
    "model_arch.model_type=qwen2_5_vl",
    "model_arch.rope_scaling.type=mrope",
    "model_arch.rope_scaling.mrope_section=[8,12,12]",
    "model_arch.vision_config.depth=2",
    "model_arch.vision_config.hidden_size=192",
    "model_arch.vision_config.intermediate_size=342",
    "model_arch.vision_config.out_hidden_size=256",
    "model_arch.vision_config.fullatt_block_indexes=[1]",
]


# section key -> (overrides on top of the valid base config, substrings its messages must contain):
# the rules each section checks itself (``<Section>.validate``, beside its fields in schema*.py).
SECTION_CASES = {
    "distillation": (
        [
            "distillation.enabled=true",
            "distillation.teacher_models.a.model_path=/t/a",
            "distillation.teacher_models.b.model_path=/t/b",
            "distillation.teacher_models.b.inference.tensor_model_parallel_size=2",
            "distillation.teacher_models.b.inference.max_num_seqs=0",
        ],
        [
            "distillation.teacher_models has 2 teachers with keys [None, None]: each needs its own key",
            "distillation.teacher_models.b.inference.tensor_model_parallel_size=2 differs from the rollout's 1",
            "distillation.teacher_models.b.inference.max_num_seqs=0 must be >= 1",
        ],
    ),
    "distillation.distillation_loss": (
        [
            "distillation.enabled=true",
            "distillation.distillation_loss.loss_mode=k1",
            "distillation.distillation_loss.use_policy_gradient=false",
            "distillation.distillation_loss.policy_loss_mode=gspo",
        ],
        [
            "distillation.distillation_loss.loss_mode=k1 with distillation.distillation_loss.use_policy_gradient="
            "false: k1's gradient is grad log p_student, which does not depend on the teacher",
            "distillation.distillation_loss.policy_loss_mode='gspo': only 'vanilla' is supported",
        ],
    ),
    "reward.judge": (
        ["reward.judge.enable=true", "reward.judge.score_pattern='Score: [0-9]+'"],
        [
            "reward.judge.model_path is required when reward.judge.enable=true",
            "reward.judge.score_pattern='Score: [0-9]+' has 0 groups; it needs exactly one",
        ],
    ),
    "actor_rollout_ref.model": (
        ["actor_rollout_ref.model.lora_rank=-1"],
        ["actor_rollout_ref.model.lora_rank=-1 must be >= 0 (0: full fine-tuning, no adapters)"],
    ),
    "data": (
        ["data.train_files=[]", "data.train_batch_size=0"],
        [
            "data.train_files=[]: expected a parquet path or a non-empty list of paths",
            "data.train_batch_size=0 must be >= 1",
        ],
    ),
    "trainer": (
        [
            "trainer.resume_mode=autp",
            "trainer.max_staleness=-1",
            "trainer.total_epochs=0",
            "trainer.max_restarts=-1",
            "trainer.restart_backoff_s=-1",
            "trainer.step_timeout_s=0",
        ],
        [
            "trainer.resume_mode='autp': use auto, disable, resume_path, or a checkpoint path containing '/'",
            "trainer.max_staleness=-1 must be an integer >= 0",
            "trainer.total_epochs=0 must be >= 1",
            "trainer.max_restarts=-1 must be >= 0 (0: a failure ends the run)",
            "trainer.restart_backoff_s=-1.0 must be >= 0",
            "trainer.step_timeout_s=0.0 must be > 0 (null: no step deadline)",
        ],
    ),
    "algorithm": (
        [
            "algorithm.adv_estimator=grpoo",
            "algorithm.kl_penalty=k9",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=seq_final_reward",
            "algorithm.use_kl_in_reward=true",
        ],
        [
            "algorithm.adv_estimator='grpoo' is not a registered estimator; known: gae, gpg, grpo, grpo_passk, "
            "grpo_vectorized, opo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo, rloo_vectorized",
            "algorithm.kl_penalty='k9' is not a KL estimator; known: kl, k1",
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the groups "
            "are filtered before the KL pass",
        ],
    ),
    "algorithm.filter_groups": (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=-1"],
        [
            "algorithm.filter_groups.metric is required when algorithm.filter_groups.enable=true: one of acc, "
            "score, seq_reward, seq_final_reward (DAPO uses acc)",
            "algorithm.filter_groups.max_num_gen_batches=-1 must be >= 0 (0: no limit)",
        ],
    ),
    "reward_model.overlong_buffer": (
        [
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.penalty_factor=-1",
        ],
        [
            "reward_model.overlong_buffer.len=0 must be >= 1 when reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.penalty_factor=-1.0 must be >= 0",
        ],
    ),
    RC: (
        [f"{RC}.rollout_is_threshold=0", f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token"],
        [
            "algorithm.rollout_correction.rollout_is_threshold=0.0 must be > 0: it caps every importance "
            "weight; set it to e.g. 2.0",
            "algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old policy, so "
            "algorithm.rollout_correction.rollout_is=token would weight every token by exp(0) = 1",
        ],
    ),
    "actor_rollout_ref": (
        ["actor_rollout_ref.hybrid_engine=false", f"{R}.nnodes=0", f"{R}.load_format=sharded"],
        [
            "actor_rollout_ref.rollout.nnodes=0 must be >= 1: the rollout's own pool "
            "(actor_rollout_ref.hybrid_engine=false)",
            "actor_rollout_ref.rollout.load_format=sharded needs the rollout in the actor's processes",
        ],
    ),
    A: (
        [
            f"{A}.strategy=fsdp",
            f"{A}.clip_ratio_c=0.5",
            f"{A}.loss_agg_mode=token-sum",
            f"{A}.kl_loss_type=lowvar",
            f"{A}.ppo_mini_batch_size=0",
        ],
        [
            "actor_rollout_ref.actor.strategy='fsdp': this project trains with Megatron only; set it to megatron",
            "actor_rollout_ref.actor.clip_ratio_c=0.5 must be > 1.0",
            "actor_rollout_ref.actor.loss_agg_mode='token-sum' is not a loss aggregation mode; known: token-mean",
            "actor_rollout_ref.actor.kl_loss_type='lowvar' is not a KL estimator",
            "actor_rollout_ref.actor.ppo_mini_batch_size=0 must be >= 1",
        ],
    ),
    f"{A}.policy_loss": (
        [f"{A}.policy_loss.loss_mode=ppo2"],
        ["actor_rollout_ref.actor.policy_loss.loss_mode='ppo2' is not a registered policy loss; known: "],
    ),
    f"{A}.megatron": (
        [
            f"{A}.megatron.tensor_model_parallel_size=0",
            f"{A}.megatron.recompute_granularity=selective",
            f"{A}.megatron.recompute_method=uniform",
        ],
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0 must be >= 1",
            "actor_rollout_ref.actor.megatron.recompute_method/recompute_num_layers apply to "
            "recompute_granularity=full only (it is selective)",
        ],
    ),
    "actor_rollout_ref.ref": (
        [
            f"{A}.use_kl_loss=True",
            "actor_rollout_ref.ref.strategy=fsdp",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=0",
        ],
        [
            "actor_rollout_ref.ref.strategy='fsdp': this project trains with Megatron only",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=0 must be >= 1 (or null)",
        ],
    ),
    R: (
        [
            f"{R}.temperature=-0.1",
            f"{R}.top_p=0",
            f"{R}.top_k=-2",
            f"{R}.gpu_memory_utilization=1.2",
            f"{R}.n=0",
        ],
        [
            "actor_rollout_ref.rollout.temperature=-0.1 must be >= 0",
            "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]",
            "actor_rollout_ref.rollout.top_k=-2 must be >= -1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=1.2 must be in (0, 1]",
            "actor_rollout_ref.rollout.n=0 must be >= 1",
        ],
    ),
    f"{R}.val_kwargs": (
        [f"{R}.val_kwargs.n=0", f"{R}.val_kwargs.top_p=1.5"],
        [
            "actor_rollout_ref.rollout.val_kwargs.n=0 must be >= 1",
            "actor_rollout_ref.rollout.val_kwargs.top_p=1.5 must be in (0, 1]",
        ],
    ),
    f"{R}.agent.openai_proxy": (
        [
            f"{R}.agent.openai_proxy.agent_cls=nowhere/agent.py:A",
            f"{R}.agent.openai_proxy.command=./my_agent",
            f"{R}.agent.openai_proxy.max_concurrent=0",
            f"{R}.agent.openai_proxy.episode_timeout_s=0",
            f"{R}.agent.openai_proxy.gather_s=-1",
            f"{R}.agent.openai_proxy.host=' '",
        ],
        [
            "actor_rollout_ref.rollout.agent.openai_proxy: give agent_cls or command, not both",
            "actor_rollout_ref.rollout.agent.openai_proxy.max_concurrent=0 must be >= 1",
            "actor_rollout_ref.rollout.agent.openai_proxy.episode_timeout_s=0.0 must be > 0 (seconds)",
            "actor_rollout_ref.rollout.agent.openai_proxy.gather_s=-1.0 must be >= 0 (seconds)",
            "actor_rollout_ref.rollout.agent.openai_proxy.host is empty; give 127.0.0.1 (the default), node",
            "agent_cls=nowhere/agent.py:A: no file nowhere/agent.py; write path/to/agent.py:ClassName",
        ],
    ),
    f"{R}.multi_turn": (
        [
            f"{R}.multi_turn.max_parallel_calls=0",
            f"{R}.multi_turn.tool_timeout_s=0",
            f"{R}.multi_turn.max_assistant_turns=-1",
        ],
        [
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0 must be >= 1",
            "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0.0 must be > 0 (seconds)",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=-1 must be >= 1 (or null)",
        ],
    ),
    "critic": (
        # the critic follows the actor's loss_agg_mode through an interpolation
        ["critic.strategy=fsdp", "critic.ppo_epochs=0", f"{A}.loss_agg_mode=token-sum"],
        [
            "critic.strategy='fsdp': this project trains with Megatron only",
            "critic.ppo_epochs=0 must be >= 1",
            "critic.loss_agg_mode='token-sum' is not a loss aggregation mode",
        ],
    ),
    "reward_model": (
        ["reward_model.micro_batch_size_per_gpu=0"],
        ["reward_model.micro_batch_size_per_gpu=0 must be >= 1 (or null)"],
    ),
}

# cross-section rule -> (overrides on top of the valid base config, substrings its message must contain)
CASES = {
    V.check_rollout_correction_engine: (
        [f"{RC}.bypass_mode=true", f"{A}.router_replay.mode=R2"],
        [
            "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass, where router_replay.mode=R2"
        ],
    ),
    V.check_dapo: (
        [
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            f"{R}.n=1",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=100000",
        ],
        [
            f"algorithm.filter_groups.enable=true drops prompts whose responses all score alike, but {R}.n=1",
            "reward_model.overlong_buffer.enable=true is applied by the dapo reward manager, but "
            "reward_model.reward_manager=naive; set reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.len=100000 is longer than data.max_response_length=",
        ],
    ),
    V.check_context_parallel_backend: (
        ["trainer.device=cpu", f"{A}.megatron.context_parallel_size=2"],
        [
            "actor_rollout_ref.actor.megatron.context_parallel_size=2: context parallelism needs "
            "transformer-engine attention, which this role does not use on CPU; set it to 1",
        ],
    ),
    V.check_rollout_placement: (
        ["trainer.rollout_mode=one_step_off"],
        [
            "trainer.rollout_mode=one_step_off overlaps generation with training, which one set of processes "
            "cannot do: set actor_rollout_ref.hybrid_engine=false",
        ],
    ),
    V.check_multi_turn: (
        [f"{R}.multi_turn.enable=true", "trainer.partial_rollout=true", f"{A}.router_replay.mode=R3"],
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true needs data.return_raw_chat=true",
            "actor_rollout_ref.rollout.multi_turn.enable=true cannot be combined with trainer.partial_rollout=true",
            "cannot replay vLLM's routes (actor_rollout_ref.actor.router_replay.mode=R3)",
        ],
    ),
    V.check_openai_proxy: (
        [
            f"{R}.agent.openai_proxy.agent_cls=my_pkg.Agent",
            f"{R}.name=hf",
            "trainer.partial_rollout=true",
            "algorithm.filter_groups.enable=true",
        ],
        [
            "actor_rollout_ref.rollout.agent.openai_proxy needs actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.agent.openai_proxy needs data.return_raw_chat=true",
            "cannot be combined with trainer.partial_rollout=true (each needs one response per sample)",
            "cannot be combined with algorithm.filter_groups.enable=true",
        ],
    ),
    V.check_group_estimator_n: (
        ["algorithm.adv_estimator=grpo", f"{R}.n=1"],
        [
            "algorithm.adv_estimator=grpo compares responses to the same prompt, but actor_rollout_ref.rollout.n=1; "
            "set actor_rollout_ref.rollout.n to 2 or more"
        ],
    ),
    # Needs a checkpoint on disk: the overrides are built from tmp_path.
    V.check_model_arch_matches_checkpoint: (
        lambda tmp: [f"actor_rollout_ref.model.path={write_hf_config(tmp / 'm', num_hidden_layers=4)}"],
        [
            "model_arch gives hidden_size=256 but ",
            "/m/config.json has 2048; correct model_arch (it takes config.json's keys) or remove the section",
            "model_arch gives vocab_size=384 but ",
        ],
    ),
    V.check_tp_divides_heads: (
        [f"{A}.megatron.tensor_model_parallel_size=4"],
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 must divide num_attention_heads=4 and "
            "num_key_value_heads=2 (model_arch); use one of: 1, 2"
        ],
    ),
    V.check_layers_divisible_by_pp: (
        [
            f"{A}.megatron.pipeline_model_parallel_size=2",
            f"{A}.megatron.virtual_pipeline_model_parallel_size=4",
        ],
        [
            "num_layers=4 (model_arch) is not divisible by actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"
            " x virtual_pipeline_model_parallel_size=4"
        ],
    ),
    V.check_world_divisible: (
        ["trainer.n_gpus_per_node=6", f"{A}.megatron.pipeline_model_parallel_size=4"],
        [
            "world size 6 (trainer.nnodes x trainer.n_gpus_per_node) is not divisible by "
            "actor_rollout_ref.actor.megatron TP x PP x CP = 1 x 4 x 1 = 4"
        ],
    ),
    V.check_mini_batch_divides_train_batch: (
        [f"{A}.ppo_mini_batch_size=100", "critic.ppo_mini_batch_size=256"],
        [
            "data.train_batch_size x rollout.n = 1024 x 1 is not a multiple of "
            "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 100 x 1"
        ],
    ),
    V.check_batch_divisible_by_dp: (
        ["data.train_batch_size=36", f"{A}.ppo_mini_batch_size=12", "critic.ppo_mini_batch_size=12"],
        [
            "data.train_batch_size x rollout.n = 36 x 1 = 36 responses cannot be split evenly over the actor's 8 "
            "data-parallel ranks; make it a multiple of 8",
            "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = 12 x 1 = 12 responses cannot be split evenly",
        ],
    ),
    V.check_micro_batch_sizes: (
        [
            f"{A}.ppo_micro_batch_size_per_gpu=null",
            f"{A}.ppo_micro_batch_size=12",
            f"{R}.log_prob_micro_batch_size=64",
            f"{R}.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=null",
        ],
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=12 is not divisible by the actor's data-parallel size 8; "
            "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu instead, or a multiple of 8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=64 (= 8 per GPU at DP=8) contradicts "
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4; set only one of them",
            "set critic.ppo_micro_batch_size_per_gpu (or critic.ppo_micro_batch_size), or turn on critic.use_dynamic_bsz",
        ],
    ),
    V.check_mini_batch_divisible_by_micro: (
        [f"{A}.ppo_micro_batch_size_per_gpu=24"],
        [
            "actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n / DP = 256 x 1 / 8 = 32 responses per rank is not "
            "a multiple of the micro-batch actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24"
        ],
    ),
    V.check_dynamic_bsz_token_budget: (
        [f"{A}.use_dynamic_bsz=True", f"{A}.ppo_max_token_len_per_gpu=512", "critic.use_dynamic_bsz=False"],
        [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512 is shorter than one sequence "
            "(max_prompt_length + max_response_length = 1024); raise it to at least 1024"
        ],
    ),
    V.check_rollout_tp: (
        [f"{R}.tensor_model_parallel_size=3"],
        [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide the world size 8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide num_attention_heads=4 (model_arch)",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3 and num_key_value_heads=2 (model_arch) must "
            "divide one another",
        ],
    ),
    V.check_sequence_fits_positions: (
        ["data.max_prompt_length=1024", "data.max_response_length=1500", f"{R}.max_model_len=2000"],
        [
            "data.max_prompt_length + data.max_response_length = 1024 + 1500 = 2524 exceeds "
            "max_position_embeddings=2048 (model_arch); shorten them",
            "actor_rollout_ref.rollout.max_model_len=2000 is shorter than max_prompt_length + max_response_length",
        ],
    ),
    V.check_vision_tp_divides_heads: (
        [
            *VL_ARCH,
            "model_arch.vision_config.num_heads=3",
            f"{A}.megatron.tensor_model_parallel_size=2",
            f"{R}.tensor_model_parallel_size=2",
        ],
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 must divide the vision tower's "
            "vision_config.num_heads=3 (model_arch); use one of: 1, 3",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2 must divide the vision tower's "
            "vision_config.num_heads=3 (model_arch)",
        ],
    ),
    V.check_vision_language_options: (
        [
            *VL_ARCH,
            "model_arch.vision_config.num_heads=4",
            f"{A}.megatron.context_parallel_size=2",
            f"{R}.load_format=sharded",
            "data.max_pixels=1003520",
            "data.max_prompt_length=1024",
        ],
        [
            "actor_rollout_ref.actor.megatron.context_parallel_size=2: context parallelism is not supported for "
            "the vision-language Qwen2_5_VLForConditionalGeneration (model_arch); set it to 1",
            "actor_rollout_ref.rollout.load_format=sharded is not supported for the vision-language",
            "data.max_pixels=1003520 lets one image take 1280 prompt tokens (784 pixels each), more than "
            "data.max_prompt_length=1024; lower max_pixels (e.g. 401408) or raise max_prompt_length",
        ],
    ),
    # Mixture-of-experts layouts (tests/config/test_config_moe.py covers each message).
    V.check_expert_parallel: (
        [*MOE_ARCH, f"{A}.megatron.expert_model_parallel_size=4"],
        [
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4 must divide the 6 experts (model_arch)"
        ],
    ),
    V.check_moe_training_layout: (
        [*MOE_ARCH, f"{A}.megatron.tensor_model_parallel_size=2", f"{A}.megatron.sequence_parallel=false"],
        ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 trains the mixture-of-experts"],
    ),
    V.check_lora: (
        [
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.target_modules=[qkv_proj]",
            f"{A}.megatron.transformer_impl=transformer_engine",
        ],
        [
            "actor_rollout_ref.model.target_modules names ['qkv_proj'], which LlamaForCausalLM does not have",
            "actor_rollout_ref.model.lora_rank=8 adapts megatron's local layers; set "
            "actor_rollout_ref.actor.megatron.transformer_impl=local",
        ],
    ),
    V.check_expert_bias_update: (
        [f"{A}.megatron.moe_router_bias_update=true"],
        [
            "actor_rollout_ref.actor.megatron.moe_router_bias_update=true updates the routers' expert bias, "
            "but the LlamaForCausalLM of"
        ],
    ),
    V.check_router_replay: (
        [f"{A}.router_replay.mode=R2"],
        [
            "actor_rollout_ref.actor.router_replay.mode=R2 replays mixture-of-experts routing; this model has no experts"
        ],
    ),
}


def _errors(*overrides: str) -> list[str]:
    """What loading (closed-choice values) and then validating the config reports."""
    try:
        validate_config(make_cfg(*overrides))
    except ConfigError as exc:
        return exc.errors
    return []


def test_every_rule_has_a_case():
    assert set(CASES) == set(V.RULES)


def test_the_base_config_is_valid():
    assert _errors() == []


@pytest.mark.parametrize("rule", list(CASES), ids=lambda r: r.__name__)
def test_rule_reports_its_problem(rule, tmp_path):
    overrides, expected = CASES[rule]
    if callable(overrides):
        overrides = overrides(tmp_path)
    cfg = make_cfg(*overrides)
    direct = rule(V.build_context(cfg))
    for text in expected:
        assert any(text in message for message in direct), f"{text!r} not in {direct}"
    # validate_config reports the same messages in its one ConfigError.
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    for text in expected:
        assert any(text in message for message in err.value.errors)


def test_every_section_rule_has_a_case():
    run = OmegaConf.to_object(make_cfg())
    with_rules = {cls for cls in schema_dataclasses() if "validate" in vars(cls) and cls is not RunConfig}
    assert {type(roles.at(run, key)) for key in SECTION_CASES} == with_rules


@pytest.mark.parametrize("key", list(SECTION_CASES))
def test_section_reports_its_problems(key):
    overrides, expected = SECTION_CASES[key]
    cfg = make_cfg(*overrides)
    direct = roles.at(OmegaConf.to_object(cfg), key).validate(key)
    for text in expected:
        assert any(text in message for message in direct), f"{text!r} not in {direct}"
    # validate_config reports the same messages in its one ConfigError.
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    for text in expected:
        assert any(text in message for message in err.value.errors), f"{text!r} not in {err.value.errors}"


def test_a_section_checks_itself_without_a_loaded_config():
    # The rules read the dataclass, so a section built in code is checked the same way, and its
    # messages name the section's place in the config.
    assert RolloutConfig(temperature=-1.0, top_k=-3).validate() == [
        "actor_rollout_ref.rollout.temperature=-1.0 must be >= 0",
        "actor_rollout_ref.rollout.top_k=-3 must be >= -1 (-1 disables top-k)",
    ]
    assert MegatronConfig(recompute_method="block").validate("critic.megatron") == [
        "critic.megatron.recompute_method/recompute_num_layers apply to recompute_granularity=full only "
        "(it is None); set them to null or use full"
    ]
    assert MegatronConfig().validate("critic.megatron") == []


def test_inactive_roles_keep_their_strategy_and_layout_unchecked():
    run = OmegaConf.to_object(make_cfg("critic.strategy=fsdp", "critic.megatron.context_parallel_size=0"))
    assert run.critic.validate(built=False) == []
    assert [m.split(":")[0] for m in run.critic.validate()] == [
        "critic.strategy='fsdp'",
        "critic.megatron.context_parallel_size=0 must be >= 1",
    ]


def test_all_violations_come_in_one_error():
    overrides = (f"{R}.temperature=-1", "algorithm.adv_estimator=nope", f"{A}.clip_ratio_c=0.5")
    errors = _errors(*overrides)
    assert len(errors) == 3
    with pytest.raises(ConfigError, match=r"invalid config \(3 problems\)"):
        validate_config(make_cfg(*overrides))


def test_size_rules_are_skipped_when_sizes_are_invalid():
    # TP=0 would otherwise divide by zero in the layout rules; only the range errors are
    # reported (the critic follows the actor's TP through an interpolation).
    errors = _errors(f"{A}.megatron.tensor_model_parallel_size=0")
    assert errors == [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0 must be >= 1",
        "critic.megatron.tensor_model_parallel_size=0 must be >= 1",
    ]


def test_world_size_argument_overrides_the_trainer_shape():
    cfg = make_cfg(f"{A}.megatron.pipeline_model_parallel_size=4")  # DP 2 at world 8
    validate_config(cfg)
    with pytest.raises(ConfigError, match="world size 6"):
        validate_config(cfg, world_size=6)


def test_group_estimators_are_fine_with_n_at_least_2():
    assert _errors("algorithm.adv_estimator=rloo", f"{R}.n=4", f"{A}.use_kl_loss=False") == []


def test_reference_rules_apply_only_when_a_kl_term_needs_it():
    # The reference has no micro-batch set: fine without KL, an error with use_kl_loss.
    assert _errors() == []
    errors = _errors(f"{A}.use_kl_loss=True")
    assert errors == [
        "set actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu (or "
        "actor_rollout_ref.ref.log_prob_micro_batch_size), or turn on actor_rollout_ref.ref.log_prob_use_dynamic_bsz"
    ]


def test_critic_rules_apply_only_with_gae():
    assert (
        _errors("critic.ppo_micro_batch_size_per_gpu=null", "algorithm.adv_estimator=grpo", f"{R}.n=2") == []
    )


def test_kv_heads_below_rollout_tp_are_replicated_not_an_error():
    assert _errors(f"{R}.tensor_model_parallel_size=4") == []


def test_architecture_from_config_json_when_no_model_arch(tmp_path):
    model = write_hf_config(tmp_path / "m", max_position_embeddings=1000)
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        ],
        validate=False,
    )
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    text = str(err.value)
    assert f"({model}/config.json)" in text
    assert "max_position_embeddings=1000" in text
    assert "tensor_model_parallel_size=4 must divide num_attention_heads=16 and num_key_value_heads=2" in text


def test_unknown_architecture_warns_and_skips_arch_rules():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/nonexistent/model",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",
        ],
        validate=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_config(cfg)
    arch_warnings = [w for w in caught if issubclass(w.category, ArchUnknownWarning)]
    assert len(arch_warnings) == 1
    assert "no model_arch section and no config.json under /nonexistent/model" in str(
        arch_warnings[0].message
    )


def test_strategy_of_an_inactive_role_is_not_checked():
    # verl's FSDP yaml sets reward_model.strategy=fsdp; with the reward model off it is harmless.
    assert _errors("reward_model.strategy=fsdp") == []
    with pytest.warns(ArchUnknownWarning):  # the reward model's checkpoint is not on this machine
        errors = _errors("reward_model.strategy=fsdp", "reward_model.enable=True")
    assert "reward_model.strategy='fsdp': this project trains with Megatron only" in errors[0]


def test_data_files_may_be_a_list():
    assert _errors("data.train_files=['a.parquet','b.parquet']") == []


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_rollout_correction_is_valid_with_either_engine(level, engine):
    assert _errors(f"{RC}.rollout_is={level}", f"{RC}.rollout_is_threshold=5", f"{R}.name={engine}") == []
    cfg = load_config(None, [*VALID, f"{RC}.rollout_is={level}", f"{RC}.rollout_is_batch_normalize=true"])
    corr = cfg.algorithm.rollout_correction
    assert (corr.rollout_is, corr.rollout_is_threshold, corr.rollout_is_batch_normalize) == (level, 2.0, True)


def _with_engine(engine: str, *overrides: str) -> V.ValidationContext:
    """A context whose rollout engine is ``engine``: every engine the schema accepts (vllm, hf)
    returns log-probs, so one that does not can only be written into the typed config."""
    ctx = V.build_context(make_cfg(*overrides))
    ctx.run.actor_rollout_ref.rollout.name = engine
    return ctx


def test_rollout_correction_needs_an_engine_that_returns_log_probs():
    errors = V.check_rollout_correction_engine(_with_engine("sglang", f"{RC}.rollout_is=token"))
    assert any(
        "algorithm.rollout_correction.rollout_is=token weights tokens by the rollout engine's log-probs, "
        "which actor_rollout_ref.rollout.name='sglang' does not return; use one of: vllm, hf, or set "
        "algorithm.rollout_correction.rollout_is=null" in e
        for e in errors
    ), errors
    # Off, the engine does not matter to this rule; the loader refuses an unknown engine anyway.
    assert V.check_rollout_correction_engine(_with_engine("sglang")) == []
    # verl's multi-turn scripts set sglang: the refusal names the engine to use instead.
    assert _errors(f"{R}.name=sglang") == [
        "actor_rollout_ref.rollout.name='sglang' is not one of: vllm, hf (command line); sglang is not an engine "
        "of this project: set actor_rollout_ref.rollout.name=vllm (multi-turn tool rollouts run on vLLM too)"
    ]


def test_rollout_correction_section_loads_from_a_preset_and_suggests_misspelled_keys(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(
        "algorithm:\n  rollout_correction:\n    rollout_is: sequence\n    rollout_is_threshold: 3\n"
    )
    corr = load_config(preset, VALID).algorithm.rollout_correction
    assert (corr.rollout_is, corr.rollout_is_threshold) == ("sequence", 3.0)
    with pytest.raises(ConfigError, match=f"did you mean '{RC}.rollout_is_threshold'"):
        make_cfg(f"{RC}.rollout_is_treshold=3")
    with pytest.raises(ConfigError, match=f"{RC}.rollout_is_batch_normalize='maybe'"):
        make_cfg(f"{RC}.rollout_is_batch_normalize=maybe")


def test_model_arch_that_matches_the_checkpoint_passes(tmp_path):
    model = write_hf_config(
        tmp_path / "m",
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=384,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
    )
    assert _errors(f"actor_rollout_ref.model.path={model}") == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.device=cpu", f"{A}.router_replay.mode=R3"], "captures only on GPU"),
        (
            [f"{A}.router_replay.mode=R2", f"{A}.megatron.recompute_granularity=full"],
            "recompute_granularity=full",
        ),
        ([f"{A}.router_replay.mode=R2", f"{A}.megatron.context_parallel_size=2"], "context_parallel_size=2"),
        ([f"{A}.router_replay.mode=R4"], "router_replay.mode"),
    ],
)
def test_router_replay_is_refused_where_it_cannot_work(overrides, expected):
    errors = _errors(*MOE_ARCH, *overrides)
    assert any(expected in e for e in errors), errors


def test_router_replay_r2_on_a_moe_model_is_valid():
    assert (
        _errors(
            *MOE_ARCH,
            f"{A}.router_replay.mode=R2",
            "trainer.device=cpu",
            "actor_rollout_ref.rollout.load_format=sharded",
        )
        == []
    )


@pytest.mark.parametrize(
    "extra, mode",
    [
        ([], "R2"),
        (["trainer.device=cuda"], "R3"),
        (["trainer.device=cuda", "actor_rollout_ref.rollout.name=hf"], "R2"),
    ],
)
def test_router_replay_true_picks_vllm_routes_where_vllm_reports_them(extra, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tiny model on disk: model_arch only
        cfg = load_config("quickstart_moe_cpu", ["actor_rollout_ref.actor.router_replay=true", *extra])
        assert cfg.actor_rollout_ref.actor.router_replay.mode == mode
        off = load_config("quickstart_moe_cpu", ["actor_rollout_ref.actor.router_replay=false"])
        assert off.actor_rollout_ref.actor.router_replay.mode == "disabled"


DISAGGREGATED = (
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=2",
)


def test_a_disaggregated_async_run_is_valid():
    assert _errors(*DISAGGREGATED, "trainer.rollout_mode=async", "trainer.max_staleness=2") == []
    assert _errors(*DISAGGREGATED, "trainer.rollout_mode=one_step_off") == []


def test_disaggregated_rollout_pool_problems_are_named():
    errors = _errors(
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.n_gpus_per_node=3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.load_format=sharded",
        "trainer.rollout_mode=async",
        "trainer.max_staleness=0",
    )
    text = "\n".join(errors)
    assert "does not divide the rollout pool's 3 processes" in text
    assert "load_format=sharded needs the rollout in the actor's processes" in text
    assert "trainer.rollout_mode=async with trainer.max_staleness=0 never generates ahead" in text
    assert "actor_rollout_ref.rollout.nnodes=0 must be >= 1" in "\n".join(
        _errors(*DISAGGREGATED, "actor_rollout_ref.rollout.nnodes=0")
    )


def test_rollout_mode_is_a_choice():
    assert any(
        "trainer.rollout_mode='fast' is not one of: sync, one_step_off, async" in e
        for e in _errors("trainer.rollout_mode=fast")
    )


def test_rollout_tp_is_checked_against_the_rollout_pool_when_disaggregated():
    wide = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert any("does not divide the world size 2" in e for e in _errors(*wide))
    pool = ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=4")
    assert _errors(*wide, *pool) == []
    assert roles.rollout_world_size(make_cfg(*wide, *pool)) == 4
    assert roles.rollout_world_size(make_cfg(*wide)) == roles.world_size(make_cfg(*wide)) == 2
    # Teachers in the trainer's processes run at the rollout's TP, so it must divide the trainer too.
    teachers = ("distillation.enabled=true", "distillation.teacher_model.model_path=/t")
    assert [e for e in _errors(*wide, *pool, *teachers) if "tensor_model_parallel_size" in e] == [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4 does not divide the trainer's 2 processes, "
        "where the teachers run at the rollout's TP (distillation.teacher_model.enable_resource_pool=false); "
        "choose a divisor of 2, or give the teachers a pool of their own"
    ]
    pooled = (
        f"distillation.teacher_model.{k}"
        for k in ("enable_resource_pool=true", "n_gpus_per_node=4", "nnodes=1")
    )
    assert _errors(*wide, *pool, *teachers, *pooled) == []


def test_disaggregated_rollout_pool_needs_gpus_per_node():
    errors = _errors(*DISAGGREGATED, "actor_rollout_ref.rollout.n_gpus_per_node=0")
    assert any(
        e.startswith("actor_rollout_ref.rollout.n_gpus_per_node=0 must be >= 1: the rollout's own pool")
        for e in errors
    )


def test_partial_rollout_needs_an_overlapping_mode_and_a_vllm_rollout():
    assert _errors(*DISAGGREGATED, "trainer.rollout_mode=async", "trainer.partial_rollout=true") == []
    text = "\n".join(_errors("trainer.partial_rollout=true"))
    assert (
        "trainer.partial_rollout=true interrupts generations that run beside training, but "
        "trainer.rollout_mode=sync generates only between updates" in text
    )
    text = "\n".join(
        _errors(
            *DISAGGREGATED,
            "trainer.rollout_mode=one_step_off",
            "trainer.partial_rollout=true",
            "actor_rollout_ref.rollout.name=hf",
        )
    )
    assert "trainer.partial_rollout=true needs actor_rollout_ref.rollout.name=vllm" in text


def test_bypass_mode_is_valid_alone_and_refuses_what_it_makes_meaningless():
    assert _errors(f"{RC}.bypass_mode=true") == []
    errors = _errors(f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token")
    assert any(
        "algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old policy, so "
        "algorithm.rollout_correction.rollout_is=token would weight every token by exp(0) = 1" in e
        for e in errors
    ), errors
    errors = V.check_rollout_correction_engine(_with_engine("sglang", f"{RC}.bypass_mode=true"))
    assert any(
        "bypass_mode=true needs the rollout engine's log-probs, which actor_rollout_ref.rollout.name='sglang'"
        in e
        for e in errors
    ), errors
    errors = _errors(f"{RC}.bypass_mode=true", f"{A}.router_replay.mode=R2")
    assert any("skips the old-log-prob pass, where router_replay.mode=R2 records" in e for e in errors), (
        errors
    )


def test_shared_prompt_packing_defaults_on_for_cpu_only():
    def packing(*overrides):
        cfg = load_config(None, [*VALID, *overrides])  # normalised, as every run is
        return cfg.actor_rollout_ref.model.shared_prompt_packing, cfg.critic.model.shared_prompt_packing

    assert packing("trainer.device=cpu") == (True, True)
    assert packing("trainer.device=cuda") == (False, False)
    assert packing("trainer.device=cuda", "actor_rollout_ref.model.shared_prompt_packing=true") == (
        True,
        False,
    )
    assert packing("trainer.device=cpu", "critic.model.shared_prompt_packing=false") == (True, False)


def test_gen_batch_size_without_dynamic_sampling_is_refused_not_ignored():
    with pytest.raises(ConfigError) as err:
        validate_config(make_cfg("data.gen_batch_size=96"))
    assert any(
        "data.gen_batch_size=96 sets the prompts of each dynamic-sampling round, but "
        "algorithm.filter_groups.enable=false: nothing would use it" in e
        for e in err.value.errors
    ), err.value.errors
    train = OmegaConf.to_object(make_cfg()).data.train_batch_size
    validate_config(make_cfg(f"data.gen_batch_size={train}"))  # the same size changes nothing
