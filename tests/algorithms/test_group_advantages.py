"""GRPO, Dr. GRPO, Pass@k, RLOO and REINFORCE++-baseline."""

import numpy as np
import pytest
import torch

from rlhf_megatron.algorithms import (
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)

from . import reference as ref

F64 = torch.float64


def _outcome_rewards(scores, steps=3, lengths=None):
    """(B, T) rewards with each score on the last valid token, and the matching mask."""
    batch = len(scores)
    lengths = lengths or [steps] * batch
    rewards = torch.zeros(batch, steps, dtype=F64)
    mask = torch.zeros(batch, steps, dtype=F64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def _per_row(adv):
    """The per-response advantage (first column) of a (B, T) result."""
    return adv[:, 0]


def test_grpo_hand_computed():
    # group a: [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3); group b: singleton; group c: all equal.
    rewards, mask = _outcome_rewards([1, 0, 0, 1, 0.7, 2, 2])
    index = np.array(["a", "a", "a", "a", "b", "c", "c"], dtype=object)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    k = 0.5 / (3**-0.5 + 1e-6)
    torch.testing.assert_close(
        _per_row(adv), torch.tensor([k, -k, -k, k, 0.7 / (1 + 1e-6), 0.0, 0.0], dtype=F64)
    )
    assert ret is adv or torch.equal(ret, adv)
    assert (adv == adv[:, :1]).all()  # broadcast over tokens


def test_dr_grpo_is_mean_centred_only():
    rewards, mask = _outcome_rewards([1, 0, 0, 1, 0.7])
    adv, _ = compute_grpo_outcome_advantage(
        rewards, mask, np.array([3, 3, 3, 3, 8]), norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(_per_row(adv), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.7], dtype=F64))


def test_grpo_zero_variance_group_gives_exact_zero_in_float32():
    scores = [0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    rewards, mask = _outcome_rewards(scores)
    adv, _ = compute_grpo_outcome_advantage(rewards.float(), mask.float(), np.array([0] * 3 + [1] * 6))
    assert adv.dtype == torch.float32
    assert torch.isfinite(adv).all()
    assert (adv == 0).all()


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference_loop(norm):
    g = torch.Generator().manual_seed(0)
    batch, steps = 64, 9
    rewards = torch.randn(batch, steps, generator=g, dtype=F64)
    mask = ref.ragged_mask(batch, steps, g).double()  # includes all-masked rows (score 0)
    index = np.array([f"prompt-{i}" for i in torch.randint(0, 13, (batch,), generator=g).tolist()])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, torch.tensor(ref.grpo(rewards, mask, list(index), norm=norm), dtype=F64))


def test_grpo_accepts_lists_tensors_and_mixed_id_types():
    rewards, mask = _outcome_rewards([1.0, 3.0, 5.0, 5.0])
    expected, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]))
    for index in ([7, 7, "x", "x"], torch.tensor([4, 4, 2, 2]), ("a", "a", "b", "b")):
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
        torch.testing.assert_close(adv, expected)


def test_grpo_ignores_rewards_on_padding():
    rewards, mask = _outcome_rewards([1.0, 0.0], steps=3, lengths=[2, 2])
    rewards[0, 2] = 100.0  # outside the response
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([0, 0]))
    k = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[k, k, 0.0], [-k, -k, 0.0]], dtype=F64))


def test_grpo_index_length_mismatch_names_both_shapes():
    rewards, mask = _outcome_rewards([1.0, 2.0, 3.0])
    with pytest.raises(
        ValueError, match=r"index has shape \(2,\) but token_level_rewards has shape \(3, 3\)"
    ):
        compute_grpo_outcome_advantage(rewards, mask, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"response_mask has shape \(3, 4\).*\(3, 3\)"):
        compute_grpo_outcome_advantage(rewards, torch.ones(3, 4, dtype=F64), np.array([0, 1, 1]))


def test_rloo_hand_computed():
    # group [1, 0, 0]: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5. Singleton keeps its score.
    rewards, mask = _outcome_rewards([1, 0, 0, 0.7, 2, 2])
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, np.array([0, 0, 0, 1, 2, 2]))
    torch.testing.assert_close(_per_row(adv), torch.tensor([1.0, -0.5, -0.5, 0.7, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(ret, adv)


def test_rloo_matches_reference_loop():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(40, 6, generator=g, dtype=F64)
    mask = ref.ragged_mask(40, 6, g).double()
    index = torch.randint(0, 9, (40,), generator=g).numpy()
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref.rloo(rewards, mask, index.tolist()), dtype=F64))


def test_reinforce_pp_baseline_hand_computed():
    # scores [1, 0] in one group (mean 0.5) and a singleton 2.0; one token each.
    rewards, mask = _outcome_rewards([1.0, 0.0, 2.0], steps=1)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array([0, 0, 1]))
    # centred [0.5, -0.5, 2.0]: mean 2/3, unbiased var = (1/36 + 49/36 + 64/36) / 2 = 19/12
    centred = torch.tensor([0.5, -0.5, 2.0], dtype=F64)
    expected = (centred - 2 / 3) / torch.sqrt(torch.tensor(19 / 12, dtype=F64) + 1e-8)
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(ret, adv)


def test_reinforce_pp_baseline_matches_reference_loop():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(30, 7, generator=g, dtype=F64)
    mask = ref.ragged_mask(30, 7, g, min_len=1).double()
    index = torch.randint(0, 6, (30,), generator=g).numpy()
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    expected = ref.reinforce_pp_baseline(rewards, mask, index.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64))


def test_grpo_passk_hand_computed():
    # group 0: [0.2, 0.9, 0.5] -> best is row 1 with 0.9 - 0.5 = 0.4; group 1: tie -> 0.
    rewards, mask = _outcome_rewards([0.2, 0.9, 0.5, 1.0, 1.0])
    index = np.array([0, 0, 0, 1, 1])
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(_per_row(adv), torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0], dtype=F64))
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index)
    std = torch.tensor([0.2, 0.9, 0.5], dtype=F64).std()
    assert adv[1, 0].item() == pytest.approx(0.4 / (std.item() + 1e-6))


def test_grpo_passk_matches_reference_and_rejects_singletons():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(24, 5, generator=g, dtype=F64)
    mask = ref.ragged_mask(24, 5, g, min_len=1).double()
    index = np.repeat(np.arange(6), 4)[torch.randperm(24, generator=g).numpy()]
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref.grpo_passk(rewards, mask, index.tolist()), dtype=F64))
    with pytest.raises(ValueError, match="at least 2 responses per group"):
        compute_grpo_passk_outcome_advantage(rewards[:3], mask[:3], np.array([0, 0, 1]))


def test_large_batch_grpo_matches_reference():
    """The vectorised path at a size where a per-sample loop would be slow to write by hand."""
    g = torch.Generator().manual_seed(4)
    batch = 4096
    rewards, mask = _outcome_rewards((torch.rand(batch, generator=g) < 0.5).double().tolist(), steps=2)
    index = np.repeat(np.arange(batch // 16), 16)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv, torch.tensor(ref.grpo(rewards, mask, index.tolist()), dtype=F64))
