"""Typed schema for the model-holding roles: actor, rollout, reference, critic, reward model.

Role: the dataclasses behind ``actor_rollout_ref.*``, ``critic.*`` and ``reward_model.*``.
Key names and defaults are verl's (``ppo_trainer.yaml`` / ``ppo_megatron_trainer.yaml``)
unless a field's docstring says otherwise. Every field carries an attribute docstring
(the string literal right below it); ``keys.field_docs`` reads them and a test checks that
none is missing.

Boundaries: declarations only. Cross-field rules live in ``validate.py``; values derived
from the world size (per-GPU micro-batches) are filled in by ``normalize.py``. Some
defaults are OmegaConf interpolations (``"${...}"``) so a role follows another unless it is
set; ``loader.load_config`` resolves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import (
    AttentionBackend,
    CheckpointContent,
    Dtype,
    EngineMode,
    LoadFormat,
    RecomputeGranularity,
    RecomputeMethod,
    RolloutName,
    RouterReplayMode,
    TransformerImpl,
    WarmupStyle,
)

ACTOR_MEGATRON = "actor_rollout_ref.actor.megatron"


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

    sequence_parallel: bool = True
    """Shard norm/dropout activations along the sequence over the TP group (switched off
    when TP is 1, as verl does)."""

    use_distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam states over the data-parallel group (ZeRO-1)."""

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

    attention_backend: AttentionBackend = AttentionBackend.local
    """The local layers' core attention: local (megatron-core's unfused ``DotProductAttention``)
    or sdpa (torch's fused ``scaled_dot_product_attention``: no score matrix kept for backward;
    on CPU, at ~1,100-token rows, log-prob passes ~3x and updates ~1.4x faster, no gain at a few
    dozen tokens; see the README's *Step time*). Transformer-engine layers use TE's attention, so
    sdpa needs transformer_impl=local (or auto without TE)."""


def _follow_actor_megatron(**overrides: Any) -> MegatronConfig:
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


@dataclass
class PolicyLossConfig:
    """``actor_rollout_ref.actor.policy_loss``: which policy-gradient loss the actor minimises."""

    loss_mode: str = "vanilla"
    """Name in the algorithms' policy-loss registry (vanilla = clipped PPO with dual clip)."""


