"""Typed schema of what every model role is built from: its checkpoint, parallel layout, optimizer.

Role: the building blocks the role sections (``schema_roles.py``) hold: ``ModelConfig`` (and the
critic's and reward model's variants), ``OptimConfig``, ``MegatronConfig`` (with its own rules,
``MegatronConfig.validate``) and ``CheckpointConfig``. Key names and defaults are verl's
(``ppo_megatron_trainer.yaml``) unless a field's docstring says otherwise; every field carries
an attribute docstring, which ``keys.field_docs`` reads.

Boundaries: declarations, and rules that read one ``megatron`` section only. Rules that relate
a layout to the model architecture or the cluster are in ``validate_layout.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import (
    AttentionBackend,
    CheckpointContent,
    Dtype,
    RecomputeGranularity,
    RecomputeMethod,
    TransformerImpl,
    WarmupStyle,
)
from rlhf_megatron.config.checks import count_problems

__all__ = [
    "ACTOR_MEGATRON",
    "CheckpointConfig",
    "CriticModelConfig",
    "LORA_MODULES",
    "LoraConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardModelModelConfig",
    "follow_actor_megatron",
]

ACTOR_MEGATRON = "actor_rollout_ref.actor.megatron"

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF linear layers of a decoder layer LoRA can adapt (``all-linear``: all of them; the LM
head and a vision tower are never adapted)."""


