"""verl's further estimators: OPO and GPG advantages, the grpo/rloo ``_vectorized`` names, and
the ``+`` (straight-through k2 gradient) KL estimators; each against its formula in Python floats."""

import math

import numpy as np
import pytest
import torch

from rlhf_megatron.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    compute_advantage,
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    kl_penalty,
)

from . import reference as ref

F64 = torch.float64


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = ref.ragged_mask(7, 5, g, min_len=1).to(F64)
    rewards = torch.randn(7, 5, generator=g, dtype=F64) * mask
    rewards[2] = 0.0  # a zero-score response, which GPG's alpha counts
    index = np.array(["a", "a", "b", "b", "b", "c", "a"])  # c is a group of one
    return rewards, mask, index


def _scores_and_groups(rewards, mask, index):
    scores = [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards.tolist(), mask.tolist())]
    lengths = [sum(mm) for mm in mask.tolist()]
    groups = {k: [i for i, x in enumerate(index) if x == k] for k in set(index)}
    return scores, lengths, groups


def _per_row(adv, mask):
    """The single value each valid row carries, after checking it is constant and 0 on padding."""
    out = []
    for a_row, m_row in zip(adv.tolist(), mask.tolist()):
        vals = {round(a, 12) for a, m in zip(a_row, m_row) if m}
        assert len(vals) == 1 and all(a == 0 for a, m in zip(a_row, m_row) if not m)
        out.append(next(a for a, m in zip(a_row, m_row) if m))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_opo_is_score_minus_length_weighted_group_mean(seed):
    rewards, mask, index = _batch(seed)
    adv, ret = compute_advantage("opo", token_level_rewards=rewards, response_mask=mask, index=index)
    scores, lengths, groups = _scores_and_groups(rewards, mask, index)
    expected = []
    for i, k in enumerate(index):
        members = groups[k]
        b = (
            sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
            if len(members) > 1
            else 0.0
        )
        expected.append(scores[i] - b)
    assert _per_row(adv, mask) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert ret is adv


@pytest.mark.parametrize("seed", [0, 1])
def test_gpg_is_alpha_times_group_centred_score(seed):
    rewards, mask, index = _batch(seed)
    adv, _ = compute_advantage("gpg", token_level_rewards=rewards, response_mask=mask, index=index)
    scores, _, groups = _scores_and_groups(rewards, mask, index)
    alpha = len(scores) / max(1, sum(s != 0 for s in scores))
    assert alpha > 1  # the zero-score row is counted out
    expected = []
    for i, k in enumerate(index):
        members = groups[k]
        mean = sum(scores[j] for j in members) / len(members) if len(members) > 1 else 0.0
        expected.append(alpha * (scores[i] - mean))
    assert _per_row(adv, mask) == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_vectorized_names_are_grpo_and_rloo():
    assert ADV_ESTIMATOR_REGISTRY["grpo_vectorized"] is compute_grpo_outcome_advantage
    assert ADV_ESTIMATOR_REGISTRY["rloo_vectorized"] is compute_rloo_outcome_advantage


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"])
def test_plus_suffix_keeps_the_value_and_takes_k2s_gradient(name):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 4, generator=g, dtype=F64) * 2).requires_grad_()
    ref_lp = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    plain = kl_penalty(lp, ref_lp, name)
    plus = kl_penalty(lp, ref_lp, name + "+")
    torch.testing.assert_close(plus, plain.detach())
    plus.sum().backward()
    d = (lp.detach() - ref_lp).tolist()
    torch.testing.assert_close(lp.grad, torch.tensor(d, dtype=F64))  # d/dlp of 0.5 (lp - ref)^2
    if name in ("low_var_kl", "k3"):
        # and k3's own gradient, 1 - exp(ref - lp), is not that
        lp.grad = None
        kl_penalty(lp, ref_lp, name).sum().backward()
        expected = [[1 - math.exp(-x) for x in row] for row in d]
        torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=F64))


def test_plus_suffix_is_refused_for_full():
    lp = torch.zeros(1, 2, 3, dtype=F64)
    with pytest.raises(ValueError, match="unknown kl_penalty 'full\\+'"):
        kl_penalty(lp, lp, "full+")
