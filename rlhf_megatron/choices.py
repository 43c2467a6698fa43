"""The closed sets of values that config keys take: one Enum per set, the only list of its values.

Role: the schema types each closed-choice field with one of these (as megatron-core types
``TransformerConfig``'s choices), so OmegaConf refuses any other value the moment a preset or an
override sets it, and the loader reports it with the allowed values. Code elsewhere that needs
the same set (the reward manager's ``on_error``, the rollout-correction levels, the dataset's
truncation modes) reads it from here instead of keeping a copy.

Every member's name is its value, and a member is a ``str`` that prints, formats, compares,
hashes and JSON-encodes as that value: ``Device.cpu == "cpu"``, ``f"{Device.cpu}"`` is
``cpu``, ``{"cpu": 1}[Device.cpu]`` is 1. Code that treats the values as strings keeps working
on a loaded config. (``enum.StrEnum`` does this on Python 3.11 only; ``Choice`` does it on 3.10.)
Names an extension can add to (advantage estimators, policy losses, KL estimators, loss
aggregation modes, reward functions) are registries, not choices: see ``config/names.py``.

Boundaries: the standard library only, and nothing from this package, so that every layer
(``algorithms`` and ``platform`` included, which may not import ``config``) can use it.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "AgentAssembly",
    "AgentFailure",
    "AttentionBackend",
    "CheckpointContent",
    "Choice",
    "Device",
    "DistillationLossMode",
    "Dtype",
    "EngineMode",
    "FilterMetric",
    "JudgeCombine",
    "JudgePlacement",
    "KLCtrlType",
    "LoadFormat",
    "LoraSync",
    "NanPolicy",
    "OnError",
    "Parallelism",
    "RecomputeGranularity",
    "RecomputeMethod",
    "RolloutCorrectionLossType",
    "RolloutIsLevel",
    "RolloutMode",
    "RewardManagerName",
    "RolloutName",
    "RouterReplayMode",
    "ToolCallFormat",
    "TransformerImpl",
    "TruncateSide",
    "Truncation",
    "VERL_LOAD_FORMATS",
    "VerifyCheckpoint",
    "WarmupStyle",
]


class Choice(str, Enum):
    """Base of the config's choices: a member is the string it names (see the module docstring)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        # As the plain string would print, so messages that quote a value (``{value!r}``) read
        # the same whether it came from a loaded config or from a caller's literal.
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The allowed values, in declaration order, as plain strings."""
        return tuple(member.value for member in cls)


def _choice(name: str, values: tuple[str, ...], doc: str) -> type[Choice]:
    """A ``Choice`` whose members are ``values`` (the functional form: some values, such as
    ``async`` and ``raise``, are Python keywords and cannot be class attributes)."""
    cls = Choice(name, [(v, v) for v in values], module=__name__, qualname=name)
    cls.__doc__ = doc
    return cls


# ---------------------------------------------------------------------------------------- data
Truncation = _choice(
    "Truncation",
    ("error", "left", "right", "middle"),
    "``data.truncation``: what happens to a prompt over ``max_prompt_length``.",
)

# ------------------------------------------------------------------------------------- rollout
RolloutName = _choice(
    "RolloutName", ("vllm", "hf"), "``actor_rollout_ref.rollout.name``: the generation engine."
)
EngineMode = _choice(
    "EngineMode",
    ("sync", "async"),
    "``actor_rollout_ref.rollout.mode``: offline engine driven per batch, or server-style engine.",
)
ToolCallFormat = _choice(
    "ToolCallFormat",
    ("hermes",),
    "``actor_rollout_ref.rollout.multi_turn.format``: how tool calls are written "
    "(hermes: Qwen's ``<tool_call>{json}</tool_call>``).",
)
TruncateSide = _choice(
    "TruncateSide",
    ("left", "middle", "right"),
    "``actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side``: which part of an overlong "
    "tool response is kept: its head (left), head and tail (middle) or tail (right).",
)
AgentAssembly = _choice(
    "AgentAssembly",
    ("merge", "per_call"),
    "``actor_rollout_ref.rollout.agent.openai_proxy.assembly``: how an agent's calls become samples "
    "(merge: a call that continues an earlier one in tokens extends its sample; per_call: one sample "
    "per call).",
)
AgentFailure = _choice(
    "AgentFailure",
    ("zero", "mask"),
    "``actor_rollout_ref.rollout.agent.openai_proxy.on_failure``: what an episode whose agent raised or "
    "timed out counts for (zero: its samples train with reward 0; mask: its prompt's whole group is "
    "masked out of the loss).",
)
LoadFormat = _choice(
    "LoadFormat",
    ("hf", "sharded", "dummy_megatron", "dummy_hf", "dummy_dtensor", "dummy"),
    "``actor_rollout_ref.rollout.load_format``: how actor weights reach vLLM (``VERL_LOAD_FORMATS``"
    " are verl's spellings, which mean hf).",
)
LoraSync = _choice(
    "LoraSync",
    ("auto", "adapter", "merged"),
    "``actor_rollout_ref.rollout.lora_sync``: how a LoRA actor's weights reach the rollout (adapter: "
    "only the adapters, served by vLLM's LoRA support; merged: base + adapters folded into full weights).",
)
VERL_LOAD_FORMATS: frozenset[str] = frozenset(
    {LoadFormat.dummy_megatron, LoadFormat.dummy_hf, LoadFormat.dummy_dtensor, LoadFormat.dummy}
)
"""verl's ``load_format`` values, accepted and normalised to ``hf``."""

