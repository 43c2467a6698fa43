"""Closed-choice keys: Enum fields (``rlhf_megatron.choices``) that the loader checks as they are
set, reporting the key, the value, the allowed values and where the value came from; and members
that behave as the strings they name."""

from __future__ import annotations

import json
import pickle

import pytest
from cfg_helpers import VALID, make_cfg
from omegaconf import OmegaConf

from rlhf_megatron import choices
from rlhf_megatron.config import ConfigError, schema_keys
from rlhf_megatron.config.loader import save_resolved_config
from rlhf_megatron.planning import load_config

# Enum -> (one key typed with it, its message for the value 'bogus')
ENUM_CASES = {
    choices.Truncation: ("data.truncation", "is not one of: error, left, right, middle"),
    choices.RolloutName: ("actor_rollout_ref.rollout.name", "is not one of: vllm, hf"),
    choices.EngineMode: ("actor_rollout_ref.rollout.mode", "is not one of: sync, async"),
    choices.ToolCallFormat: ("actor_rollout_ref.rollout.multi_turn.format", "is not one of: hermes"),
    choices.AgentAssembly: (
        "actor_rollout_ref.rollout.agent.openai_proxy.assembly",
        "is not one of: merge, per_call",
    ),
    choices.AgentFailure: (
        "actor_rollout_ref.rollout.agent.openai_proxy.on_failure",
        "is not one of: zero, mask",
    ),
    choices.TruncateSide: (
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
        "is not one of: left, middle, right",
    ),
    choices.LoadFormat: (
        "actor_rollout_ref.rollout.load_format",
        "is not one of: hf, sharded, dummy_megatron, dummy_hf, dummy_dtensor, dummy",
    ),
    choices.LoraSync: ("actor_rollout_ref.rollout.lora_sync", "is not one of: auto, adapter, merged"),
    choices.Dtype: ("actor_rollout_ref.rollout.dtype", "is not one of: bfloat16, float16, float32"),
    choices.RecomputeGranularity: (
        "critic.megatron.recompute_granularity",
        "is not one of: null, selective, full",
    ),
    choices.RecomputeMethod: (
        "actor_rollout_ref.ref.megatron.recompute_method",
        "is not one of: null, uniform, block",
    ),
    choices.TransformerImpl: (
        "actor_rollout_ref.actor.megatron.transformer_impl",
        "is not one of: auto, transformer_engine, local",
    ),
    choices.AttentionBackend: ("reward_model.megatron.attention_backend", "is not one of: auto, local, sdpa"),
    choices.WarmupStyle: ("critic.optim.warmup_style", "is not one of: constant, cosine"),
    choices.RouterReplayMode: (
        "actor_rollout_ref.actor.router_replay.mode",
        "is not one of: disabled, R2, R3, auto",
    ),
    choices.KLCtrlType: ("algorithm.kl_ctrl.type", "is not one of: fixed, adaptive"),
    choices.FilterMetric: (
        "algorithm.filter_groups.metric",
        "is not one of: null, acc, score, seq_reward, seq_final_reward",
    ),
    choices.RewardManagerName: ("reward_model.reward_manager", "is not one of: naive, batch, dapo"),
    choices.RolloutIsLevel: (
        "algorithm.rollout_correction.rollout_is",
        "is not one of: null, token, sequence",
    ),
    choices.RolloutCorrectionLossType: (
        "algorithm.rollout_correction.loss_type",
        "is not one of: ppo_clip, reinforce",
    ),
    choices.OnError: ("reward.on_error", "is not one of: raise, zero"),
    choices.JudgePlacement: ("reward.judge.placement", "is not one of: colocated, pool"),
    choices.JudgeCombine: ("reward.judge.combine", "is not one of: replace, add"),
    choices.DistillationLossMode: (
        "distillation.distillation_loss.loss_mode",
        "is not one of: k3, k1, kl, abs, mse, k2, low_var_kl, forward_kl_topk",
    ),
    choices.Device: ("trainer.device", "is not one of: auto, cuda, cpu"),
    choices.NanPolicy: ("trainer.nan_policy", "is not one of: stop, skip"),
    choices.VerifyCheckpoint: ("trainer.verify_checkpoint", "is not one of: sha256, size, none"),
    choices.RolloutMode: ("trainer.rollout_mode", "is not one of: sync, one_step_off, async"),
    choices.Parallelism: ("parallelism", "is not one of: manual, auto"),
    choices.CheckpointContent: (
        "actor_rollout_ref.actor.checkpoint.contents",
        "has ['bogus']; allowed entries: model, optimizer, extra, hf_model",
    ),
}
CHOICE_KEYS = [key for key, info in schema_keys().items() if info.choices is not None]


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        make_cfg(*overrides)
    return str(err.value)


