"""EasyR1's config dialect: ``config=FILE`` plus ``data.*``/``worker.*``/``algorithm.*``/``trainer.*`` keys.

Role: EasyR1 users run ``python3 -m verl.trainer.main config=examples/config.yaml
worker.actor.model.model_path=... trainer.n_gpus_per_node=8``. ``python -m
rlhf_megatron.train`` takes the same file and command line: ``build_config`` sees a
``config=`` override or a ``worker.*`` key and hands the overrides here. The EasyR1 keys
are layered as EasyR1 layers them (its dataclass defaults <- the file <- the command line)
and then translated, in one pass, onto this project's schema through one table
(``RULES``), like the ignored-FSDP-keys table does for verl.

Batch semantics follow EasyR1: ``data.rollout_batch_size`` prompts per step,
``worker.actor.global_batch_size`` prompts per optimizer step (verl's
``ppo_mini_batch_size``), ``micro_batch_size_per_device_for_update`` /
``_for_experience`` responses per GPU. KL follows EasyR1 too: ``disable_kl`` turns KL
off, else ``use_kl_loss`` puts it in the actor loss and otherwise in the reward, with
``kl_penalty``/``kl_coef`` for whichever it is. Validation samples with the rollout's
settings updated by ``worker.rollout.val_override_config``, as EasyR1's trainer does.

Keys that only matter to EasyR1's FSDP workers are accepted and dropped with one warning
each. This project's own keys pass through (EasyR1 has no spelling for the Megatron layout,
e.g. ``actor_rollout_ref.actor.megatron.tensor_model_parallel_size``); any other key is an
error naming the nearest EasyR1 key.

Boundaries: pure mapping of dotted keys and values; the loader validates the result.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhf_megatron.choices import Dtype

__all__ = ["EASYR1_DEFAULTS", "RULES", "is_easyr1", "translate_easyr1"]

ROLLOUT = "actor_rollout_ref.rollout"
ACTOR = "actor_rollout_ref.actor"
MODEL = "actor_rollout_ref.model"

# EasyR1's dataclass defaults (verl/trainer/config.py and verl/workers/*/config.py) for the
# keys this dialect maps: a config that leaves a key out gets EasyR1's value, not verl's.
EASYR1_DEFAULTS: dict[str, Any] = {
    "data.prompt_key": "prompt",
    "data.answer_key": "answer",
    "data.image_key": "images",
    "data.video_key": "videos",
    "data.video_fps": 2.0,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.rollout_batch_size": 512,
    "data.val_batch_size": -1,
    "data.shuffle": True,
    "data.seed": 1,
    "data.min_pixels": 262144,
    "data.max_pixels": 4194304,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "grpo",
    "algorithm.disable_kl": False,
    "algorithm.use_kl_loss": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_coef": 1e-3,
    "algorithm.kl_type": "fixed",
    "algorithm.kl_horizon": 10000.0,
    "algorithm.kl_target": 0.1,
    "worker.actor.global_batch_size": 256,
    "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.micro_batch_size_per_device_for_experience": 16,
    "worker.actor.max_grad_norm": 1.0,
    "worker.actor.clip_ratio_low": 0.2,
    "worker.actor.clip_ratio_high": 0.3,
    "worker.actor.clip_ratio_dual": 3.0,
    "worker.actor.loss_avg_mode": "token",
    "worker.actor.ppo_epochs": 1,
    "worker.actor.model.enable_gradient_checkpointing": True,
    "worker.actor.model.trust_remote_code": True,
    "worker.actor.model.freeze_vision_tower": False,
    "worker.actor.model.lora.alpha": 64,
    "worker.actor.optim.lr": 1e-6,
    "worker.actor.optim.weight_decay": 1e-2,
    "worker.actor.optim.lr_warmup_ratio": 0.0,
    "worker.critic.global_batch_size": 256,
    "worker.critic.micro_batch_size_per_device_for_update": 4,
    "worker.critic.micro_batch_size_per_device_for_experience": 16,
    "worker.rollout.n": 1,
    "worker.rollout.temperature": 1.0,
    "worker.rollout.top_p": 1.0,
    "worker.rollout.top_k": -1,
    "worker.rollout.limit_images": 0,
    "worker.rollout.dtype": "bf16",
    "worker.rollout.gpu_memory_utilization": 0.6,
    "worker.rollout.enforce_eager": False,
    "worker.rollout.tensor_parallel_size": 2,
    "worker.rollout.max_num_batched_tokens": 8192,
    "worker.rollout.val_override_config": {},
    "worker.reward.reward_type": "function",
    "worker.reward.compute_score": "math",
    "trainer.total_episodes": 15,
    "trainer.project_name": "easy_r1",
    "trainer.experiment_name": "demo",
    "trainer.logger": ["console", "wandb"],
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.val_freq": -1,
    "trainer.val_before_train": True,
    "trainer.val_only": False,
    "trainer.val_generations_to_log": 0,
    "trainer.save_freq": -1,
    "trainer.save_limit": -1,
}

Transform = Callable[[Any], Any]


def _same(v: Any) -> Any:
    return v


def _null_if_negative(v: Any) -> Any:
    return None if v is None or v < 0 else v


SKIP = object()
"""A transform's answer for "leave this project's default": EasyR1's null that means "derive it"."""


