"""Schema of ``distillation``: on-policy distillation from one or several teacher models (verl's keys).

Role: declarations and their own checks (``DistillationConfig.validate``), like the other schema
modules; ``schema.RunConfig`` holds it as ``distillation``. The student samples as usual, a
teacher served by vLLM scores every sampled token (``rollout/teacher.py``), and the actor's loss
adds the per-token divergence (``algorithms/distillation.py``).

Teachers come in verl's two forms, both accepted: ``distillation.teacher_model`` (one teacher)
or ``distillation.teacher_models.<name>`` (several, each serving the rows whose
``data.reward_fn_key`` column equals its ``key``). ``teachers()`` returns either as one mapping.

Boundaries: pure Python; imports nothing but the config's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import DistillationLossMode, Dtype

__all__ = [
    "DistillationConfig",
    "DistillationLossConfig",
    "TeacherInferenceConfig",
    "TeacherModelConfig",
]

ESTIMATOR_FREE_OF_TEACHER = ("k1", "kl")
"""Modes whose direct gradient is ``grad log p_student`` alone: only usable as a reward."""


@dataclass
class TeacherInferenceConfig:
    """``distillation.teacher_model.inference``: the teacher's vLLM engine (a subset of verl's
    rollout keys; the teacher only scores, so it has no sampling keys)."""

    name: str = "vllm"
    """Inference engine; vllm only."""

    tensor_model_parallel_size: int | None = None
    """vLLM tensor parallel size. Null: the rollout's (a teacher in the actor's processes must
    use it: vLLM's parallel groups are per process); on a pool of its own, 1."""

    dtype: Dtype = Dtype.bfloat16
    """Weight dtype inside vLLM (float32 on CPU, whatever is set)."""

    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory the teacher's vLLM may use (GPU only); colocated with the actor
    and its rollout, the three share the device."""

    max_model_len: int | None = None
    """The teacher's context length; null: ``data.max_prompt_length + data.max_response_length
    + 1`` (a prompt, a full response, and the one token vLLM generates per request)."""

    max_num_seqs: int = 256
    """Sequences vLLM scores at once; on CPU it also sizes the KV cache."""

    max_num_batched_tokens: int = 8192
    """Token budget of one engine step (at least ``max_model_len``: a sequence is prefilled whole)."""

    enforce_eager: bool = True
    """Run vLLM without CUDA graphs."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``vllm.LLM``; free-form."""


@dataclass
class TeacherModelConfig:
    """One teacher: ``distillation.teacher_model`` or ``distillation.teacher_models.<name>``."""

    model_path: str | None = None
    """The teacher's Hugging Face directory. Its tokenizer must be the student's (same vocabulary
    and special tokens): the teacher scores the student's token ids as they are."""

    key: str | None = None
    """``teacher_models`` with several teachers: the teacher scores the rows whose
    ``data.reward_fn_key`` column (``data_source`` by default) equals this value. Null: every row
    (one teacher only)."""

    enable_resource_pool: bool = False
    """false: the teacher's engine lives in the actor's processes, one per rollout replica beside the
    rollout's engine, at the rollout's TP. true: a Ray resource pool of its own,
    ``nnodes x n_gpus_per_node`` processes (CPU processes in CPU mode), one engine per
    ``inference.tensor_model_parallel_size`` of them. Every teacher shares one placement."""

    n_gpus_per_node: int = 0
    """Devices (CPU mode: processes) per node of the teacher pool (``enable_resource_pool=true``)."""

    nnodes: int = 0
    """Nodes of the teacher pool (``enable_resource_pool=true``)."""

    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)
    """The teacher's vLLM engine."""


