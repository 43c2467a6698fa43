"""The LoRA rule across sections: the adapted modules exist in the actor's model, an adapter
file to start from fits it, and the layer implementation can carry adapters.

``ModelConfig.validate`` checks the LoRA keys' own values; this rule relates them to the
architecture (``ctx.archs["actor"]``) and, with ``lora_adapter_path``, reads the adapter's
config and tensor shapes, so a wrong file fails before any worker starts, naming the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_megatron.config.validation_context import ValidationContext

__all__ = ["check_lora"]

MODEL = "actor_rollout_ref.model"


def check_lora(ctx: ValidationContext) -> list[str]:
    """Target modules the model has (no MoE experts, no vision-language model), local layers, and
    a ``lora_adapter_path`` that is a PEFT adapter of this model."""
    from rlhf_megatron.planning.lora_targets import LoraTargetError, read_peft_adapter_config, resolve_targets

    arc = ctx.run.actor_rollout_ref
    if not arc.model.lora_rank or arc.model.validate(MODEL):
        return []  # full fine-tuning, or keys ModelConfig.validate already reports
    out = []
    if str(arc.actor.megatron.transformer_impl) == "transformer_engine":
        out.append(
            f"{MODEL}.lora_rank={arc.model.lora_rank} adapts megatron's local layers; set "
            "actor_rollout_ref.actor.megatron.transformer_impl=local (or auto) instead of transformer_engine"
        )
    arch, source = ctx.archs.get("actor", (None, ""))
    if arch is None:
        return out
    lora = arc.model.lora
    try:
        if lora.adapter_path:
            lora, _ = read_peft_adapter_config(lora.adapter_path, arch)
        resolve_targets(arch, lora, MODEL)
    except (LoraTargetError, FileNotFoundError) as e:
        where = f" ({MODEL}.lora_adapter_path)" if lora.adapter_path else f" (model: {source})"
        out.append(f"{e}{where}")
    return out