def _skip_if_null(v: Any) -> Any:
    return SKIP if v is None else v


_DTYPES = {"bf16": Dtype.bfloat16, "fp16": Dtype.float16, "fp32": Dtype.float32}
_LOSS_AVG = {"token": "token-mean", "seq": "seq-mean-token-mean"}
_LOSS_TYPE = {"default": "vanilla", "gspo": "gspo"}


def _choice(table: dict[str, str], key: str) -> Transform:
    def convert(v: Any) -> Any:
        if v in table.values():
            return v
        if v not in table:
            raise ValueError(f"{key}={v!r} is not one of {sorted(table)}")
        return table[v]

    return convert


@dataclass(frozen=True)
class Rule:
    """One EasyR1 key and the schema key(s) it sets."""

    targets: tuple[str, ...]
    transform: Transform = _same


def _rule(*targets: str, transform: Transform = _same) -> Rule:
    return Rule(targets, transform)


def _role_rules(easy: str, ours: str) -> dict[str, Rule]:
    """The keys EasyR1's actor and critic sections share (batch sizes, clip, model, optim)."""
    return {
        f"{easy}.global_batch_size": _rule(f"{ours}.ppo_mini_batch_size"),
        f"{easy}.micro_batch_size_per_device_for_update": _rule(f"{ours}.ppo_micro_batch_size_per_gpu"),
        f"{easy}.max_grad_norm": _rule(f"{ours}.optim.clip_grad"),
        f"{easy}.ppo_epochs": _rule(f"{ours}.ppo_epochs"),
        f"{easy}.loss_avg_mode": _rule(
            f"{ours}.loss_agg_mode", transform=_choice(_LOSS_AVG, f"{easy}.loss_avg_mode")
        ),
        f"{easy}.optim.lr": _rule(f"{ours}.optim.lr"),
        f"{easy}.optim.betas": _rule(f"{ours}.optim.betas", transform=list),
        f"{easy}.optim.weight_decay": _rule(f"{ours}.optim.weight_decay"),
        f"{easy}.optim.lr_warmup_ratio": _rule(f"{ours}.optim.lr_warmup_steps_ratio"),
        f"{easy}.optim.lr_warmup_steps": _rule(
            f"{ours}.optim.lr_warmup_steps", transform=lambda v: -1 if v is None else v
        ),
        f"{easy}.optim.min_lr_ratio": _rule(f"{ours}.optim.min_lr_ratio"),
        f"{easy}.optim.warmup_style": _rule(f"{ours}.optim.warmup_style"),
        f"{easy}.optim.lr_scheduler_type": _rule(f"{ours}.optim.warmup_style"),
    }


