"""The rollout as the driver sees it: generations and weight pushes over worker groups.

``RolloutClient`` is the narrow interface the rollout scheduler (``rollout_scheduler.py``) drives,
the ``Rollout`` protocol there: submit a generation, a continuation (partial rollout) or new
weights, wait for a generation, interrupt the ones in flight. Colocated, the actor's own
processes generate and sync through their engine; disaggregated, a rollout pool generates and
receives the weights streamed from the trainer's rank 0.

Boundaries: knows worker groups and ``Batch``; nothing of steps, versions or staleness (the
scheduler's) or of the PPO step (the trainer's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.scheduling.worker_group import PendingCall, WorkerGroup, wait_all
from rlhf_megatron.trainer.rollout_scheduler import VERSION_KEY

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the driver needs the worker classes' names, not megatron or vLLM
    from rlhf_megatron.workers.actor import ActorRolloutRefWorker
    from rlhf_megatron.workers.rollout import InterruptSignal, RolloutWorker


class RolloutClient:
    """Generations and weight pushes, colocated (``rollout`` None) or on a pool of their own."""

    def __init__(
        self,
        actor: WorkerGroup[ActorRolloutRefWorker],
        rollout: WorkerGroup[RolloutWorker] | None = None,
        interrupts: InterruptSignal | None = None,
        restart: Callable[[], WorkerGroup[RolloutWorker]] | None = None,
        max_restarts: int = 0,
    ):
        """``interrupts``: the rollout pool's signal when ``trainer.partial_rollout`` is on;
        ``restart`` builds the rollout pool's group again, at most ``max_restarts`` times."""
        self.actor, self.rollout, self.interrupts = actor, rollout, interrupts
        self.group: WorkerGroup = rollout if rollout is not None else actor
        """The processes that generate."""
        self.restart, self.max_restarts = restart, max_restarts
        self.engine_restarts = 0

    def restart_engines(self, err: BaseException) -> bool:
        """After a rollout-pool generation failed with ``err``: when its process died or hung (and
        restarts are left), stop the group, build it again and return True; the caller gives it
        weights and submits the lost generations again. Colocated engines live in the actor's
        processes: their failures restart the run (``trainer.recovery``)."""
        from rlhf_megatron.trainer.recovery import failure_cause

        if self.rollout is None or self.restart is None or self.engine_restarts >= self.max_restarts:
            return False
        if getattr(err, "role", None) != "rollout" or failure_cause(err) not in ("died", "hung"):
            return False
        logger.warning(
            "restarting the rollout pool's engines (%d of %d, trainer.max_restarts): %s",
            self.engine_restarts + 1,
            self.max_restarts,
            str(err).splitlines()[0],
        )
        self.rollout.kill()
        self.rollout = self.group = self.restart()
        self.engine_restarts += 1
        return True

    def submit_generate(
        self,
        prompts: Batch,
        seed: int,
        validate: bool = False,
        greedy: bool = False,
        interrupt_epoch: int | None = None,
        log_probs: tuple[str, ...] = (),
    ) -> PendingCall[Batch]:
        """Start generating: prompts padded to the rollout DP size (``finish_generate`` drops the
        padding). ``interrupt_epoch`` (partial rollout): the generation stops early once
        ``interrupt`` raises the signal past it; ``log_probs``: the log-prob columns the colocated
        actor computes over the batch in the same call."""
        padded, pad = prompts.pad_to_divisor(self.group.dp_size("rollout"))
        extra = {} if interrupt_epoch is None else {"interrupt_epoch": interrupt_epoch}
        if log_probs:  # only the colocated actor takes them (``PPOTrainer._fused_passes``)
            extra["log_probs"] = log_probs
        pending = self.group.submit.generate_sequences(
            padded, validate=validate, greedy=greedy, seed=seed, **extra
        )
        pending.pad, pending.rows = pad, len(padded)
        return pending

    def submit_continue(self, batch: Batch, seed: int, interrupt_epoch: int) -> PendingCall[Batch]:
        """Partial rollout: finish an interrupted generation's unfinished rows with the rollout's
        current weights (``finish_generate`` collects it)."""
        padded, pad = batch.pad_to_divisor(self.group.dp_size("rollout"))
        pending = self.group.submit.continue_sequences(padded, seed=seed, interrupt_epoch=interrupt_epoch)
        pending.pad, pending.rows = pad, len(padded)
        return pending

    def finish_generate(self, pending: PendingCall[Batch], version: int) -> Batch:
        """Wait for a generation; rows carry ``weight_version`` (the rollout pool's own; colocated,
        ``version``, the weights the actor's engine holds)."""
        out = pending.result()
        n = len(out) // pending.rows
        out = out[: len(out) - pending.pad * n] if pending.pad else out
        if VERSION_KEY not in out.tensor_keys:
            out[VERSION_KEY] = torch.full((len(out),), version, dtype=torch.int64)
        return out

    def interrupt(self) -> int:
        """Stop the generations in flight at their next engine step (partial rollout); the new epoch."""
        if self.interrupts is None:
            raise RuntimeError(
                "interrupt: this rollout has no interrupt signal (trainer.partial_rollout is off)"
            )
        return self.interrupts.raise_()

    def update_weights(self, version: int) -> Callable[[], dict[str, float]]:
        """Give the rollout the actor's current weights (``version`` updates): colocated, through the
        actor's own engine; disaggregated, streamed from the trainer's rank 0 to the rollout pool.
        The returned function waits and gives the ``sync/*`` metrics; calls submitted to the rollout
        after this one run with the new weights."""
        if self.rollout is None:
            return self.actor.submit.update_weights().result
        send = self.actor.submit.send_weights(version)
        receive = self.rollout.submit.receive_weights(version)

        def wait() -> dict[str, float]:
            sent, received = wait_all([send, receive])
            return {**sent, **received}

        return wait