@dataclass(frozen=True)
class LoraConfig:
    """The typed LoRA section both dialects map to (verl's ``actor_rollout_ref.model.lora_*`` and
    ``target_modules``/``exclude_modules``, EasyR1's ``worker.actor.model.lora.*``): adapters of
    ``rank`` and scale ``alpha / rank`` on the named linear layers, the base weights frozen."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] | str
    """HF module names (``q_proj``, ... ``down_proj``; a name matches a module whose dotted HF name
    ends with it), ``all-linear`` (every name of ``LORA_MODULES``; experts left out), or a regular
    expression a module's full HF name must match."""
    exclude_modules: tuple[str, ...] | str = ()
    """Names or a regular expression, as ``target_modules``, taken out of the targets."""
    adapter_path: str | None = None
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) the
    adapters start from instead of their fresh initialisation."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model``: the HF checkpoint the actor, rollout and reference start from."""

    path: str = "~/models/deepseek-llm-7b-chat"
    """Hugging Face model directory (local path). Its ``config.json`` gives the architecture
    when ``model_arch`` is not set."""

    tokenizer_path: str | None = None
    """Tokenizer directory; null uses ``path``."""

    external_lib: str | None = None
    """Python module imported before the model is built, to register custom HF classes."""

    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the HF config (e.g. ``attention_dropout``); free-form keys."""

    enable_gradient_checkpointing: bool = False
    """verl's switch for activation recomputation. With Megatron it means full, uniform
    recomputation of every layer when ``<role>.megatron.recompute_granularity`` is null."""

    use_remove_padding: bool = False
    """verl's switch for packing sequences without padding (THD layout). Accepted for verl's
    command lines and not used: the Megatron passes cut each micro-batch's padding columns
    themselves, or pack it per prompt (``shared_prompt_packing``)."""

    shared_prompt_packing: bool | None = None
    """Forward passes over responses (old/reference log-probs, values, updates) put each prompt
    once in a row, followed by every response to it that the micro-batch holds: the responses
    attend to the prompt and to themselves only (an arbitrary attention mask), and restart their
    positions after it. A prompt's tokens are computed once instead of ``n`` times and no
    padding sits between responses; outputs and gradients are the unpacked rows', up to float
    rounding (``rlhf_megatron.data.packing``). The driver then balances whole prompt groups over
    the data-parallel ranks, so a group stays in one micro-batch. Dense text models without
    context parallelism only (others run unpacked). null: on with ``trainer.device=cpu``, off
    otherwise: the mask is dense, so its cost grows with the square of a packed row's width
    (prompt + all its responses), which long GPU responses make prohibitive."""

    trust_remote_code: bool = False
    """Allow code from the model directory when loading the HF config and tokenizer."""

    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision tower (patch embedding, blocks, merger) fixed:
    it gets no gradients and no optimizer state (EasyR1's
    ``worker.actor.model.freeze_vision_tower``). Text-only models ignore it."""

    lora_rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning). Above 0 the actor trains low-rank
    adapters on ``target_modules`` and its base weights stay frozen: only the adapters get
    gradients and optimizer state, the reference policy is the same model with its adapters
    switched off (no second copy), and only the adapters are synced to vLLM and checkpointed.
    EasyR1's ``worker.actor.model.lora.rank``."""

    lora_alpha: float = 16
    """LoRA scaling: an adapter's output is multiplied by ``lora_alpha / lora_rank`` (PEFT's
    convention)."""

    target_modules: Any = "all-linear"
    """The linear layers that get adapters: ``all-linear`` (every projection of every decoder
    layer: q/k/v/o_proj, gate/up/down_proj; mixture-of-experts layers' experts are left out), a
    list of HF module names (e.g. ``[q_proj, v_proj]``), or a regular expression a module's full
    HF name (``model.layers.3.self_attn.q_proj``) must match."""

    exclude_modules: Any = None
    """Modules taken out of ``target_modules``: a list of names (``down_proj``, or a full HF name
    such as ``model.layers.0.mlp.down_proj``) or a regular expression on the full HF name."""

    lora_adapter_path: str | None = None
    """A PEFT adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``, as
    PEFT's ``save_pretrained`` or ``rlhf-megatron convert --to peft`` write it) to start the
    adapters from; its rank, alpha and target modules replace the keys above."""

    @property
    def lora(self) -> LoraConfig | None:
        """The LoRA section, or None for full fine-tuning (``lora_rank`` 0)."""
        if not self.lora_rank:
            return None
        return LoraConfig(
            rank=int(self.lora_rank),
            alpha=float(self.lora_alpha),
            target_modules=_names_or_pattern(self.target_modules),
            exclude_modules=_names_or_pattern(self.exclude_modules),
            adapter_path=self.lora_adapter_path,
        )

    def validate(self, key: str) -> list[str]:
        """The LoRA keys' own rules (the module names against the model: ``validate_layout``)."""
        out = []
        if self.lora_rank is None or int(self.lora_rank) < 0:
            out.append(f"{key}.lora_rank={self.lora_rank} must be >= 0 (0: full fine-tuning, no adapters)")
            return out
        if not self.lora_rank:
            if self.lora_adapter_path:
                out.append(
                    f"{key}.lora_adapter_path={self.lora_adapter_path} asks for adapters, but {key}.lora_rank=0 "
                    f"means full fine-tuning; set {key}.lora_rank to the adapter's rank"
                )
            return out
        if not self.lora_alpha or float(self.lora_alpha) <= 0:
            out.append(
                f"{key}.lora_alpha={self.lora_alpha} must be > 0 (the adapters' scale is alpha / rank)"
            )
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if value is None and name == "exclude_modules":
                continue
            if isinstance(value, str):
                try:
                    re.compile(value)
                except re.error as e:
                    out.append(
                        f"{key}.{name}={value!r} is not a regular expression ({e}); give a list of names"
                    )
            elif not (isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value)):
                out.append(f"{key}.{name}={value!r} must be all-linear, a list of module names or a regex")
            elif name == "target_modules" and not value:
                out.append(f"{key}.target_modules is empty: name the modules to adapt, or set lora_rank=0")
        return out


def _names_or_pattern(value: Any) -> tuple[str, ...] | str:
    """A ``target_modules``/``exclude_modules`` value as LoraConfig holds it."""
    if value is None:
        return ()
    if isinstance(value, str):
        return value
    return tuple(str(v) for v in value)


@dataclass
class CriticModelConfig(ModelConfig):
    """``critic.model``: the value model. Paths follow the actor's unless set."""

    path: str = "${actor_rollout_ref.model.path}"
    """HF checkpoint the critic starts from (a value head replaces the LM head). Defaults to
    the actor's model (verl's default is a placeholder path)."""

    tokenizer_path: str | None = "${actor_rollout_ref.model.path}"
    """Tokenizer directory; verl's default, the actor's model path."""

    external_lib: str | None = "${actor_rollout_ref.model.external_lib}"
    """Module imported before the critic is built; defaults to the actor's."""

    trust_remote_code: bool = "${actor_rollout_ref.model.trust_remote_code}"  # type: ignore[assignment]
    """Allow code from the critic's model directory; defaults to the actor's setting."""


