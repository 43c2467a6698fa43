"""EasyR1's dialect: seed 003's config.yaml and command line load unchanged, in this project's keys."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from rlhf_megatron import train
from rlhf_megatron.config import ConfigError, IgnoredKeysWarning
from rlhf_megatron.planning import load_config

SEED_CONFIG = Path(__file__).parent / "data" / "easyr1_seed003_config.yaml"
SYSTEM_PROMPT = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer.\n"
    " The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
# Seed 003's command line (section 3.1), local paths in place of the hub names.
SEED_COMMAND = [
    f"config={SEED_CONFIG}",
    "data.train_files=/data/geometry3k@train",
    "data.val_files=/data/geometry3k@test",
    f"data.system_prompt={SYSTEM_PROMPT}",
    "worker.actor.model.model_path=/models/Qwen2.5-VL-3B-Instruct",
    "worker.rollout.tensor_parallel_size=1",
    "trainer.experiment_name=qwen2_5_vl_3b_geo_grpo",
    "trainer.n_gpus_per_node=8",
]
# Keys of the seed's file that only EasyR1's FSDP workers use.
FSDP_KEYS = {
    "worker.actor.padding_free",
    "worker.actor.ulysses_sequence_parallel_size",
    "worker.actor.optim.strategy",
    "worker.actor.fsdp.enable_full_shard",
    "worker.actor.fsdp.enable_cpu_offload",
    "worker.actor.fsdp.enable_rank0_init",
    "worker.actor.offload.offload_params",
    "worker.actor.offload.offload_optimizer",
    "worker.ref.fsdp.enable_full_shard",
    "worker.ref.fsdp.enable_cpu_offload",
    "worker.ref.fsdp.enable_rank0_init",
    "worker.ref.offload.offload_params",
}


def _load(*extra: str, validate: bool = False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, [*SEED_COMMAND, *extra], validate=validate)
    return cfg, caught


def test_seed_003_file_and_command_map_onto_the_schema():
    cfg, _ = _load()
    arc, a, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (cfg.data.train_files, cfg.data.val_files) == ("/data/geometry3k@train", "/data/geometry3k@test")
    assert (cfg.data.prompt_key, cfg.data.answer_key, cfg.data.image_key) == ("problem", "answer", "images")
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 2096)
    assert (cfg.data.train_batch_size, cfg.data.val_batch_size) == (256, None)  # rollout_batch_size; -1 = all
    # the value is YAML-parsed, as EasyR1's OmegaConf.from_cli parses it: the line break folds into a space
    folded = SYSTEM_PROMPT.replace("\n ", " ")
    assert (cfg.data.max_pixels, cfg.data.min_pixels, cfg.data.system_prompt) == (2097152, 262144, folded)
    assert cfg.algorithm.adv_estimator == "grpo"
    # use_kl_loss: the KL is an actor loss term, not a reward penalty
    assert (a.use_kl_loss, a.kl_loss_type, a.kl_loss_coef) == (True, "low_var_kl", 0.01)
    assert cfg.algorithm.use_kl_in_reward is False
    # EasyR1's global_batch_size counts prompts, like verl's ppo_mini_batch_size
    assert (a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.optim.clip_grad) == (64, 2, 1.0)
    assert r.log_prob_micro_batch_size_per_gpu == arc.ref.log_prob_micro_batch_size_per_gpu == 8
    assert (a.optim.lr, a.optim.weight_decay, a.optim.lr_warmup_steps_ratio) == (1e-6, 0.01, 0.0)
    assert (arc.model.path, arc.model.enable_gradient_checkpointing) == (
        "/models/Qwen2.5-VL-3B-Instruct",
        True,
    )
    assert (arc.model.trust_remote_code, arc.model.freeze_vision_tower) == (False, False)
    assert (r.n, r.temperature, r.gpu_memory_utilization, r.enforce_eager) == (6, 1.0, 0.7, False)
    assert (r.tensor_model_parallel_size, r.limit_images, r.enable_chunked_prefill) == (1, 1, False)
    # validation: the rollout's sampling with val_override_config on top (temperature 0.2, n 1)
    assert (r.val_kwargs.temperature, r.val_kwargs.n, r.val_kwargs.do_sample) == (0.2, 1, True)
    assert cfg.reward.score_fn == "math"
    t = cfg.trainer
    assert (t.total_epochs, t.test_freq, t.val_before_train, t.log_val_generations) == (15, 5, True, 1)
    assert (t.save_freq, t.max_actor_ckpt_to_keep, t.resume_mode) == (5, 3, "auto")
    assert (t.project_name, t.experiment_name, t.n_gpus_per_node, t.nnodes) == (
        "easy_r1",
        "qwen2_5_vl_3b_geo_grpo",
        8,
        1,
    )
    assert t.default_local_dir == "checkpoints/easy_r1/qwen2_5_vl_3b_geo_grpo"
    assert list(t.logger) == ["console", "wandb"]


def test_every_key_of_the_seed_file_is_accepted_and_fsdp_keys_warn_once_each():
    cfg, caught = _load(validate=True)
    ignored = [w for w in caught if issubclass(w.category, IgnoredKeysWarning)]
    assert len(ignored) == 1
    listed = {line.split()[0] for line in str(ignored[0].message).splitlines()[1:]}
    assert listed == FSDP_KEYS


def test_kl_switches_follow_easyr1():
    cfg, _ = _load("algorithm.use_kl_loss=false")
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is True
    assert cfg.algorithm.kl_penalty == "low_var_kl" and cfg.algorithm.kl_ctrl.kl_coef == 0.01
    cfg, _ = _load("algorithm.disable_kl=true")
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False


def test_without_val_override_validation_samples_like_the_rollout():
    cfg, _ = _load("worker.rollout.val_override_config={}")
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.n, val.do_sample) == (1.0, 6, True)


def test_this_projects_own_keys_pass_through_next_to_easyr1_ones():
    cfg, _ = _load("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.device=cpu")
    assert (
        cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2 and cfg.trainer.device == "cpu"
    )


def test_command_line_wins_and_load_checkpoint_path_resumes_from_it():
    cfg, _ = _load(
        "worker.actor.global_batch_size=32",
        "trainer.load_checkpoint_path=/ckpt/global_step_5",
        "trainer.save_limit=-1",
    )
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 32
    assert (cfg.trainer.resume_mode, cfg.trainer.resume_from_path) == ("resume_path", "/ckpt/global_step_5")
    assert cfg.trainer.max_actor_ckpt_to_keep is None


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "worker.actor.global_batch_sise=4",
            "unknown EasyR1 key 'worker.actor.global_batch_sise' (command line); "
            "did you mean 'worker.actor.global_batch_size'?",
        ),
        (
            "worker.reward.reward_type=batch",
            "worker.reward.reward_type='batch' (command line) is not supported",
        ),
        ("worker.actor.loss_type=cispo", "worker.actor.loss_type='cispo' is not one of ['default', 'gspo']"),
        ("worker.actor.model.lora.rnak=8", "did you mean 'worker.actor.model.lora.rank'?"),
    ],
)
def test_bad_easyr1_keys_are_named(override, message):
    with pytest.raises(ConfigError) as err:
        _load(override)
    assert any(message in e for e in err.value.errors), err.value.errors


def test_easyr1_lora_keys_map_onto_verls():
    cfg, _ = _load(
        "worker.actor.model.lora.rank=8",
        "worker.actor.model.lora.target_modules=[q_proj,v_proj]",
        "worker.actor.model.lora.exclude_modules=.*layers\\.0\\..*",
    )
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha) == (8, 64)  # EasyR1's default alpha, not verl's 16
    assert list(model.target_modules) == ["q_proj", "v_proj"]
    assert model.exclude_modules == ".*layers\\.0\\..*"


def test_missing_config_file_and_mixed_dialects_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config=.*nope.yaml: no such file"):
        load_config(None, [f"config={tmp_path}/nope.yaml"], validate=False)
    with pytest.raises(ConfigError, match="cannot be mixed"):
        load_config("quickstart_cpu", [f"config={SEED_CONFIG}"], validate=False)


def test_save_limit_works_in_the_verl_dialect_too():
    cfg = load_config("quickstart_cpu", ["trainer.save_limit=2"], validate=False)
    assert cfg.trainer.max_actor_ckpt_to_keep == 2


def test_dry_run_prints_the_resolved_config_in_this_projects_keys(capsys):
    assert train.main(["--dry-run", *SEED_COMMAND]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref:" in out and "ppo_mini_batch_size: 64" in out and "worker:" not in out
