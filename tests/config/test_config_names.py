"""The config's fallback algorithm names agree with the algorithm registries."""

from __future__ import annotations

import pytest

from rlhf_megatron.config import names


def test_fallback_names_agree_with_the_algorithms_registries():
    algorithms = pytest.importorskip("rlhf_megatron.algorithms")
    assert set(names.KNOWN_ADV_ESTIMATORS) == set(algorithms.ADV_ESTIMATOR_REGISTRY)
    assert set(names.KNOWN_KL_PENALTIES) == set(algorithms.KL_PENALTY_NAMES)
    assert set(names.KNOWN_POLICY_LOSS_MODES) == set(algorithms.POLICY_LOSS_REGISTRY)
    assert set(names.KNOWN_LOSS_AGG_MODES) == set(algorithms.LOSS_AGG_MODES)


def test_group_estimators_are_known_estimators():
    assert set(names.KNOWN_ADV_ESTIMATORS) >= names.GROUP_ADV_ESTIMATORS


def test_fallback_is_used_when_algorithms_cannot_be_imported(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rlhf_megatron.algorithms", None)
    assert names.registry_names("adv_estimator") == names.KNOWN_ADV_ESTIMATORS
    assert names.registry_names("loss_agg_mode") == names.KNOWN_LOSS_AGG_MODES


def test_critic_estimators_match_the_registry_view():
    algorithms = pytest.importorskip("rlhf_megatron.algorithms")
    needs_critic = {n for n in algorithms.ADV_ESTIMATOR_REGISTRY if algorithms.estimator_needs_critic(n)}
    assert needs_critic == {"gae"}  # roles.critic_used assumes exactly this
