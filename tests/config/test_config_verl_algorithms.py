"""verl's newer algorithm keys through the real loading and validation path: policy-loss modes
and their options, rollout rejection and IcePop thresholds, the new estimators, ``+`` KL names."""

from __future__ import annotations

import pytest
from cfg_helpers import make_cfg

from rlhf_megatron.config import ConfigError
from rlhf_megatron.planning import validate_config

A = "actor_rollout_ref.actor"
RC = "algorithm.rollout_correction"


def _errors(*overrides: str) -> list[str]:
    try:
        validate_config(make_cfg(*overrides))
    except ConfigError as exc:
        return exc.errors
    return []


def test_verl_keys_load_and_validate():
    overrides = (
        f"{A}.policy_loss.loss_mode=clip_cov",
        f"{A}.policy_loss.clip_cov_ratio=0.001",
        f"{A}.tau_neg=2.0",
        f"{A}.kl_loss_type=low_var_kl+",
        "algorithm.adv_estimator=gpg",
        "actor_rollout_ref.rollout.n=4",  # a group estimator
        f"{RC}.rollout_is=token",
        f"{RC}.rollout_is_threshold=0.5_2.0",
        f"{RC}.rollout_rs=token_k1,seq_mean_k3",
        f"{RC}.rollout_rs_threshold=0.5_2.0,0.01",
    )
    assert _errors(*overrides) == []
    cfg = make_cfg(*overrides)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.policy_loss.clip_cov_ratio, actor.tau_neg) == (
        "clip_cov",
        0.001,
        2.0,
    )
    corr = cfg.algorithm.rollout_correction
    assert (corr.rollout_is_threshold, corr.rollout_rs_threshold) == ("0.5_2.0", "0.5_2.0,0.01")


@pytest.mark.parametrize("mode", ["cispo", "sapo", "gpg", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl"])
def test_each_new_loss_mode_is_accepted(mode):
    assert _errors(f"{A}.policy_loss.loss_mode={mode}") == []


def test_defaults_are_verls():
    cfg = make_cfg()
    pl, actor = cfg.actor_rollout_ref.actor.policy_loss, cfg.actor_rollout_ref.actor
    assert (pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub) == (0.0002, 1.0, 5.0)
    assert (pl.kl_cov_ratio, pl.ppo_kl_coef, pl.dro_beta) == (0.0002, 0.1, None)
    assert (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [f"{A}.policy_loss.loss_mode=dro"],
            [f"{A}.policy_loss.dro_beta=None: {A}.policy_loss.loss_mode=dro needs"],
        ),
        ([f"{A}.policy_loss.loss_mode=ppo3"], [f"{A}.policy_loss.loss_mode='ppo3'"]),
        ([f"{A}.tau_pos=0"], [f"{A}.tau_pos=0.0 must be > 0"]),
        (
            [f"{RC}.rollout_is_threshold=2.0_0.5"],
            [f"{RC}.rollout_is_threshold='2.0_0.5': IcePop's 'lo_hi' needs"],
        ),
        ([f"{RC}.rollout_is_threshold=abc"], [f"{RC}.rollout_is_threshold: threshold 'abc' is not a number"]),
        ([f"{RC}.rollout_rs=token_k1"], [f"{RC}.rollout_rs_threshold is required"]),
        (
            [f"{RC}.rollout_rs=seq_max_k1", f"{RC}.rollout_rs_threshold=2"],
            [
                f"{RC}.rollout_rs='seq_max_k1': unknown option(s) seq_max_k1; give a comma-separated list of: token_k1"
            ],
        ),
        (
            [f"{RC}.rollout_rs=token_k2,token_k3", f"{RC}.rollout_rs_threshold=1,2,3"],
            [f"{RC}.rollout_rs_threshold='1,2,3' gives 3 thresholds for 2 options"],
        ),
        (
            [f"{RC}.loss_type=reinforce"],
            [
                f"{RC}.loss_type=reinforce is the bypass mode's loss (it weights by pi_theta / pi_rollout "
                f"at loss time, against the rollout's log-probs as the old policy); set {RC}.bypass_mode=true, "
                f"or {RC}.loss_type=ppo_clip"
            ],
        ),
        (
            [f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token"],
            [f"{RC}.loss_type=reinforce is the bypass mode's loss"],
        ),
        (
            [f"{RC}.bypass_mode=true", f"{RC}.rollout_is=sequence"],
            [
                f"{RC}.bypass_mode=true takes the rollout's log-probs as the old policy, so "
                f"{RC}.rollout_is=sequence would weight every token by exp(0) = 1 (and PPO's ratio is already "
                f"pi_theta / pi_rollout); set rollout_is=null with bypass_mode, {RC}.loss_type=reinforce"
            ],
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides, expected):
    errors = _errors(*overrides)
    assert len(errors) == len(expected), errors
    for err, start in zip(errors, expected):
        assert start in err


def test_loss_type_defaults_to_ppo_clip_and_refuses_unknown_values():
    assert make_cfg().algorithm.rollout_correction.loss_type == "ppo_clip"
    with pytest.raises(ConfigError) as exc:
        make_cfg(f"{RC}.loss_type=reinforce_plus")
    assert f"{RC}.loss_type='reinforce_plus' is not one of: ppo_clip, reinforce" in str(exc.value)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=1"], id="ppo_clip-rs"),
        pytest.param([f"{RC}.loss_type=reinforce"], id="reinforce"),
        pytest.param([f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence"], id="reinforce-seq-is"),
        pytest.param(
            [
                f"{RC}.loss_type=reinforce",
                f"{RC}.rollout_is=token",
                f"{RC}.rollout_is_threshold=0.5_2.0",
                f"{RC}.rollout_rs=seq_mean_k1",
                f"{RC}.rollout_rs_threshold=0.999_1.001",
            ],
            id="reinforce-icepop-rs",
        ),
    ],
)
def test_bypass_mode_accepts_verls_presets(overrides):
    """verl's bypass_ppo_clip_geo_rs, bypass_pg_is, bypass_pg_token_icepop, bypass_pg_geo_rs..."""
    assert _errors(f"{RC}.bypass_mode=true", *overrides) == []


def test_the_actor_receives_the_rollout_correction_through_the_run_context():
    from rlhf_megatron.config.context import RunContext
    from rlhf_megatron.config.schema import RolloutCorrectionConfig

    cfg = make_cfg(f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token")
    corr = RunContext.from_config(cfg, total_steps=1).rollout_correction
    assert isinstance(corr, RolloutCorrectionConfig)
    assert (corr.bypass_mode, corr.loss_type, corr.rollout_is) == (True, "reinforce", "token")
    assert RunContext.from_config(make_cfg(), total_steps=1).rollout_correction.loss_type == "ppo_clip"