RULES: dict[str, Rule] = {
    # data
    "data.train_files": _rule("data.train_files"),
    "data.val_files": _rule("data.val_files"),
    "data.prompt_key": _rule("data.prompt_key"),
    "data.answer_key": _rule("data.answer_key"),
    "data.image_key": _rule("data.image_key"),
    "data.video_key": _rule("data.video_key"),
    "data.video_fps": _rule("data.video_fps"),
    "data.max_prompt_length": _rule("data.max_prompt_length"),
    "data.max_response_length": _rule("data.max_response_length"),
    "data.rollout_batch_size": _rule("data.train_batch_size"),
    "data.val_batch_size": _rule("data.val_batch_size", transform=_null_if_negative),
    "data.format_prompt": _rule("data.format_prompt"),
    "data.format_prompt_path": _rule("data.format_prompt"),
    "data.system_prompt": _rule("data.system_prompt"),
    "data.shuffle": _rule("data.shuffle"),
    "data.seed": _rule("data.seed"),
    "data.min_pixels": _rule("data.min_pixels"),
    "data.max_pixels": _rule("data.max_pixels"),
    "data.filter_overlong_prompts": _rule("data.filter_overlong_prompts"),
    "data.filter_overlong_prompts_workers": _rule("data.filter_overlong_prompts_workers"),
    # algorithm (the KL keys are combined in _kl_keys)
    "algorithm.gamma": _rule("algorithm.gamma"),
    "algorithm.lam": _rule("algorithm.lam"),
    "algorithm.adv_estimator": _rule("algorithm.adv_estimator"),
    # actor and critic
    **_role_rules("worker.actor", ACTOR),
    "worker.actor.micro_batch_size_per_device_for_experience": _rule(
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    "worker.actor.clip_ratio_low": _rule(f"{ACTOR}.clip_ratio_low"),
    "worker.actor.clip_ratio_high": _rule(f"{ACTOR}.clip_ratio_high"),
    "worker.actor.clip_ratio_dual": _rule(f"{ACTOR}.clip_ratio_c"),
    "worker.actor.loss_type": _rule(
        f"{ACTOR}.policy_loss.loss_mode", transform=_choice(_LOSS_TYPE, "worker.actor.loss_type")
    ),
    "worker.actor.model.model_path": _rule(f"{MODEL}.path"),
    "worker.actor.model.tokenizer_path": _rule(f"{MODEL}.tokenizer_path"),
    "worker.actor.model.override_config": _rule(f"{MODEL}.override_config"),
    "worker.actor.model.enable_gradient_checkpointing": _rule(f"{MODEL}.enable_gradient_checkpointing"),
    "worker.actor.model.trust_remote_code": _rule(f"{MODEL}.trust_remote_code"),
    "worker.actor.model.freeze_vision_tower": _rule(f"{MODEL}.freeze_vision_tower"),
    "worker.actor.model.lora.rank": _rule(f"{MODEL}.lora_rank"),
    "worker.actor.model.lora.alpha": _rule(f"{MODEL}.lora_alpha"),
    "worker.actor.model.lora.target_modules": _rule(f"{MODEL}.target_modules"),
    "worker.actor.model.lora.exclude_modules": _rule(f"{MODEL}.exclude_modules"),
    **_role_rules("worker.critic", "critic"),
    "worker.critic.micro_batch_size_per_device_for_experience": _rule(
        "critic.forward_micro_batch_size_per_gpu"
    ),
    "worker.critic.cliprange_value": _rule("critic.cliprange_value"),
    "worker.critic.model.model_path": _rule("critic.model.path"),
    "worker.critic.model.tokenizer_path": _rule("critic.model.tokenizer_path"),
    "worker.critic.model.override_config": _rule("critic.model.override_config"),
    "worker.critic.model.trust_remote_code": _rule("critic.model.trust_remote_code"),
    # rollout (val_override_config is combined in _validation_sampling)
    "worker.rollout.name": _rule(f"{ROLLOUT}.name"),
    "worker.rollout.n": _rule(f"{ROLLOUT}.n"),
    "worker.rollout.temperature": _rule(f"{ROLLOUT}.temperature"),
    "worker.rollout.top_p": _rule(f"{ROLLOUT}.top_p"),
    "worker.rollout.top_k": _rule(f"{ROLLOUT}.top_k"),
    "worker.rollout.limit_images": _rule(f"{ROLLOUT}.limit_images"),
    "worker.rollout.dtype": _rule(f"{ROLLOUT}.dtype", transform=_choice(_DTYPES, "worker.rollout.dtype")),
    "worker.rollout.gpu_memory_utilization": _rule(f"{ROLLOUT}.gpu_memory_utilization"),
    "worker.rollout.ignore_eos": _rule(f"{ROLLOUT}.ignore_eos"),
    "worker.rollout.enforce_eager": _rule(f"{ROLLOUT}.enforce_eager"),
    "worker.rollout.enable_chunked_prefill": _rule(f"{ROLLOUT}.enable_chunked_prefill"),
    "worker.rollout.tensor_parallel_size": _rule(f"{ROLLOUT}.tensor_model_parallel_size"),
    "worker.rollout.max_model_len": _rule(f"{ROLLOUT}.max_model_len"),
    "worker.rollout.max_num_batched_tokens": _rule(f"{ROLLOUT}.max_num_batched_tokens"),
    "worker.rollout.max_num_seqs": _rule(f"{ROLLOUT}.max_num_seqs"),
    "worker.rollout.disable_log_stats": _rule(f"{ROLLOUT}.disable_log_stats"),
    # reward: the scorer applied to every row (a built-in name or path.py:function)
    "worker.reward.compute_score": _rule("reward.score_fn"),
    "worker.reward.score_function": _rule("reward.score_fn"),
    "worker.reward.reward_function": _rule("reward.score_fn"),
    "worker.reward.num_cpus": _rule("reward.num_workers"),
    # trainer
    "trainer.total_episodes": _rule("trainer.total_epochs"),
    "trainer.total_epochs": _rule("trainer.total_epochs"),
    "trainer.max_steps": _rule("trainer.total_training_steps"),
    "trainer.project_name": _rule("trainer.project_name"),
    "trainer.experiment_name": _rule("trainer.experiment_name"),
    "trainer.logger": _rule("trainer.logger", transform=list),
    "trainer.nnodes": _rule("trainer.nnodes"),
    "trainer.n_gpus_per_node": _rule("trainer.n_gpus_per_node"),
    "trainer.critic_warmup": _rule("trainer.critic_warmup"),
    "trainer.val_freq": _rule("trainer.test_freq"),
    "trainer.val_before_train": _rule("trainer.val_before_train"),
    "trainer.val_only": _rule("trainer.val_only"),
    "trainer.val_generations_to_log": _rule("trainer.log_val_generations"),
    "trainer.save_freq": _rule("trainer.save_freq"),
    "trainer.save_limit": _rule("trainer.max_actor_ckpt_to_keep", transform=_null_if_negative),
    # null: EasyR1 derives checkpoints/<project>/<experiment>, as this project's default does
    "trainer.save_checkpoint_path": _rule("trainer.default_local_dir", transform=_skip_if_null),
}

# Keys combined in translate_easyr1 rather than mapped one to one.
_COMBINED = {
    "algorithm.disable_kl",
    "algorithm.use_kl_loss",
    "algorithm.kl_penalty",
    "algorithm.kl_coef",
    "algorithm.kl_type",
    "algorithm.kl_horizon",
    "algorithm.kl_target",
    "worker.rollout.val_override_config",
    "trainer.load_checkpoint_path",
    "trainer.find_last_checkpoint",
}
_VAL_OVERRIDES = ("n", "temperature", "top_p", "top_k")

_FSDP = "EasyR1's FSDP workers only"


@dataclass(frozen=True)
class Ignored:
    """EasyR1 keys accepted and dropped (``pattern``: a key or a parent, ``*`` one component).
    With ``inert``, only those values are accepted (any other would change the run)."""

    pattern: str
    reason: str
    inert: tuple[Any, ...] | None = None

    def matches(self, key: str) -> bool:
        pat, parts = self.pattern.split("."), key.split(".")
        return len(parts) >= len(pat) and all(p in ("*", k) for p, k in zip(pat, parts))


IGNORED: tuple[Ignored, ...] = (
    Ignored("worker.hybrid_engine", "actor and rollout are always colocated", (True,)),
    Ignored("worker.*.strategy", "every role trains with Megatron here"),
    Ignored("worker.*.fsdp", _FSDP),
    Ignored("worker.*.offload", f"{_FSDP}; Megatron's are <role>.megatron.param_offload / optimizer_offload"),
    Ignored("worker.*.padding_free", _FSDP),
    Ignored(
        "worker.*.ulysses_sequence_parallel_size", f"{_FSDP}; Megatron's is megatron.context_parallel_size"
    ),
    Ignored("worker.*.ulysses_size", f"{_FSDP}; Megatron's is megatron.context_parallel_size"),
    Ignored("worker.*.use_torch_compile", _FSDP),
    Ignored("worker.*.dynamic_batching", "micro-batches come from micro_batch_size_per_device_* here"),
    Ignored("worker.*.optim.strategy", "Megatron's Adam keeps fp32 master weights"),
    Ignored("worker.*.optim.training_steps", "derived from the data and epochs"),
    Ignored("worker.rollout.seed", "rollouts are seeded from data.seed / trainer.seed"),
    Ignored("worker.rollout.disable_tqdm", "no progress bars in the rollout"),
    Ignored("worker.reward.reward_type", "rewards are functions (reward_type=function)", ("function",)),
    Ignored("worker.reward.skip_special_tokens", "responses are decoded without special tokens", (True,)),
    Ignored(
        "worker.reward.reward_function_kwargs",
        "keyword arguments of reward functions are not supported",
        ({},),
    ),
    Ignored(
        "data.image_dir", "image paths are read as given (absolute, or relative to the data file)", (None,)
    ),
    Ignored("data.override_chat_template", "the model's own chat template is used", (None,)),
    Ignored(
        "data.mini_rollout_batch_size", "each step generates data.rollout_batch_size prompts at once", (None,)
    ),
    Ignored("algorithm.online_filtering", "online filtering is not supported", (False,)),
    Ignored("algorithm.filter_key", "online filtering is not supported"),
    Ignored("algorithm.filter_low", "online filtering is not supported"),
    Ignored("algorithm.filter_high", "online filtering is not supported"),
    Ignored("trainer.max_try_make_batch", "online filtering is not supported"),
    Ignored("trainer.save_model_only", "checkpoints always hold what a resume needs"),
    Ignored("trainer.ray_timeline", "not supported"),
)


def is_easyr1(overrides: Mapping[str, Any]) -> bool:
    """An EasyR1 command line: ``config=FILE`` or any ``worker.*`` key."""
    return "config" in overrides or any(k.split(".")[0] == "worker" for k in overrides)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    # val_override_config and override_config are free-form dicts: keep them whole.
    if isinstance(value, dict) and value and not prefix.endswith(("val_override_config", "override_config")):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


@dataclass
class Translation:
    """An EasyR1 config in this project's keys."""

    values: dict[str, Any]
    """Schema key -> value."""
    origin: dict[str, str]
    """Schema key -> where its EasyR1 key was set (file, command line, EasyR1's default)."""
    ignored: dict[str, str]
    """Dropped EasyR1 key -> why."""
    errors: list[str]


def _layered(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """EasyR1's own layering: its defaults <- the config file <- the command line."""
    values, origin = dict(EASYR1_DEFAULTS), dict.fromkeys(EASYR1_DEFAULTS, "EasyR1's default")
    errors = []
    config_file = overrides.get("config")
    if config_file is not None:
        path = Path(str(config_file)).expanduser()
        if not path.is_file():
            errors.append(
                f"config={config_file}: no such file (EasyR1's config.yaml, e.g. examples/config.yaml)"
            )
        else:
            flat: dict[str, Any] = {}
            _flatten(yaml.safe_load(path.read_text()) or {}, "", flat)
            values.update(flat)
            origin.update(dict.fromkeys(flat, str(path)))
    cli = {k: v for k, v in overrides.items() if k != "config"}
    for key, value in cli.items():
        if key.endswith("val_override_config") or key.endswith(".override_config"):
            values[key] = value
        elif ".val_override_config." in key:
            head, _, sub = key.partition(".val_override_config.")
            values[f"{head}.val_override_config"] = {
                **(values.get(f"{head}.val_override_config") or {}),
                sub: value,
            }
        else:
            values[key] = value
        origin[key] = "command line"
    return values, origin, errors


def _is_schema_key(key: str) -> bool:
    """``key`` is one of this project's keys (or lies under a free-form one, like override_config)."""
    from rlhf_megatron.config.keys import schema_keys

    info = schema_keys()
    if key in info and not info[key].section:
        return True
    parts = key.split(".")
    return any(
        info.get(".".join(parts[:i])) and info[".".join(parts[:i])].open_dict for i in range(1, len(parts))
    )


def _known_keys() -> list[str]:
    return sorted({*RULES, *_COMBINED, *EASYR1_DEFAULTS})


def translate_easyr1(overrides: Mapping[str, Any]) -> Translation:
    """Translate an EasyR1 command line (``config=FILE`` and dotted keys, already parsed)."""
    values, origin, errors = _layered(overrides)
    out: dict[str, Any] = {}
    out_origin: dict[str, str] = {}
    ignored: dict[str, str] = {}

    def put(target: str, value: Any, source_key: str) -> None:
        out[target] = value
        out_origin[target] = f"{source_key} ({origin.get(source_key, 'derived')})"

    for key, value in values.items():
        if key in _COMBINED:
            continue
        rule = RULES.get(key)
        if rule is not None:
            try:
                converted = rule.transform(value)
            except (ValueError, TypeError) as e:
                errors.append(f"{e} ({origin[key]})")
                continue
            for target in rule.targets if converted is not SKIP else ():
                put(target, converted, key)
            continue
        entry = next((i for i in IGNORED if i.matches(key)), None)
        if entry is not None:
            if entry.inert is not None and value not in entry.inert:
                allowed = " or ".join(repr(v) for v in entry.inert)
                errors.append(
                    f"{key}={value!r} ({origin[key]}) is not supported ({entry.reason}); set it to {allowed}"
                )
            elif entry.inert is None and origin[key] != "EasyR1's default":
                ignored[key] = entry.reason  # an inert value is what this project does anyway: no warning
            continue
        if _is_schema_key(key):
            # This project's own keys (the Megatron layout, trainer.device, ...) pass through:
            # EasyR1 has no spelling for them.
            put(key, value, key)
            continue
        near = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.6)
        hint = (
            f"; did you mean {near[0]!r}?"
            if near
            else " (EasyR1's keys: data.*, algorithm.*, worker.*, trainer.*)"
        )
        errors.append(f"unknown EasyR1 key {key!r} ({origin[key]}){hint}")
    for target, value, source in [*_kl_keys(values), *_validation_sampling(values), *_resume(values)]:
        put(target, value, source)
    return Translation(out, out_origin, ignored, errors)


def _kl_keys(v: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """EasyR1's KL switches: off (disable_kl), in the actor loss (use_kl_loss) or in the reward."""
    loss = not v["algorithm.disable_kl"] and bool(v["algorithm.use_kl_loss"])
    reward = not v["algorithm.disable_kl"] and not v["algorithm.use_kl_loss"]
    out = [
        (f"{ACTOR}.use_kl_loss", loss, "algorithm.use_kl_loss"),
        ("algorithm.use_kl_in_reward", reward, "algorithm.disable_kl"),
        (f"{ACTOR}.kl_loss_type", v["algorithm.kl_penalty"], "algorithm.kl_penalty"),
        ("algorithm.kl_penalty", v["algorithm.kl_penalty"], "algorithm.kl_penalty"),
        (f"{ACTOR}.kl_loss_coef", v["algorithm.kl_coef"], "algorithm.kl_coef"),
        ("algorithm.kl_ctrl.kl_coef", v["algorithm.kl_coef"], "algorithm.kl_coef"),
        ("algorithm.kl_ctrl.type", v["algorithm.kl_type"], "algorithm.kl_type"),
        ("algorithm.kl_ctrl.horizon", int(v["algorithm.kl_horizon"]), "algorithm.kl_horizon"),
        ("algorithm.kl_ctrl.target_kl", v["algorithm.kl_target"], "algorithm.kl_target"),
    ]
    return out


def _validation_sampling(v: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """Validation samples like the rollout, updated by ``val_override_config`` (EasyR1's trainer)."""
    override = dict(v.get("worker.rollout.val_override_config") or {})
    sampling = {k: override.get(k, v.get(f"worker.rollout.{k}")) for k in _VAL_OVERRIDES}
    key = "worker.rollout.val_override_config"
    out = [(f"{ROLLOUT}.val_kwargs.{k}", value, key) for k, value in sampling.items()]
    out.append((f"{ROLLOUT}.val_kwargs.do_sample", sampling["temperature"] > 0, key))
    return out


def _resume(v: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """``load_checkpoint_path`` resumes from that checkpoint; otherwise the newest one (auto)."""
    path = v.get("trainer.load_checkpoint_path")
    if path:
        return [
            ("trainer.resume_mode", "resume_path", "trainer.load_checkpoint_path"),
            ("trainer.resume_from_path", path, "trainer.load_checkpoint_path"),
        ]
    if v.get("trainer.find_last_checkpoint") is False:
        return [("trainer.resume_mode", "disable", "trainer.find_last_checkpoint")]
    return []
