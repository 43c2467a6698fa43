"""Loading: defaults <- preset (with base chains) <- overrides, and the errors on the way."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from cfg_helpers import VALID, make_cfg
from omegaconf import OmegaConf

from rlhf_megatron.config import ConfigError, IgnoredKeysWarning, RunConfig, parse_overrides
from rlhf_megatron.config.loader import RESOLVED_CONFIG_NAME, save_resolved_config
from rlhf_megatron.planning import load_config


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- override syntax ---------------------------------------------------------------------


def test_parse_overrides_reads_values_as_yaml_like_hydra():
    parsed = parse_overrides(
        [
            "a.b=1e-6",
            "trainer.logger=['wandb']",
            "c=null",
            "d=False",
            "+e.f=3",
            "++g=x",
            "h=${data.max_response_length}",
            "i=hdfs://x/y",
            "j=",
            "k='007'",
        ]
    )
    assert parsed == {
        "a.b": 1e-6,
        "trainer.logger": ["wandb"],
        "c": None,
        "d": False,
        "e.f": 3,
        "g": "x",
        "h": "${data.max_response_length}",
        "i": "hdfs://x/y",
        "j": "",
        "k": "007",
    }


def test_parse_overrides_rejects_deletion_and_missing_equals():
    with pytest.raises(ConfigError) as err:
        parse_overrides(["~trainer.logger", "trainer.total_epochs"])
    assert len(err.value.errors) == 2
    assert "deleting keys is not supported" in err.value.errors[0]
    assert "'trainer.total_epochs' is not key=value" in err.value.errors[1]


def test_overrides_lists_and_plus_prefix_apply():
    cfg = make_cfg("trainer.logger=['console','jsonl']", "+trainer.val_only=True", "++data.seed=7")
    assert list(cfg.trainer.logger) == ["console", "jsonl"]
    assert cfg.trainer.val_only is True
    assert cfg.data.seed == 7


def test_interpolation_in_an_override_resolves():
    cfg = make_cfg(
        "data.max_prompt_length=100", "actor_rollout_ref.rollout.max_model_len=${data.max_prompt_length}"
    )
    assert cfg.actor_rollout_ref.rollout.max_model_len == 100


def test_result_is_structured_and_resolved():
    cfg = make_cfg(validate=True)
    assert OmegaConf.get_type(cfg) is RunConfig
    with pytest.raises(Exception, match="not_a_key"):
        cfg.trainer.not_a_key = 1
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert "${" not in str(raw)


def test_open_dict_fields_accept_any_subkey():
    cfg = make_cfg(
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        "actor_rollout_ref.rollout.engine_kwargs.swap_space=null",
    )
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"swap_space": None}


# --- errors ------------------------------------------------------------------------------


def test_unknown_key_names_the_nearest_valid_key():
    with pytest.raises(ConfigError) as err:
        make_cfg("actor_rollout_ref.actor.ppo_micro_bach_size=4", "trainer.totl_epochs=3")
    messages = err.value.errors
    assert len(messages) == 2
    assert "unknown key 'actor_rollout_ref.actor.ppo_micro_bach_size'" in messages[0]
    assert "did you mean 'actor_rollout_ref.actor.ppo_micro_batch_size'?" in messages[0]
    assert "did you mean 'trainer.total_epochs'?" in messages[1]
    assert "command line" in messages[1]


def test_unknown_key_with_no_neighbour_says_so():
    with pytest.raises(ConfigError, match="no similar key exists"):
        make_cfg("zzzz=1")


def test_subkey_of_a_value_is_an_error():
    with pytest.raises(ConfigError, match="data.max_prompt_length is a value of type int, not a section"):
        make_cfg("data.max_prompt_length.foo=1")


def test_setting_a_section_to_a_value_is_an_error():
    with pytest.raises(ConfigError, match=r"trainer is a section \(TrainerConfig\); set its keys"):
        make_cfg("trainer=5")


def test_wrong_types_name_key_and_expected_type_all_at_once():
    with pytest.raises(ConfigError) as err:
        make_cfg(
            "data.train_batch_size=many",
            "actor_rollout_ref.rollout.temperature=hot",
            "trainer.val_only=maybe",
        )
    messages = err.value.errors
    assert len(messages) == 3
    assert messages[0].startswith("data.train_batch_size='many' (command line): expected int;")
    assert messages[1].startswith(
        "actor_rollout_ref.rollout.temperature='hot' (command line): expected float;"
    )
    assert messages[2].startswith("trainer.val_only='maybe' (command line): expected bool;")


def test_type_error_in_a_preset_names_the_file(tmp_path):
    preset = _write(tmp_path / "p.yaml", "data:\n  max_prompt_length: long\n")
    with pytest.raises(ConfigError, match=r"data.max_prompt_length='long' \(.*p.yaml\): expected int"):
        load_config(preset, VALID, validate=False)


def test_broken_interpolation_is_reported_with_its_key():
    with pytest.raises(ConfigError) as err:
        make_cfg("actor_rollout_ref.rollout.max_model_len=${data.no_such_key}")
    assert err.value.errors[0].startswith("actor_rollout_ref.rollout.max_model_len=${data.no_such_key}:")
    assert "not found" in err.value.errors[0]


def test_partial_model_arch_reports_the_missing_required_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model_arch.model_type=llama", "model_arch.num_hidden_layers=4"])
    (message,) = [e for e in err.value.errors if "model_arch" in e]
    assert message.endswith(
        "model_arch: required key(s) 'hidden_size', 'num_attention_heads', 'intermediate_size', 'vocab_size' missing"
    )


def test_model_arch_null_in_a_later_layer_drops_the_base_section(tmp_path):
    _write(tmp_path / "base.yaml", "model_arch:\n  num_hidden_layers: 2\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\nmodel_arch: null\n")
    cfg = load_config(child, [], validate=False)
    assert cfg.model_arch is None


def test_hydra_defaults_list_gets_a_pointer_to_base():
    with pytest.raises(ConfigError, match="Hydra `defaults` lists are not supported"):
        make_cfg("defaults=[a]")


# --- verl keys that the Megatron backend ignores, and other spellings ----------------------


def test_fsdp_only_keys_are_dropped_with_one_warning_listing_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = make_cfg(
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "critic.model.fsdp_config.wrap_policy.min_num_params=0",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.use_torch_compile=False",
            "trainer.default_hdfs_dir=null",
        )
    ignored = [w for w in caught if issubclass(w.category, IgnoredKeysWarning)]
    assert len(ignored) == 1
    text = str(ignored[0].message)
    assert text.startswith("5 config key(s) have no effect with the Megatron backend")
    for key in (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "critic.model.fsdp_config.wrap_policy.min_num_params",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.use_torch_compile",
        "trainer.default_hdfs_dir",
    ):
        assert key in text
    assert "fsdp_config" not in OmegaConf.to_container(cfg.actor_rollout_ref.actor)


def test_no_warning_when_nothing_is_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_cfg()
    assert not [w for w in caught if issubclass(w.category, IgnoredKeysWarning)]


def test_ignored_key_with_a_behaviour_changing_value_is_an_error():
    with pytest.raises(ConfigError) as err:
        make_cfg("actor_rollout_ref.rollout.use_fire_sampling=True")
    assert (
        "actor_rollout_ref.rollout.use_fire_sampling=True (command line) is not supported by the Megatron backend"
        in str(err.value)
    )
    assert "set it to False" in " ".join(err.value.errors)


def test_ignored_key_at_its_inert_value_is_accepted():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_cfg(
            "actor_rollout_ref.rollout.use_fire_sampling=False",
            "actor_rollout_ref.actor.megatron.use_dist_checkpointing=False",
        )
    assert any("actor_rollout_ref.rollout.use_fire_sampling" in str(w.message) for w in caught)


def test_renamed_spellings_set_the_schema_key():
    cfg = make_cfg(
        "actor_rollout_ref.actor.grad_clip=0.5",
        "critic.optim.lr_decay_style=cosine",
        "trainer.val_generations_to_log_to_wandb=3",
    )
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5
    assert cfg.critic.optim.warmup_style == "cosine"
    assert cfg.trainer.log_val_generations == 3


def test_both_spellings_with_different_values_are_an_error():
    with pytest.raises(ConfigError, match="set the same option differently; keep only"):
        make_cfg("actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=2.0")


# --- presets -------------------------------------------------------------------------------


def test_preset_layers_base_then_preset_then_overrides(tmp_path):
    _write(tmp_path / "base.yaml", "data:\n  max_prompt_length: 100\n  max_response_length: 50\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\ndata:\n  max_response_length: 60\n")
    cfg = load_config(child, [*VALID, "data.train_batch_size=64"], validate=False)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.train_batch_size) == (
        100,
        60,
        64,
    )


def test_base_may_be_a_list_applied_in_order(tmp_path):
    _write(tmp_path / "a.yaml", "data:\n  seed: 1\n  shuffle: false\n")
    _write(tmp_path / "b.yaml", "data:\n  seed: 2\n")
    child = _write(tmp_path / "c.yaml", "base: [a.yaml, b.yaml]\n")
    cfg = load_config(child, [], validate=False)
    assert (cfg.data.seed, cfg.data.shuffle) == (2, False)


def test_base_cycle_is_an_error_naming_the_chain(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: c.yaml\n")
    _write(tmp_path / "c.yaml", "base: a.yaml\n")
    with pytest.raises(
        ConfigError, match=r"preset cycle through `base`: a.yaml -> b.yaml -> c.yaml -> a.yaml"
    ):
        load_config(tmp_path / "a.yaml", [], validate=False)


def test_diamond_bases_are_not_a_cycle(tmp_path):
    _write(tmp_path / "root.yaml", "data:\n  seed: 5\n")
    _write(tmp_path / "l.yaml", "base: root.yaml\n")
    _write(tmp_path / "r.yaml", "base: root.yaml\n")
    top = _write(tmp_path / "top.yaml", "base: [l.yaml, r.yaml]\n")
    assert load_config(top, [], validate=False).data.seed == 5


def test_missing_preset_lists_the_places_tried():
    with pytest.raises(ConfigError, match="config file 'no_such_preset' not found"):
        load_config("no_such_preset", [])


def test_preset_found_by_name_under_configs():
    cfg = load_config("quickstart_cpu", [], validate=False)
    assert cfg.algorithm.adv_estimator == "grpo"


def test_unparsable_preset_names_the_file(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "data: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: cannot parse YAML"):
        load_config(bad, [])


def test_unknown_key_in_preset_names_the_file(tmp_path):
    preset = _write(tmp_path / "p.yaml", "trainer:\n  n_gpu_per_node: 4\n")
    with pytest.raises(ConfigError, match=r"did you mean 'trainer.n_gpus_per_node'\?.*p.yaml"):
        load_config(preset, VALID, validate=False)


# --- saving --------------------------------------------------------------------------------


def test_save_resolved_config_is_atomic_and_reloadable(tmp_path):
    cfg = make_cfg(f"trainer.default_local_dir={tmp_path}/run", validate=True)
    path = save_resolved_config(cfg)
    assert path == tmp_path / "run" / RESOLVED_CONFIG_NAME
    assert [p.name for p in path.parent.iterdir()] == [RESOLVED_CONFIG_NAME]  # no temp file left
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    # The saved file is itself a valid preset that reproduces the config.
    again = load_config(path, [], validate=True)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


def test_save_failure_leaves_no_partial_file(tmp_path, monkeypatch):
    cfg = make_cfg(f"trainer.default_local_dir={tmp_path}")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_resolved_config(cfg)
    assert list(tmp_path.iterdir()) == []
