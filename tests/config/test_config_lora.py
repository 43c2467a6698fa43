"""Bad LoRA input is refused before any worker starts, naming the key or the file.

Every case loads and validates a whole config (``validate_config``) the way ``rlhf-megatron
train`` does; adapter files are written by PEFT itself or by this project's writer.
"""

from __future__ import annotations

import json

import pytest
import torch
from cfg_helpers import make_cfg

from rlhf_megatron.config import ConfigError
from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.planning import validate_config

M = "actor_rollout_ref.model"


def _errors(*overrides: str) -> list[str]:
    try:
        validate_config(make_cfg(*overrides))
    except ConfigError as exc:
        return exc.errors
    return []


def _has(errors: list[str], text: str) -> bool:
    return any(text in e for e in errors)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([f"{M}.lora_rank=-4"], f"{M}.lora_rank=-4 must be >= 0"),
        ([f"{M}.lora_rank=8", f"{M}.lora_alpha=0"], f"{M}.lora_alpha=0.0 must be > 0"),
        (
            [f"{M}.lora_adapter_path=/some/adapter"],
            "asks for adapters, but actor_rollout_ref.model.lora_rank=0",
        ),
        ([f"{M}.lora_rank=8", f"{M}.target_modules=[]"], f"{M}.target_modules is empty"),
        ([f"{M}.lora_rank=8", f"{M}.target_modules='(['"], "is not a regular expression"),
        (
            [f"{M}.lora_rank=8", f"{M}.target_modules=[gate,up]"],
            "names ['gate', 'up'], which LlamaForCausalLM",
        ),
        (
            [f"{M}.lora_rank=8", f"{M}.target_modules=[q_proj]", f"{M}.exclude_modules=.*"],
            "selects no linear layer of LlamaForCausalLM",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.model.lora_rank=8"],
            "critic.model.lora_rank=8: LoRA is not supported on the critic",
        ),
        (
            [
                f"{M}.lora_rank=8",
                "actor_rollout_ref.rollout.name=hf",
                "actor_rollout_ref.rollout.lora_sync=adapter",
            ],
            "rollout.lora_sync=adapter needs vLLM's LoRA support",
        ),
        ([f"{M}.lora_rank=8", f"{M}.lora_adapter_path=/no/such/adapter"], "adapter_config.json is missing"),
    ],
)
def test_bad_lora_settings_are_named(overrides, message):
    errors = _errors(*overrides)
    assert _has(errors, message), errors


def test_a_valid_lora_config_passes():
    assert _errors(f"{M}.lora_rank=8", f"{M}.target_modules=[q_proj,v_proj]") == []


def _adapter(tmp_path, **shapes):
    """A PEFT adapter directory for the validation preset's tiny Llama (hidden 64), or other widths."""
    from rlhf_megatron.models.lora_io import write_peft_adapter

    hidden = shapes.get("hidden", 64)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, hidden),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(hidden, 4),
    }
    return write_peft_adapter(tmp_path / "adapter", tensors, LoraConfig(4, 8, ("q_proj",)), "/base")


def test_an_adapter_of_another_base_model_is_named_by_file(tmp_path):
    cfg_hidden = int(make_cfg().model_arch.hidden_size)
    adapter = _adapter(tmp_path, hidden=cfg_hidden * 2)
    errors = _errors(f"{M}.lora_rank=4", f"{M}.lora_adapter_path={adapter}")
    assert _has(
        errors, f"{adapter}/adapter_model.safetensors: base_model.model.model.layers.0.self_attn.q_proj"
    ), errors
    assert _has(errors, "the adapter's base model does not match this model"), errors


def test_a_dora_adapter_and_a_broken_config_are_named(tmp_path):
    cfg_hidden = int(make_cfg().model_arch.hidden_size)
    adapter = _adapter(tmp_path, hidden=cfg_hidden)
    assert _errors(f"{M}.lora_rank=4", f"{M}.lora_adapter_path={adapter}") == []
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert _has(
        _errors(f"{M}.lora_rank=4", f"{M}.lora_adapter_path={adapter}"), "is not a plain LoRA adapter"
    )
    (adapter / "adapter_config.json").write_text("{not json")
    assert _has(
        _errors(f"{M}.lora_rank=4", f"{M}.lora_adapter_path={adapter}"), "adapter_config.json: not valid JSON"
    )
