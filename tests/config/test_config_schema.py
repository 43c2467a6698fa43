"""The schema: every field documented, verl's key names and defaults, structured typing."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rlhf_megatron.config import RunConfig, field_docs, schema_keys
from rlhf_megatron.config.keys import IGNORED_KEYS, RENAMED_KEYS, schema_dataclasses
from rlhf_megatron.config.schema_roles import CriticModelConfig
from rlhf_megatron.planning import load_config


def test_every_field_of_every_section_has_a_docstring():
    classes = schema_dataclasses()
    assert len(classes) >= 20
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in classes
        for f in dataclasses.fields(cls)
        if not field_docs(cls).get(f.name, "").strip()
    ]
    assert missing == []


def test_every_schema_class_has_a_class_docstring():
    assert [c.__name__ for c in schema_dataclasses() if not (c.__doc__ or "").strip()] == []


def test_field_docs_follow_inheritance_and_overrides():
    docs = field_docs(CriticModelConfig)
    # inherited from ModelConfig
    assert "packing sequences without padding" in docs["use_remove_padding"]
    # redefined in CriticModelConfig
    assert "Defaults to the actor's model" in docs["path"]


def test_schema_keys_cover_the_verl_key_names_the_spec_lists():
    keys = schema_keys()
    expected = [
        "data.train_files",
        "data.val_files",
        "data.prompt_key",
        "data.reward_fn_key",
        "data.max_prompt_length",
        "data.max_response_length",
        "data.train_batch_size",
        "data.val_batch_size",
        "data.return_raw_input_ids",
        "data.return_raw_chat",
        "data.shuffle",
        "data.seed",
        "data.filter_overlong_prompts",
        "data.truncation",
        "data.dataloader_num_workers",
        "actor_rollout_ref.model.path",
        "actor_rollout_ref.model.tokenizer_path",
        "actor_rollout_ref.model.override_config",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.model.trust_remote_code",
        "actor_rollout_ref.model.external_lib",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.clip_ratio",
        "actor_rollout_ref.actor.clip_ratio_low",
        "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.actor.clip_ratio_c",
        "actor_rollout_ref.actor.entropy_coeff",
        "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.kl_loss_coef",
        "actor_rollout_ref.actor.kl_loss_type",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.shuffle",
        "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.optim.min_lr_ratio",
        "actor_rollout_ref.actor.optim.warmup_style",
        "actor_rollout_ref.actor.optim.weight_decay",
        "actor_rollout_ref.actor.optim.betas",
        "actor_rollout_ref.actor.optim.total_training_steps",
        "actor_rollout_ref.actor.optim.clip_grad",
        "actor_rollout_ref.actor.checkpoint.contents",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.mode",
        "actor_rollout_ref.rollout.temperature",
        "actor_rollout_ref.rollout.top_k",
        "actor_rollout_ref.rollout.top_p",
        "actor_rollout_ref.rollout.do_sample",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.ignore_eos",
        "actor_rollout_ref.rollout.response_length",
        "actor_rollout_ref.rollout.prompt_length",
        "actor_rollout_ref.rollout.dtype",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.enforce_eager",
        "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.enable_sleep_mode",
        "actor_rollout_ref.rollout.load_format",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "actor_rollout_ref.rollout.val_kwargs.top_k",
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "actor_rollout_ref.rollout.val_kwargs.n",
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "critic.model.path",
        "critic.optim.lr",
        "critic.ppo_mini_batch_size",
        "critic.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.ppo_epochs",
        "critic.cliprange_value",
        "critic.loss_agg_mode",
        "reward_model.enable",
        "reward_model.model.path",
        "reward_model.model.input_tokenizer",
        "reward_model.micro_batch_size",
        "reward_model.micro_batch_size_per_gpu",
        "reward_model.max_length",
        "custom_reward_function.path",
        "custom_reward_function.name",
        "reward.on_error",
        "reward.timeout_s",
        "reward.num_workers",
        "algorithm.gamma",
        "algorithm.lam",
        "algorithm.adv_estimator",
        "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.use_kl_in_reward",
        "algorithm.kl_penalty",
        "algorithm.kl_ctrl.type",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_ctrl.horizon",
        "algorithm.kl_ctrl.target_kl",
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_is_threshold",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "trainer.total_epochs",
        "trainer.total_training_steps",
        "trainer.project_name",
        "trainer.experiment_name",
        "trainer.logger",
        "trainer.val_before_train",
        "trainer.val_only",
        "trainer.test_freq",
        "trainer.save_freq",
        "trainer.resume_mode",
        "trainer.default_local_dir",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "trainer.critic_warmup",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.max_critic_ckpt_to_keep",
        "trainer.log_val_generations",
        "trainer.seed",
        "trainer.device",
        "model_arch",
    ]
    megatron = [
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "sequence_parallel",
        "use_distributed_optimizer",
        "param_offload",
        "grad_offload",
        "optimizer_offload",
        "seed",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
    ]
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"):
        expected += [f"{role}.megatron.{k}" for k in megatron]
    assert [k for k in expected if k not in keys] == []


def test_defaults_are_verls():
    cfg = OmegaConf.structured(RunConfig)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.ppo_mini_batch_size, actor.clip_ratio, actor.clip_ratio_c) == (256, 0.2, 3.0)
    assert (actor.kl_loss_coef, actor.kl_loss_type, actor.loss_agg_mode) == (
        0.001,
        "low_var_kl",
        "token-mean",
    )
    assert (actor.optim.lr, actor.optim.weight_decay, actor.optim.warmup_style) == (1e-6, 0.01, "constant")
    assert actor.megatron.use_distributed_optimizer is True
    assert cfg.actor_rollout_ref.ref.megatron.use_distributed_optimizer is False
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.name, rollout.temperature, rollout.top_k, rollout.top_p, rollout.n) == (
        "vllm",
        1.0,
        -1,
        1.0,
        1,
    )
    assert (rollout.gpu_memory_utilization, rollout.max_num_batched_tokens, rollout.max_num_seqs) == (
        0.5,
        8192,
        1024,
    )
    assert (rollout.val_kwargs.temperature, rollout.val_kwargs.do_sample) == (0.0, False)
    assert (cfg.critic.optim.lr, cfg.critic.cliprange_value) == (1e-5, 0.5)
    algo = cfg.algorithm
    assert (algo.gamma, algo.lam, algo.adv_estimator, algo.kl_penalty) == (1.0, 1.0, "gae", "kl")
    assert (algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.horizon, algo.kl_ctrl.target_kl) == (
        "fixed",
        0.001,
        10000,
        0.1,
    )
    corr = algo.rollout_correction
    assert (corr.rollout_is, corr.rollout_is_threshold, corr.rollout_is_batch_normalize) == (None, 2.0, False)
    assert (cfg.data.max_prompt_length, cfg.data.train_batch_size, cfg.data.truncation) == (
        512,
        1024,
        "error",
    )
    assert (cfg.trainer.total_epochs, cfg.trainer.n_gpus_per_node, cfg.trainer.resume_mode) == (30, 8, "auto")
    assert cfg.custom_reward_function.name == "compute_score"
    assert cfg.model_arch is None


def test_interpolated_defaults_follow_their_source():
    cfg = load_config(
        None,
        [
            "data.max_response_length=300",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.model.path=/m",
        ],
        validate=False,
    )
    assert cfg.actor_rollout_ref.rollout.response_length == 300
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert cfg.critic.megatron.tensor_model_parallel_size == 2
    assert cfg.critic.model.path == "/m"
    assert cfg.critic.ppo_mini_batch_size == 256


def test_structured_config_rejects_wrong_types_and_unknown_attributes():
    cfg = OmegaConf.structured(RunConfig)
    with pytest.raises(ValidationError):
        cfg.data.train_batch_size = "many"
    with pytest.raises(Exception, match="not_a_key"):
        cfg.data.not_a_key = 1


def test_ignored_and_renamed_keys_do_not_shadow_schema_keys():
    keys = schema_keys()
    assert [e.pattern for e in IGNORED_KEYS if e.pattern in keys] == []
    assert [old for old in RENAMED_KEYS if old in keys] == []
    assert [new for new in RENAMED_KEYS.values() if new not in keys] == []