@dataclass
class RewardModelModelConfig:
    """``reward_model.model``: the sequence-classification reward model."""

    path: str = "~/models/FsfairX-LLaMA3-RM-v0.1"
    """HF checkpoint of the reward model (AutoModelForSequenceClassification layout)."""

    input_tokenizer: str | None = "${actor_rollout_ref.model.path}"
    """Tokenizer of the policy, used to decode responses before applying the reward model's
    chat template; null when both chat templates are the same."""

    external_lib: str | None = "${actor_rollout_ref.model.external_lib}"
    """Module imported before the reward model is built."""

    trust_remote_code: bool = False
    """Allow code from the reward model's directory."""

    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the reward model's HF config; free-form keys."""

    use_remove_padding: bool = False
    """Pack sequences without padding in the reward model's forward pass."""


@dataclass
class OptimConfig:
    """``<role>.optim``: Adam with warmup and a constant or cosine schedule (Megatron's optimizer)."""

    lr: float = 1e-6
    """Peak learning rate."""

    lr_warmup_steps: int = -1
    """Linear warmup steps; a negative value defers to ``lr_warmup_steps_ratio``."""

    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of ``total_training_steps`` (used when ``lr_warmup_steps`` < 0)."""

    min_lr_ratio: float | None = None
    """Final LR as a fraction of ``lr`` for the cosine schedule; null means 0."""

    warmup_style: WarmupStyle = WarmupStyle.constant
    """Schedule after warmup: constant or cosine. ``lr_decay_style`` (Megatron) and
    ``lr_scheduler_type`` (newer verl) are accepted as other spellings of this key."""

    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam beta1 and beta2."""

    clip_grad: float = 1.0
    """Global gradient-norm clip. verl's FSDP spelling ``<role>.grad_clip`` sets this key."""

    total_training_steps: int = -1
    """Steps the schedule spans; -1 lets the trainer fill it in from the data and epochs."""