@dataclass
class DistillationLossConfig:
    """``distillation.distillation_loss``: how the teacher's log-probs enter the actor's loss."""

    loss_mode: DistillationLossMode = DistillationLossMode.k3
    """Per-token divergence: the KL estimators over the sampled token with the teacher as the
    reference (k1/kl: ``log p_s - log p_t``; abs; k2/mse: ``(log p_s - log p_t)^2 / 2``;
    k3/low_var_kl: ``exp(log p_t - log p_s) - (log p_t - log p_s) - 1``), or forward_kl_topk:
    ``sum_k p_t(k) (log p_t(k) - log p_s(k))`` over the teacher's ``topk`` likeliest tokens."""

    topk: int | None = 128
    """forward_kl_topk: how many of the teacher's likeliest tokens per position (vLLM returns them
    as prompt log-probs; its ``max_logprobs`` is raised to match). Unused by the other modes."""

    use_task_rewards: bool = True
    """true: the loss is the task's policy loss plus ``distillation_loss_coef`` x the distillation
    loss. false: the distillation loss alone (the task reward is still computed and logged)."""

    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss beside the task's policy loss (``use_task_rewards``)."""

    loss_max_clamp: float | None = 10.0
    """Per-token losses are clamped to ``[-loss_max_clamp, loss_max_clamp]``; null: no clamp."""

    log_prob_min_clamp: float | None = -10.0
    """The student's and the teacher's log-probs are raised to at least this before the loss (a
    token either side finds nearly impossible would dominate; a raised student log-prob passes no
    gradient); null: no clamp."""

    use_policy_gradient: bool = True
    """true: the negative (clamped) per-token loss is a per-token advantage through the PPO
    surrogate (Thinking Machines' on-policy distillation; use k1). false: the loss is
    backpropagated directly (GKD; use k3 or forward_kl_topk; k1 is refused: its gradient does
    not depend on the teacher)."""

    policy_loss_mode: str = "vanilla"
    """The surrogate of ``use_policy_gradient``; vanilla (PPO's clipped ratio) only, as verl."""

    clip_ratio: float = 0.2
    """PPO clip of the distillation surrogate."""

    clip_ratio_low: float = 0.2
    """Lower clip (``1 - clip_ratio_low``) of the distillation surrogate."""

    clip_ratio_high: float = 0.2
    """Upper clip (``1 + clip_ratio_high``) of the distillation surrogate."""

    def validate(self, key: str) -> list[str]:
        out = []
        if not self.use_policy_gradient and self.loss_mode in ESTIMATOR_FREE_OF_TEACHER:
            out.append(
                f"{key}.loss_mode={self.loss_mode} with {key}.use_policy_gradient=false: k1's gradient is "
                "grad log p_student, which does not depend on the teacher; use loss_mode=k3 or "
                "forward_kl_topk, or use_policy_gradient=true"
            )
        if self.policy_loss_mode != "vanilla":
            out.append(f"{key}.policy_loss_mode={self.policy_loss_mode!r}: only 'vanilla' is supported")
        if self.loss_mode == "forward_kl_topk" and (self.topk is None or self.topk < 1):
            out.append(f"{key}.topk={self.topk} must be >= 1 with loss_mode=forward_kl_topk")
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            out.append(f"{key}.loss_max_clamp={self.loss_max_clamp} must be > 0 (null: no clamp)")
        if self.log_prob_min_clamp is not None and not self.log_prob_min_clamp < 0:
            out.append(f"{key}.log_prob_min_clamp={self.log_prob_min_clamp} must be < 0 (null: no clamp)")
        if self.distillation_loss_coef < 0:
            out.append(f"{key}.distillation_loss_coef={self.distillation_loss_coef} must be >= 0")
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            if not getattr(self, name) > 0:
                out.append(f"{key}.{name}={getattr(self, name)} must be > 0")
        return out


