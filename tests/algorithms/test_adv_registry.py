"""Estimator registry, dispatch by name, and the critic query."""

import numpy as np
import pytest
import torch

from rlhf_megatron.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_remax_outcome_advantage,
    estimator_needs_critic,
    get_adv_estimator,
    register_adv_estimator,
)

REQUIRED = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "grpo_passk",
]


def _batch():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, 5, generator=g)
    mask = torch.ones(8, 5)
    mask[3, 2:] = 0
    return rewards, mask, torch.randn(8, 5, generator=g), np.repeat(np.arange(4), 2)


@pytest.mark.parametrize("name", REQUIRED)
def test_required_names_are_registered(name):
    assert get_adv_estimator(name) is ADV_ESTIMATOR_REGISTRY[name]


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*gae.*grpo.*remax.*rloo"):
        get_adv_estimator("ppo")


def test_only_gae_needs_a_critic():
    assert {name: estimator_needs_critic(name) for name in REQUIRED} == {
        name: name == "gae" for name in REQUIRED
    }
    with pytest.raises(ValueError, match="known estimators"):
        estimator_needs_critic("nope")


def test_compute_advantage_dispatches_with_the_right_inputs():
    rewards, mask, values, index = _batch()
    adv, ret = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, index=index, gamma=0.9, lam=0.8
    )
    exp_adv, exp_ret = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)

    adv, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(adv, compute_grpo_outcome_advantage(rewards, mask, index, 1e-6, False)[0])

    baselines = torch.randn(8)
    adv, _ = compute_advantage(
        "remax", token_level_rewards=rewards, response_mask=mask, reward_baselines=baselines
    )
    torch.testing.assert_close(adv, compute_remax_outcome_advantage(rewards, baselines, mask)[0])


@pytest.mark.parametrize(
    "name,message",
    [
        ("gae", r"gae needs values \(critic\)"),
        ("grpo", r"grpo needs index \(group ids\)"),
        ("rloo", r"rloo needs index"),
        ("remax", r"remax needs reward_baselines"),
    ],
)
def test_compute_advantage_reports_missing_inputs(name, message):
    rewards, mask, _, _ = _batch()
    with pytest.raises(ValueError, match=message):
        compute_advantage(name, token_level_rewards=rewards, response_mask=mask)


def test_register_custom_estimator_and_reject_duplicates():
    def constant(token_level_rewards, response_mask, epsilon=1e-6):
        out = torch.full_like(token_level_rewards, 2.0) * response_mask
        return out, out

    try:
        register_adv_estimator("test_constant")(constant)
        rewards, mask, _, _ = _batch()
        adv, _ = compute_advantage("test_constant", token_level_rewards=rewards, response_mask=mask)
        torch.testing.assert_close(adv, 2.0 * mask)
        assert estimator_needs_critic("test_constant") is False
        register_adv_estimator("test_constant")(constant)  # same function again: allowed
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_constant")(lambda token_level_rewards, response_mask: None)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_constant", None)