@dataclass
class RouterReplayConfig:
    """``actor_rollout_ref.actor.router_replay``: replay mixture-of-experts routing (verl's key)."""

    mode: RouterReplayMode = RouterReplayMode.disabled
    """disabled; R2: the update passes replay the experts the old-log-prob pass chose; R3: the
    old-log-prob and update passes replay the experts vLLM chose while sampling (GPU: vLLM
    reports routes only there); auto (what ``router_replay=true`` sets): R3 with a vLLM rollout
    unless ``trainer.device=cpu``, else R2."""


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor``: the policy being trained."""

    strategy: str = "megatron"
    """Training backend; only megatron is available here (verl's fsdp is rejected)."""

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step. Each step consumes ``ppo_mini_batch_size * rollout.n``
    responses, split evenly over the data-parallel ranks."""

    ppo_micro_batch_size: int | None = None
    """Responses per forward/backward summed over all DP ranks (verl's older spelling);
    converted to ``ppo_micro_batch_size_per_gpu`` = this // DP size."""

    ppo_micro_batch_size_per_gpu: int | None = None
    """Responses per forward/backward on one DP rank (gradient-accumulation unit)."""

    use_dynamic_bsz: bool = False
    """Form micro-batches by token count (``ppo_max_token_len_per_gpu``) instead of by size."""

    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch per GPU when ``use_dynamic_bsz`` is on."""

    clip_ratio: float = 0.2
    """PPO clip range epsilon; the default for ``clip_ratio_low`` and ``clip_ratio_high``."""

    clip_ratio_low: float | None = "${.clip_ratio}"
    """Lower clip range (ratio >= 1 - low). Follows ``clip_ratio`` unless set."""

    clip_ratio_high: float | None = "${.clip_ratio}"
    """Upper clip range (ratio <= 1 + high). Follows ``clip_ratio`` unless set."""

    clip_ratio_c: float = 3.0
    """Dual-clip PPO bound for negative advantages (arXiv:1912.09729); must exceed 1."""

    loss_agg_mode: str = "token-mean"
    """How token losses become a scalar: token-mean, seq-mean-token-sum, seq-mean-token-mean
    or seq-mean-token-sum-norm."""

    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss."""

    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the loss (GRPO style) instead of to the reward."""

    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""

    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss term: kl/k1, abs, mse/k2, low_var_kl/k3 or full."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""

    shuffle: bool = False
    """Shuffle responses between PPO epochs."""

    data_loader_seed: int | None = None
    """Seed of the mini-batch shuffling; null uses ``trainer.seed``."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss choice."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Actor optimizer."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Actor parallel layout and offload."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What actor checkpoints hold."""

    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Mixture-of-experts routing replay (R2/R3)."""


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref``: the frozen reference policy for the KL term."""

    strategy: str = "megatron"
    """Backend of the reference model; only megatron."""

    log_prob_micro_batch_size: int | None = None
    """Responses per reference forward pass summed over DP ranks (verl's older spelling)."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Responses per reference forward pass on one DP rank."""

    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Form reference micro-batches by token count."""

    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget of one reference micro-batch when dynamic batching is on."""

    megatron: MegatronConfig = field(
        default_factory=lambda: _follow_actor_megatron(use_distributed_optimizer=False)
    )
    """Reference layout; TP/PP/VPP/CP/SP and dtype follow the actor's unless set, so the
    reference can be initialised shard-for-shard from the actor."""


@dataclass
class ValSamplingConfig:
    """``actor_rollout_ref.rollout.val_kwargs``: sampling during validation."""

    temperature: float = 0.0
    """Validation temperature (0 with do_sample=False means greedy)."""

    top_k: int = -1
    """Top-k cut-off; -1 disables it."""

    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""

    n: int = 1
    """Responses per validation prompt."""

    do_sample: bool = False
    """Sample (True) or decode greedily (False)."""


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout``: response generation, colocated with the actor."""

    name: RolloutName = RolloutName.vllm
    """Engine: vllm, or hf (transformers generate; slow, for debugging)."""

    mode: EngineMode = EngineMode.sync
    """sync (offline LLM engine driven per batch) or async (server-style engine)."""

    temperature: float = 1.0
    """Sampling temperature."""

    top_k: int = -1
    """Top-k cut-off; -1 disables it (vLLM's convention)."""

    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""

    do_sample: bool = True
    """Sample (True) or decode greedily (False)."""

    n: int = 1
    """Responses per prompt; the group size for GRPO, RLOO and the other group estimators."""

    ignore_eos: bool = False
    """Keep generating after EOS until ``response_length``."""

    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    """Prompt tokens the engine is sized for."""

    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    """Maximum generated tokens per response."""

    dtype: Dtype = Dtype.bfloat16
    """Weight dtype inside vLLM; should match the actor's ``params_dtype``."""

    gpu_memory_utilization: float = 0.5
    """Fraction of total GPU memory vLLM may use for its weights, activations and KV cache."""

    tensor_model_parallel_size: int = 1
    """vLLM tensor parallel size; must divide the number of GPUs."""

    max_num_batched_tokens: int = 8192
    """vLLM's per-step token budget (prefill chunk size)."""

    max_num_seqs: int = 1024
    """Sequences vLLM schedules at once."""

    max_model_len: int | None = None
    """vLLM context length; null uses ``prompt_length + response_length``."""

    enforce_eager: bool = True
    """Disable CUDA graphs (they cost memory and must be rebuilt after freeing the cache)."""

    free_cache_engine: bool = True
    """Release the KV cache after generation so training can use the memory."""

    enable_sleep_mode: bool = True
    """Use vLLM sleep/wake to offload weights and drop the KV cache between rollouts
    (vLLM implements it on CUDA only)."""

    enable_chunked_prefill: bool = False
    """Let vLLM split long prefills into chunks of ``max_num_batched_tokens``."""

    disable_log_stats: bool = True
    """Silence vLLM's periodic throughput logs."""

    load_format: LoadFormat = LoadFormat.hf
    """How actor weights reach vLLM after every update. hf: full tensors with HF names,
    handed to vLLM's own loader (simplest, works everywhere). sharded: tensors already cut
    for each vLLM TP rank with vLLM's fused names, copied straight into its parameters
    (GPU only: vLLM on CPU repacks its weights). verl's dummy_megatron / dummy_hf /
    dummy_dtensor / dummy are accepted and mean hf."""

    update_weights_bucket_megabytes: int = 512
    """Size of the buckets in which actor weights are pushed into vLLM; bounds the extra
    memory of a weight sync."""

    log_prob_micro_batch_size: int | None = None
    """Responses per old-log-prob forward pass, summed over DP ranks (verl's older spelling)."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Responses per old-log-prob forward pass on one actor DP rank."""

    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Form old-log-prob micro-batches by token count."""

    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget of one old-log-prob micro-batch when dynamic batching is on."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine constructor (e.g. ``swap_space``); free-form."""

    limit_images: int = 0
    """Most images one prompt may carry (EasyR1's ``worker.rollout.limit_images``); vLLM's
    ``limit_mm_per_prompt`` for images. A dataset row with more is an error. 0: no limit."""

    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampling used for validation."""

    nnodes: int = 1
    """Nodes of the rollout's own resource pool; used only when
    ``actor_rollout_ref.hybrid_engine`` is false (disaggregated placement)."""

    n_gpus_per_node: int = 1
    """GPUs (processes in CPU mode) per node of the rollout's own pool; used only when
    ``actor_rollout_ref.hybrid_engine`` is false. Its world size must be a multiple of
    ``tensor_model_parallel_size``: each TP group is one vLLM engine (a rollout DP replica)."""


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref``: the hybrid engine (actor, rollout and reference in one worker)."""

    hybrid_engine: bool = True
    """True: the rollout engine lives in the actor's processes (colocated: generate, then
    train, on the same devices). False: the rollout runs on its own resource pool
    (``rollout.nnodes`` x ``rollout.n_gpus_per_node``) and the trainer's pool
    (``trainer.nnodes`` x ``trainer.n_gpus_per_node``) holds the actor, reference and critic;
    weights cross pools after every update. Needed by ``trainer.rollout_mode`` one_step_off and async."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The shared starting checkpoint."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""

    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""


@dataclass
class CriticConfig:
    """``critic``: the value model, built when the advantage estimator needs values (gae)."""

    strategy: str = "megatron"
    """Training backend; only megatron."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer (verl's default LR 1e-5)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Critic checkpoint."""

    megatron: MegatronConfig = field(default_factory=_follow_actor_megatron)
    """Critic layout and offload; TP/PP/VPP/CP/SP and dtype follow the actor's unless set."""

    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    """Prompts per critic optimizer step (times ``rollout.n`` responses)."""

    ppo_micro_batch_size: int | None = None
    """Responses per critic forward/backward summed over DP ranks (verl's older spelling)."""

    ppo_micro_batch_size_per_gpu: int | None = None
    """Responses per critic forward/backward on one DP rank."""

    forward_micro_batch_size: int | None = "${critic.ppo_micro_batch_size}"
    """Responses per value-computation forward pass summed over DP ranks."""

    forward_micro_batch_size_per_gpu: int | None = "${critic.ppo_micro_batch_size_per_gpu}"
    """Responses per value-computation forward pass on one DP rank."""

    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Form critic micro-batches by token count."""

    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one critic training micro-batch when dynamic batching is on."""

    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget of one value-computation micro-batch when dynamic batching is on."""

    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    """Passes over each rollout batch."""

    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    """Shuffle between epochs."""

    data_loader_seed: int | None = None
    """Seed of the critic's mini-batch shuffling; null uses ``trainer.seed``."""

    cliprange_value: float = 0.5
    """Clip range of the value loss around the old values."""

    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"
    """Aggregation of token value losses (same choices as the actor's)."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What critic checkpoints hold."""


@dataclass
class RewardModelConfig:
    """``reward_model``: an optional model-based reward, scored after generation."""

    enable: bool = False
    """Score responses with a reward model (otherwise only the reward functions are used)."""

    strategy: str = "megatron"
    """Backend of the reward model; only megatron."""

    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """Reward model checkpoint."""

    megatron: MegatronConfig = field(default_factory=lambda: MegatronConfig(use_distributed_optimizer=False))
    """Reward model layout (it has its own architecture, so nothing follows the actor)."""

    micro_batch_size: int | None = None
    """Responses per forward pass summed over DP ranks (verl's older spelling)."""

    micro_batch_size_per_gpu: int | None = None
    """Responses per forward pass on one DP rank."""

    max_length: int | None = None
    """Truncate reward-model inputs to this many tokens; null keeps them whole."""

    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # type: ignore[assignment]
    """Form reward-model micro-batches by token count."""

    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget of one reward-model micro-batch when dynamic batching is on."""

    reward_manager: str = "naive"
    """Reward manager that combines scores into token-level rewards (verl's names)."""