@dataclass
class MegatronConfig:
    """``<role>.megatron``: how megatron-core lays one role's model out over the GPUs."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP): splits every layer's matrices over this many GPUs."""

    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP): splits the layers into this many stages."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage for the interleaved 1F1B schedule; null disables it."""

    context_parallel_size: int = 1
    """Context parallel size (CP): splits every sequence over this many GPUs in attention."""

    expert_model_parallel_size: int = 1
    """Expert parallel size (EP) of a mixture-of-experts model: each GPU of an EP group holds
    ``num_experts / EP`` of every sparse layer's experts, and tokens travel to their experts by
    all-to-all. Must divide the number of experts; ``ETP x EP x PP`` must divide the world size.
    1 for dense models."""

    expert_tensor_parallel_size: int | None = None
    """Expert tensor parallel size (ETP): splits each expert's matrices over this many GPUs;
    null means the TP size (megatron's default). Must divide ``moe_intermediate_size``."""

    moe_router_bias_update: bool | None = None
    """DeepSeek-V3's auxiliary-loss-free load balancing (megatron-core's
    ``moe_router_enable_expert_bias`` with a positive ``moe_router_bias_update_rate``): after each
    optimizer step every sparse layer's expert bias (HF ``e_score_correction_bias``: it chooses the
    experts, never weights them) moves by ``moe_router_bias_update_rate``, up for the experts that
    received fewer tokens than the mean in that step and down for those that received more. null:
    on for the families whose checkpoints carry the bias (``deepseek_v3``/``kimi_k2``,
    ``glm4_moe``), off for the others; true on a model without the bias is refused; false keeps the
    checkpoint's bias fixed. A role that does not train (the reference) never moves it."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update per optimizer step (megatron-core's default and DeepSeek-V3's
    0.001); must be > 0. Read only where ``moe_router_bias_update`` is on."""

    sequence_parallel: bool = True
    """Shard norm/dropout activations along the sequence over the TP group (switched off
    when TP is 1, as verl does)."""

    use_distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam states over the data-parallel group (ZeRO-1). Takes
    ``auto`` (the actor's and critic's; also under ``parallelism: auto``): sharded, unless the
    whole state fits and the cost model prices the plain DDP all-reduce faster."""

    param_offload: bool = False
    """Move this role's parameters to CPU memory while other roles run."""

    grad_offload: bool = False
    """Move this role's gradient buffers to CPU memory while other roles run."""

    optimizer_offload: bool = False
    """Move this role's optimizer states to CPU memory while other roles run."""

    seed: int = 1
    """Seed of megatron-core's model-parallel RNG tracker (dropout, initialisation)."""

    params_dtype: Dtype = Dtype.bfloat16
    """Dtype of the model weights: bfloat16, float16 or float32 (our extension; verl
    hard-codes bfloat16)."""

    recompute_granularity: RecomputeGranularity | None = None
    """Activation recomputation: null (keep all activations), selective (recompute the core
    attention) or full (recompute whole layers)."""

    recompute_method: RecomputeMethod | None = None
    """With full recomputation: uniform (checkpoint every ``recompute_num_layers`` layers) or
    block (recompute the first ``recompute_num_layers`` layers of each stage)."""

    recompute_num_layers: int | None = None
    """Layers per recomputation unit (uniform) or per stage (block); full granularity only."""

    transformer_impl: TransformerImpl = TransformerImpl.auto
    """Megatron-LM's ``--transformer-impl``: transformer_engine (TE's fused layers and attention),
    local (megatron-core's own layers; its attention is unfused) or auto (transformer-engine on
    GPU when it is installed, else local). The memory planner reads auto as transformer_engine
    on GPU and local on CPU."""

    attention_backend: AttentionBackend = AttentionBackend.auto
    """The local layers' core attention: local (megatron-core's unfused ``DotProductAttention``),
    sdpa (torch's fused ``scaled_dot_product_attention``: no score matrix kept for backward; on
    CPU, at ~1,100-token rows, log-prob passes ~3x and updates ~1.4x faster, no gain at a few
    dozen tokens; see docs/benchmarks/step-time.md; on one H200 the 1.24B model's update at 2K
    tokens ~1.9x faster, docs/benchmarks/gpu.md) or auto (sdpa on CUDA, local on CPU).
    Transformer-engine layers use TE's attention, so sdpa needs transformer_impl=local (or auto
    without TE); auto leaves them alone."""

    def validate(self, key: str) -> list[str]:
        """The layout's own rules, checked for each role a run builds: TP, PP, CP >= 1 (VPP too,
        unless null), EP and ETP >= 1, and a recompute method or layer count only with full
        recomputation, as in Megatron. ``key``: where this section sits (``<role>.megatron``)."""
        out = count_problems(
            key,
            {
                "tensor_model_parallel_size": self.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
                "context_parallel_size": self.context_parallel_size,
            },
            {"virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size},
        )
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        if ep < 1 or (etp is not None and etp < 1):
            out.append(
                f"{key}.expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} must be >= 1"
            )
        rate = self.moe_router_bias_update_rate
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            out.append(
                f"{key}.moe_router_bias_update_rate={rate} must be a number > 0 (megatron-core's default "
                f"is 0.001); to keep the expert bias fixed set {key}.moe_router_bias_update=false"
            )
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            out.append(
                f"{key}.recompute_method/recompute_num_layers apply to recompute_granularity=full only "
                f"(it is {self.recompute_granularity}); set them to null or use full"
            )
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            out.append(f"{key}.recompute_num_layers={self.recompute_num_layers} must be >= 1")
        return out


def follow_actor_megatron(**overrides: Any) -> MegatronConfig:
    """A MegatronConfig whose layout keys interpolate the actor's, so a role that shares the
    actor's architecture shares its layout unless told otherwise."""
    layout = {
        key: f"${{{ACTOR_MEGATRON}.{key}}}"
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "sequence_parallel",
            "params_dtype",
        )
    }
    layout.update(overrides)
    return MegatronConfig(**layout)


@dataclass
class CheckpointConfig:
    """``<role>.checkpoint``: what a checkpoint holds."""

    contents: list[CheckpointContent] = field(
        default_factory=lambda: [
            CheckpointContent.model,
            CheckpointContent.optimizer,
            CheckpointContent.extra,
        ]
    )
    """Any of model, optimizer, extra (RNG and scheduler state) and hf_model (an HF export)."""
