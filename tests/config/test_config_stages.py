"""The stages' config (``SFTConfig``, ``RMConfig``): defaults <- preset <- overrides through
``load_stage_config``, verl's SFT keys that are dropped or refused, each section's own rules, and
the stage CLI's ``--dry-run``. In process and fast: no Ray, no model, no data file is read."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_megatron.config import ConfigError, IgnoredKeysWarning
from rlhf_megatron.config.loader import load_stage_config
from rlhf_megatron.config.schema_stages import RMConfig, SFTConfig
from rlhf_megatron.stages import stage_main


def _load(schema: type, overrides: list[str], config_file: Path | None = None):
    """The typed config, failing the test on any warning (an ignored key must be asked for)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        return OmegaConf.to_object(load_stage_config(schema, config_file, overrides))


def _errors(schema: type, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_stage_config(schema, None, overrides)
    return info.value.errors


# --- loading ---------------------------------------------------------------------------------


def test_sft_config_keeps_verls_defaults_and_takes_overrides():
    cfg = _load(
        SFTConfig,
        [
            "data.train_files=[a.parquet,b.jsonl]",
            "data.multiturn.enable=true",
            "data.max_length=2048",
            "data.truncation=left",
            "optim.lr=2e-5",
            "megatron.tensor_model_parallel_size=2",
            "trainer.experiment_name=run1",
        ],
    )
    assert isinstance(cfg, SFTConfig)
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]
    assert cfg.data.multiturn.enable and cfg.data.multiturn.messages_key == "messages"
    assert (cfg.data.max_length, cfg.data.truncation, cfg.optim.lr) == (2048, "left", 2e-5)
    assert cfg.megatron.tensor_model_parallel_size == 2
    # verl's sft_trainer.yaml defaults where it has the key; the run directory interpolates the names
    assert (cfg.data.prompt_key, cfg.data.response_key) == ("question", "answer")
    assert (cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu) == (256, 4)
    assert cfg.trainer.default_local_dir == "checkpoints/gsm8k-sft/run1"
    assert cfg.data.packing is True


def test_rm_config_has_preference_columns_and_its_own_project():
    cfg = _load(RMConfig, ["data.chosen_key=better", "data.truncation=left", "trainer.save_freq=5"])
    assert isinstance(cfg, RMConfig)
    data = cfg.data
    assert (data.prompt_key, data.chosen_key, data.rejected_key) == ("prompt", "better", "rejected")
    assert cfg.data.truncation == "left" and cfg.trainer.save_freq == 5
    assert cfg.trainer.default_local_dir == "checkpoints/reward-model/test"
    assert cfg.optim.lr == 1e-5


def test_preset_file_then_command_line(tmp_path):
    preset = tmp_path / "sft.yaml"
    preset.write_text("data:\n  max_length: 512\n  train_batch_size: 64\ntrainer:\n  project_name: mine\n")
    cfg = _load(SFTConfig, ["data.train_batch_size=32"], config_file=preset)
    assert (cfg.data.max_length, cfg.data.train_batch_size) == (512, 32), "the command line wins"
    assert cfg.trainer.default_local_dir == "checkpoints/mine/test"


# --- keys that are not in the schema ------------------------------------------------------------


def test_unknown_key_names_the_nearest_key():
    (error,) = _errors(SFTConfig, ["data.prompt_kye=q"])
    assert "unknown key 'data.prompt_kye'" in error and "did you mean 'data.prompt_key'?" in error
    assert "command line" in error


def test_sft_only_keys_are_unknown_to_the_reward_model():
    (error,) = _errors(RMConfig, ["data.multiturn.enable=true"])
    assert "unknown key 'data.multiturn.enable'" in error


