"""Pure RL math for LLM training: advantage estimators, KL estimators and controllers,
policy / value / entropy losses, loss aggregation, and masked statistics.

Everything takes tensors of shape ``(B, T)`` (batch, response length) with a
``response_mask`` and returns tensors; nothing here knows about torch.distributed, Ray
or Megatron, so every function runs and is tested on CPU. Estimators and policy losses
are looked up by the names used in verl configs (``get_adv_estimator("grpo")``,
``get_policy_loss_fn("vanilla")``).

Modules:
    utils            masked mean / var / whiten and the input checks
    scan             the reverse linear recurrence behind GAE and REINFORCE++
    grouping         prompt-group ids and per-group statistics
    adv_registry     estimator registry and ``compute_advantage`` dispatch
    advantages       GAE, REINFORCE++, ReMax
    group_advantages GRPO (+ Dr. GRPO, Pass@k), RLOO, REINFORCE++-baseline, OPO, GPG
    kl               KL estimators, fixed / adaptive controllers, in-reward penalty
    distillation     on-policy distillation: per-token student-teacher losses, as reward or loss
    losses           ``agg_loss``, value loss, entropy
    policy_losses    policy-loss registry: vanilla PPO, GSPO, KL-Cov
    policy_loss_variants  CISPO, SAPO, GPG, DRO, GMPO, Clip-Cov, DPPO-TV/KL (verl's names)
    rollout_correction truncated importance weights rollout -> actor (TIS); the driver's batch call
    reward_loss      the reward model's pairwise (Bradley-Terry) loss
"""

# Importing the estimator and loss modules registers them; keep these imports.
from rlhf_megatron.algorithms.adv_registry import (
    ADV_ESTIMATOR_REGISTRY,
    compute_advantage,
    estimator_needs_critic,
    get_adv_estimator,
    register_adv_estimator,
)
from rlhf_megatron.algorithms.advantages import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from rlhf_megatron.algorithms.distillation import (
    DISTILLATION_LOSS_MODES,
    compute_distillation_loss,
    distillation_token_losses,
)
from rlhf_megatron.algorithms.group_advantages import (
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from rlhf_megatron.algorithms.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from rlhf_megatron.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
)
from rlhf_megatron.algorithms.policy_loss_variants import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_sapo,
)
from rlhf_megatron.algorithms.policy_losses import (
    POLICY_LOSS_REGISTRY,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    get_policy_loss_fn,
    register_policy_loss,
)
from rlhf_megatron.algorithms.reward_loss import bradley_terry_loss
from rlhf_megatron.algorithms.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    apply_rollout_correction,
    compute_rollout_is_weights,
)
from rlhf_megatron.algorithms.utils import masked_mean, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "DISTILLATION_LOSS_MODES",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "apply_rollout_correction",
    "bradley_terry_loss",
    "compute_advantage",
    "compute_distillation_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_kl_cov",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_is_weights",
    "compute_value_loss",
    "distillation_token_losses",
    "entropy_from_logits",
    "estimator_needs_critic",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
]
