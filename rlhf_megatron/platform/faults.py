"""Fault points: named places in a run where tests inject failures. Empty, and free, in production.

Production code marks a point once, where a real failure could strike::

    fault_point("actor.update", step=..., rank=..., batch=batch)

and knows nothing else about faults. ``fault_point`` looks the name up in a registry that
is empty unless a test hook is set in the environment (``RLHF_FAULT`` or
``RLHF_STOP_AFTER_STEP``, read once per process); only then is
``platform/fault_hooks.py`` imported and its handlers registered. A handler receives the
point's keyword context and may kill the process, poison a tensor of the batch it is
given, or end the run (``StopTraining``).

The points, and the context each passes:

- ``actor.generate`` (step, rank): a training rollout has sampled, before its call returns;
  ``step`` is this process's ``updates + 1``.
- ``actor.update`` (step, rank, batch): start of ``update_actor``.
- ``actor.sync`` (step, rank): a colocated weight sync has loaded vLLM, before its call
  returns (a disaggregated send: at its start); ``step`` counts updates so far. These two act
  mid-call because the driver may have queued them behind another call on the same worker.
- ``critic.update`` (step, rank, batch): start of ``update_critic``.
- ``rollout.generate`` (step, rank): a disaggregated rollout worker starts a training
  generation; ``step`` counts this process's training generations (1 = the first).
- ``rollout.sync`` (step, rank): a disaggregated rollout worker starts receiving weight
  version ``step``.
- ``rollout.engine_step`` (rank): a disaggregated rollout worker is about to run one engine
  step of a training generation (when partial rollout or a test hook has it step the engine).
- ``trainer.save`` (step): in the driver, after the workers wrote a checkpoint, before it
  is committed.
- ``trainer.step_end`` (step): in the driver, after a step is logged.

Boundaries: standard library only; knows no role, worker or trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["FAULT_ENV", "STOP_ENV", "StopTraining", "fault_env", "fault_point"]

FAULT_ENV = "RLHF_FAULT"
STOP_ENV = "RLHF_STOP_AFTER_STEP"

Handler = Callable[..., None]
_registry: dict[str, list[Handler]] | None = None


class StopTraining(Exception):
    """Ends a run early and cleanly (a simulated pre-emption); the trainer returns its history."""


def fault_env() -> dict[str, str]:
    """The test-hook variables set in this process, to forward to worker processes."""
    return {k: os.environ[k] for k in (FAULT_ENV, STOP_ENV) if os.environ.get(k)}


def _handlers() -> dict[str, list[Handler]]:
    global _registry
    if _registry is None:
        if fault_env():
            from rlhf_megatron.platform.fault_hooks import handlers_from_env

            _registry = handlers_from_env(os.environ)
        else:
            _registry = {}
    return _registry


def fault_point(point: str, **context: Any) -> None:
    """Run the handlers registered for ``point`` (none in production)."""
    for handler in _handlers().get(point, ()):
        handler(**context)
