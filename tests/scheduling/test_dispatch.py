"""Dispatch declared on worker methods: what ``WorkerGroup.call`` reads, without Ray."""

import pytest

from rlhf_megatron.scheduling.dispatch import Dispatch, DispatchSpec, dispatch, dispatch_spec


class _Worker:
    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def generate(self, batch): ...

    @dispatch(Dispatch.RANK0)
    def sync(self): ...

    def save(self, path): ...


class _Child(_Worker):
    pass


def test_declared_modes_and_the_all_ranks_default():
    assert dispatch_spec(_Worker, "generate") == DispatchSpec(Dispatch.DP_COMPUTE, "rollout")
    assert dispatch_spec(_Worker, "sync") == DispatchSpec(Dispatch.RANK0, "megatron")
    assert dispatch_spec(_Worker, "save") == DispatchSpec(Dispatch.ALL, "megatron")
    assert dispatch_spec(_Child, "generate").mode is Dispatch.DP_COMPUTE, "a subclass keeps the declaration"


def test_unknown_method_and_mode_are_refused():
    with pytest.raises(AttributeError, match="_Worker has no method 'generat'"):
        dispatch_spec(_Worker, "generat")
    with pytest.raises(ValueError):
        dispatch("by_row")


def test_the_roles_declare_what_the_trainer_relies_on():
    from rlhf_megatron.workers.actor import ActorRolloutRefWorker
    from rlhf_megatron.workers.critic import CriticWorker, RewardModelWorker
    from rlhf_megatron.workers.rollout import RolloutWorker

    dp, rollout_dp = DispatchSpec(Dispatch.DP_COMPUTE), DispatchSpec(Dispatch.DP_COMPUTE, "rollout")
    expected = {
        (ActorRolloutRefWorker, "generate_sequences"): rollout_dp,
        (ActorRolloutRefWorker, "compute_log_prob"): dp,
        (ActorRolloutRefWorker, "compute_ref_log_prob"): dp,
        (ActorRolloutRefWorker, "update_actor"): dp,
        (ActorRolloutRefWorker, "update_weights"): DispatchSpec(Dispatch.RANK0),
        (ActorRolloutRefWorker, "send_weights"): DispatchSpec(Dispatch.RANK0),
        (ActorRolloutRefWorker, "save_checkpoint"): DispatchSpec(Dispatch.ALL),
        (ActorRolloutRefWorker, "node_info"): DispatchSpec(Dispatch.RANK0),
        (CriticWorker, "compute_values"): dp,
        (CriticWorker, "update_critic"): dp,
        (RewardModelWorker, "compute_rm_score"): dp,
        (RolloutWorker, "generate_sequences"): rollout_dp,
        (RolloutWorker, "continue_sequences"): rollout_dp,
        (RolloutWorker, "receive_weights"): DispatchSpec(Dispatch.RANK0),
    }
    assert {key: dispatch_spec(*key) for key in expected} == expected