def test_every_enum_has_a_case():
    enums = {v for v in vars(choices).values() if isinstance(v, type) and issubclass(v, choices.Choice)}
    assert set(ENUM_CASES) == enums - {choices.Choice}


@pytest.mark.parametrize("enum", list(ENUM_CASES), ids=lambda e: e.__name__)
def test_loader_refuses_a_value_outside_the_enum(enum):
    key, message = ENUM_CASES[enum]
    value = "[model,bogus]" if schema_keys()[key].list_of_choices else "bogus"
    text = _refusal(f"{key}={value}")
    shown = key if schema_keys()[key].list_of_choices else f"{key}='bogus'"
    assert f"{shown} {message} (command line)" in text, text


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_every_choice_key_is_an_enum_field_that_refuses_other_values(key):
    info = schema_keys()[key]
    assert info.choices and all(isinstance(c, str) for c in info.choices)
    if not info.list_of_choices:
        assert f"{key}='nope' is not one of: {info.choices_text()}" in _refusal(f"{key}=nope")


def test_the_refusal_names_the_preset_file_that_set_the_value(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("trainer:\n  device: tpu\n")
    with pytest.raises(ConfigError) as err:
        load_config(preset, validate=False)
    assert f"trainer.device='tpu' is not one of: auto, cuda, cpu ({preset})" in str(err.value)


def test_null_is_refused_unless_the_key_is_optional():
    assert "trainer.device=None is not one of: auto, cuda, cpu" in _refusal("trainer.device=null")
    cfg = make_cfg("algorithm.rollout_correction.rollout_is=null", "critic.megatron.recompute_method=null")
    assert cfg.algorithm.rollout_correction.rollout_is is None


def test_loaded_values_are_members_that_behave_as_their_strings():
    cfg = make_cfg("trainer.device=cpu", "actor_rollout_ref.rollout.load_format=sharded")
    device = cfg.trainer.device
    assert device is choices.Device.cpu and isinstance(device, str)
    assert device == "cpu" and f"{device}" == "cpu" and str(device) == "cpu" and repr(device) == "'cpu'"
    assert {"cpu": 1}[device] == 1 and json.dumps({"d": device}) == '{"d": "cpu"}'
    assert pickle.loads(pickle.dumps(device)) is device
    run = OmegaConf.to_object(cfg)
    assert run.actor_rollout_ref.rollout.load_format == "sharded"
    assert run.actor_rollout_ref.actor.checkpoint.contents == ["model", "optimizer", "extra"]


def test_resolved_yaml_writes_the_values_and_loads_back(tmp_path):
    cfg = make_cfg("trainer.rollout_mode=sync", "reward.on_error=zero")
    text = save_resolved_config(cfg, tmp_path).read_text()
    assert "on_error: zero" in text and "device: auto" in text and "rollout_is: null" in text
    again = load_config(tmp_path / "resolved_config.yaml", validate=False)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


def test_verl_load_formats_are_normalised_to_hf():
    assert set(choices.LoadFormat.values()) > choices.VERL_LOAD_FORMATS
    cfg = load_config(None, [*VALID, "actor_rollout_ref.rollout.load_format=dummy_megatron"])
    assert cfg.actor_rollout_ref.rollout.load_format == "hf"
