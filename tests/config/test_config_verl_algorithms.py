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
            [f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=1", f"{RC}.bypass_mode=true"],
            [
                f"{RC}.bypass_mode=true takes the rollout's log-probs as the old policy, so {RC}.rollout_rs=token_k2"
            ],
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides, expected):
    errors = _errors(*overrides)
    assert len(errors) == len(expected), errors
    for err, start in zip(errors, expected):
        assert start in err