@dataclass
class DistillationConfig:
    """``distillation``: on-policy distillation (verl's ``DistillationConfig``). Off by default."""

    enabled: bool = False
    """Score the student's samples with the teacher(s) and add the distillation loss."""

    num_workers: int = 8
    """verl's teacher replica count. Here the replicas follow the placement (one per rollout replica
    in the actor's processes; one per ``inference.tensor_model_parallel_size`` processes of a pool):
    verl's default 8 is accepted, any other count is refused (it could not be honoured)."""

    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    """The teacher (verl's single-teacher form)."""

    teacher_models: dict[str, TeacherModelConfig] = field(default_factory=dict)
    """Several teachers by name (verl's newer form); each scores the rows its ``key`` selects.
    Use this or ``teacher_model``, not both."""

    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The loss."""

    def teachers(self) -> dict[str, TeacherModelConfig]:
        """Every teacher by name (``teacher_model`` is ``teacher_model``); empty when disabled."""
        if not self.enabled:
            return {}
        if self.teacher_models:
            return dict(self.teacher_models)
        return {"teacher_model": self.teacher_model}

    def pooled(self) -> bool:
        """Whether the teachers run on a resource pool of their own (else in the actor's processes)."""
        return any(t.enable_resource_pool for t in self.teachers().values())

    def in_actor(self) -> bool:
        """Whether teachers run in the actor's processes, at the rollout's TP (enabled, no pool)."""
        return bool(self.teachers()) and not self.pooled()

    def pool_shape(self) -> tuple[int, int]:
        """``(nnodes, n_gpus_per_node)`` of the teacher pool (every teacher shares it)."""
        first = next(iter(self.teachers().values()))
        return first.nnodes, first.n_gpus_per_node

    def teacher_key(self, name: str) -> str:
        """The dotted key of teacher ``name``."""
        if name == "teacher_model" and not self.teacher_models:
            return "distillation.teacher_model"
        return f"distillation.teacher_models.{name}"

    def validate(self, key: str = "distillation", *, rollout_tp: int = 1, context_len: int = 0) -> list[str]:
        """One form of teachers, each with a model, a vLLM engine and (several) distinct keys; a
        teacher in the actor's processes at the rollout's TP; a context that holds a prompt, a
        response and one token; the loss's own rules. ``rollout_tp``: the rollout's TP;
        ``context_len``: prompt + response length. Nothing is checked while disabled."""
        if not self.enabled:
            return []
        out = []
        if self.num_workers != 8:
            out.append(
                f"{key}.num_workers={self.num_workers}: the teacher replicas follow their placement here "
                f"(one per rollout replica in the actor's processes, or one per {key}.teacher_model"
                ".inference.tensor_model_parallel_size processes of its pool); remove the key or leave "
                "it at verl's default 8"
            )
        if self.teacher_models and self.teacher_model.model_path:
            out.append(
                f"{key}.teacher_model.model_path and {key}.teacher_models are both set; use one form "
                f"({key}.teacher_models.<name>.model_path for several teachers)"
            )
        teachers = self.teachers()
        keys = [t.key for t in teachers.values()]
        if len(teachers) > 1 and (None in keys or len(set(keys)) != len(keys)):
            out.append(
                f"{key}.teacher_models has {len(teachers)} teachers with keys {keys}: each needs its own "
                "key (the data.reward_fn_key value of the rows it scores)"
            )
        placements = {
            (t.enable_resource_pool, t.n_gpus_per_node, t.nnodes, t.inference.tensor_model_parallel_size)
            for t in teachers.values()
        }
        if len(placements) > 1:
            out.append(
                f"{key}.teacher_models: every teacher must share enable_resource_pool, n_gpus_per_node, nnodes and "
                "inference.tensor_model_parallel_size (one placement hosts every teacher's engine)"
            )
        for name, teacher in teachers.items():
            where = self.teacher_key(name)
            out += _teacher_problems(where, teacher, rollout_tp, context_len)
        return out + self.distillation_loss.validate(f"{key}.distillation_loss")


def _teacher_problems(
    where: str, teacher: TeacherModelConfig, rollout_tp: int, context_len: int
) -> list[str]:
    out = []
    if not teacher.model_path:
        out.append(
            f"{where}.model_path is required when distillation.enabled=true: the teacher's HF directory"
        )
    inference = teacher.inference
    if inference.name != "vllm":
        out.append(f"{where}.inference.name={inference.name!r}: the teacher runs on vllm only")
    tp = inference.tensor_model_parallel_size
    if tp is not None and tp < 1:
        out.append(f"{where}.inference.tensor_model_parallel_size={tp} must be >= 1 (null: the rollout's)")
    elif not teacher.enable_resource_pool and tp is not None and tp != rollout_tp:
        out.append(
            f"{where}.inference.tensor_model_parallel_size={tp} differs from the rollout's {rollout_tp}: a "
            "teacher in the actor's processes shares vLLM's parallel groups with the rollout; set it to "
            f"{rollout_tp} (or null), or {where}.enable_resource_pool=true"
        )
    if teacher.enable_resource_pool:
        for name in ("n_gpus_per_node", "nnodes"):
            if getattr(teacher, name) < 1:
                out.append(
                    f"{where}.{name}={getattr(teacher, name)} must be >= 1 with enable_resource_pool=true"
                )
        size = teacher.n_gpus_per_node * teacher.nnodes
        if size >= 1 and isinstance(tp, int) and tp >= 1 and size % tp:
            out.append(
                f"{where}.inference.tensor_model_parallel_size={tp} does not divide the teacher pool's {size} "
                "processes (nnodes x n_gpus_per_node)"
            )
    if inference.max_model_len is not None and inference.max_model_len < context_len + 1:
        out.append(
            f"{where}.inference.max_model_len={inference.max_model_len} cannot hold a prompt and a full response "
            f"({context_len} tokens: data.max_prompt_length + data.max_response_length) plus the one token vLLM "
            f"generates; set it to at least {context_len + 1} (or null)"
        )
    if inference.max_num_seqs < 1:
        out.append(f"{where}.inference.max_num_seqs={inference.max_num_seqs} must be >= 1")
    return out