def test_verls_fsdp_sft_keys_are_accepted_and_dropped_with_one_warning():
    overrides = [
        "model.strategy=fsdp",
        "model.fsdp_config.param_offload=true",
        "ulysses_sequence_parallel_size=2",
        "use_remove_padding=true",
        "data.max_length=256",
    ]
    with pytest.warns(IgnoredKeysWarning) as record:
        cfg = OmegaConf.to_object(load_stage_config(SFTConfig, None, overrides))
    ignored = [w for w in record if issubclass(w.category, IgnoredKeysWarning)]
    assert len(ignored) == 1, "one warning lists every dropped key"
    message = str(ignored[0].message)
    for key in (
        "model.strategy",
        "model.fsdp_config.param_offload",
        "ulysses_sequence_parallel_size",
        "use_remove_padding",
    ):
        assert key in message
    assert "4 config key(s)" in message
    assert cfg.data.max_length == 256, "the other keys still apply"
    assert not hasattr(cfg.model, "strategy") and not hasattr(cfg, "use_remove_padding")


def test_the_reward_model_drops_the_same_verl_keys():
    with pytest.warns(IgnoredKeysWarning, match="model.fsdp_config.cpu_offload"):
        load_stage_config(RMConfig, None, ["model.fsdp_config.cpu_offload=true"])


def test_lora_is_refused_at_any_rank_but_zero():
    (error,) = _errors(SFTConfig, ["model.lora_rank=8"])
    assert "model.lora_rank=8" in error and "LoRA in the SFT stage is not supported yet" in error
    assert "set it to 0" in error
    with pytest.warns(IgnoredKeysWarning, match="model.lora_rank"):
        load_stage_config(SFTConfig, None, ["model.lora_rank=0"])


def test_every_problem_is_reported_at_once():
    errors = _errors(SFTConfig, ["data.prompt_kye=q", "model.lora_rank=8", "data.chat_template=chatml"])
    assert len(errors) == 3
    assert any("data.prompt_kye" in e for e in errors) and any("model.lora_rank" in e for e in errors)
    assert any("data.chat_template='chatml'" in e for e in errors)


# --- each section's own rules --------------------------------------------------------------------


def test_sft_refuses_middle_truncation():
    (error,) = _errors(SFTConfig, ["data.truncation=middle"])
    assert "data.truncation=middle" in error and "use error, left or right" in error
    assert _load(SFTConfig, ["data.truncation=right"]).data.truncation == "right"


def test_rm_refuses_right_truncation():
    (error,) = _errors(RMConfig, ["data.truncation=right"])
    assert "data.truncation=right" in error and "last token" in error and "use error or left" in error


def test_truncation_outside_the_choices_names_them():
    (error,) = _errors(SFTConfig, ["data.truncation=both"])
    assert "data.truncation='both' is not one of: error, left, right, middle" in error


@pytest.mark.parametrize("schema", [SFTConfig, RMConfig], ids=["sft", "rm"])
def test_zero_micro_batch_is_refused(schema):
    (error,) = _errors(schema, ["data.micro_batch_size_per_gpu=0"])
    assert error == "data.micro_batch_size_per_gpu=0 must be >= 1"


def test_empty_train_files_is_refused():
    (error,) = _errors(SFTConfig, ["data.train_files=null"])
    assert "data.train_files is empty" in error


# --- the command line ----------------------------------------------------------------------------


def test_dry_run_prints_the_resolved_config_and_starts_nothing(capsys):
    code = stage_main("sft", ["--dry-run", "data.max_length=333", "use_remove_padding=true"])
    out, err = capsys.readouterr()
    assert code == 0
    printed = OmegaConf.create(out)
    assert printed.data.max_length == 333 and printed.trainer.project_name == "gsm8k-sft"
    assert "warning:" in err and "use_remove_padding" in err
    assert "dry run" in err


def test_dry_run_of_the_reward_model(capsys):
    assert stage_main("rm", ["--dry-run", "data.chosen_key=good"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).data.chosen_key == "good"


def test_a_bad_key_exits_2_and_names_the_nearest(capsys):
    code = stage_main("sft", ["--dry-run", "data.prompt_kye=q"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == "", "no config is printed"
    assert "did you mean 'data.prompt_key'?" in err