# ---------------------------------------------------------------------------- models and optim
Dtype = _choice(
    "Dtype",
    ("bfloat16", "float16", "float32"),
    "``<role>.megatron.params_dtype`` and ``actor_rollout_ref.rollout.dtype``: a weight dtype.",
)
RecomputeGranularity = _choice(
    "RecomputeGranularity",
    ("selective", "full"),
    "``<role>.megatron.recompute_granularity`` (null: keep every activation).",
)
RecomputeMethod = _choice(
    "RecomputeMethod",
    ("uniform", "block"),
    "``<role>.megatron.recompute_method``, with full recomputation (null: uniform).",
)
TransformerImpl = _choice(
    "TransformerImpl",
    ("auto", "transformer_engine", "local"),
    "``<role>.megatron.transformer_impl``: Megatron-LM's ``--transformer-impl``, or auto.",
)
AttentionBackend = _choice(
    "AttentionBackend",
    ("auto", "local", "sdpa"),
    "``<role>.megatron.attention_backend``: the local layers' core attention (auto: sdpa on CUDA).",
)
WarmupStyle = _choice(
    "WarmupStyle", ("constant", "cosine"), "``<role>.optim.warmup_style``: the schedule after warmup."
)
CheckpointContent = _choice(
    "CheckpointContent",
    ("model", "optimizer", "extra", "hf_model"),
    "An entry of ``<role>.checkpoint.contents``.",
)
RouterReplayMode = _choice(
    "RouterReplayMode",
    ("disabled", "R2", "R3", "auto"),
    "``actor_rollout_ref.actor.router_replay.mode``: mixture-of-experts routing replay.",
)

# ----------------------------------------------------------------------------------- algorithm
KLCtrlType = _choice(
    "KLCtrlType",
    ("fixed", "adaptive"),
    "``algorithm.kl_ctrl.type``: the in-reward KL coefficient's controller.",
)
RolloutIsLevel = _choice(
    "RolloutIsLevel",
    ("token", "sequence"),
    "``algorithm.rollout_correction.rollout_is``: the importance weights' granularity (null: off).",
)
RolloutCorrectionLossType = _choice(
    "RolloutCorrectionLossType",
    ("ppo_clip", "reinforce"),
    "``algorithm.rollout_correction.loss_type``: the policy loss in bypass mode, PPO's clipped "
    "ratio against the rollout's policy (ppo_clip) or the importance-weighted policy gradient "
    "(reinforce).",
)

FilterMetric = _choice(
    "FilterMetric",
    ("acc", "score", "seq_reward", "seq_final_reward"),
    "``algorithm.filter_groups.metric``: the per-response value whose spread within a prompt's "
    "group decides whether the group is kept (verl's DAPO names).",
)
# ----------------------------------------------------------------------------- reward, trainer
RewardManagerName = _choice(
    "RewardManagerName",
    ("naive", "batch", "dapo"),
    "``reward_model.reward_manager``: verl's reward managers (dapo adds the overlong buffer).",
)
OnError = _choice(
    "OnError",
    ("raise", "zero"),
    "``reward.on_error``: a scorer failure stops training (raise) or scores 0 (zero).",
)
JudgePlacement = _choice(
    "JudgePlacement",
    ("colocated", "pool"),
    "``reward.judge.placement``: the judge's vLLM engine in the driver process (colocated) or on "
    "a Ray resource pool of its own (pool).",
)
DistillationLossMode = _choice(
    "DistillationLossMode",
    ("k3", "k1", "kl", "abs", "mse", "k2", "low_var_kl", "forward_kl_topk"),
    "``distillation.distillation_loss.loss_mode``: the per-token student-teacher divergence (KL "
    "estimators over the sampled token, or the forward KL over the teacher's top-k tokens).",
)
JudgeCombine = _choice(
    "JudgeCombine",
    ("replace", "add"),
    "``reward.judge.combine``: the judge's score is the reward (replace) or is added to the "
    "rule-based score (add).",
)
Device = _choice("Device", ("auto", "cuda", "cpu"), "``trainer.device``: the accelerator.")
NanPolicy = _choice(
    "NanPolicy", ("stop", "skip"), "``trainer.nan_policy``: what a step with non-finite gradients does."
)
VerifyCheckpoint = _choice(
    "VerifyCheckpoint",
    ("sha256", "size", "none"),
    "``trainer.verify_checkpoint``: how a resume checks the checkpoint against its manifest.",
)
RolloutMode = _choice(
    "RolloutMode",
    ("sync", "one_step_off", "async"),
    "``trainer.rollout_mode``: how generation and training interleave.",
)
Parallelism = _choice(
    "Parallelism",
    ("manual", "auto"),
    "``parallelism``: layout keys as written (manual), or every layout key a preset leaves unset "
    "searched by the planner (auto).",
)
