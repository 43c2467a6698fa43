"""The test hook behind ``fault_point``: ``RLHF_FAULT`` and ``RLHF_STOP_AFTER_STEP``. Not for production.

Not part of the package: ``rlhf_megatron/platform/faults.py`` loads this file only when
``RLHF_FAULT_HOOKS`` names it (``tests/trainer_helpers.run_train``, ``tools/soak.py`` and
``tools/bench_async.py`` set it to this file when a run gets ``RLHF_FAULT`` or
``RLHF_STOP_AFTER_STEP``), calls ``handlers_from_env`` and forwards ``RLHF_FAULT*`` and
``FORWARD_ENV`` to the worker processes. Tests may also ``import fault_hooks`` directly.

``RLHF_FAULT`` holds comma-separated entries ``<phase>:<step>[:<rank>]``; an entry without a
rank applies to every rank. ``step`` counts the training steps *this process* has run
(1 = the first step after start or resume), so a restarted run without the variable is
unaffected. Phases, and the point each acts at:

- ``gen``, ``update``, ``sync``: the actor worker of that rank SIGKILLs itself at
  ``actor.generate`` / ``actor.update`` / ``actor.sync`` (a crashed or OOM-killed process).
- ``val``, ``ckpt``: the same at ``actor.validate`` (a validation generation; ``step`` counts the
  updates before it, 0 = validation before training) and ``actor.save`` (writing its checkpoint
  files; ``step``: updates so far).
- ``rollout_gen``, ``rollout_sync``: a worker of the disaggregated rollout pool SIGKILLs
  itself at ``rollout.generate`` (its ``step``-th training generation) / ``rollout.sync``
  (receiving weight version ``step``).
- ``nan``: at ``actor.update``, that step's advantages become NaN (a poisoned loss).
- ``critic_nan``: at ``critic.update``, that step's returns become inf (an overflowing
  value loss).
- ``save``: the driver SIGKILLs itself at ``trainer.save``, after the workers wrote their
  files into the temporary directory and before the trainer commits it.
- ``hang``: at ``actor.update`` the actor worker of that rank sleeps for an hour (a stuck
  process; its peers then wait for it in their first collective), so the driver's
  ``trainer.step_timeout_s`` has something to catch.
- ``rollout_hang``: the same in a worker of the disaggregated rollout pool, at its
  ``step``-th training generation (``rollout.generate``): an engine that stops answering.

``RLHF_FAULT_ONCE_DIR=<dir>`` makes every kill and hang entry act at most once per run, whatever
the process: the first process to reach it creates ``<dir>/<entry>`` and acts, later ones (the
workers of an in-job restart, whose steps count from 1 again) find the file and go on. Without
it a restarted process would meet the same fault again.

Three entries take an amount instead of a step and act at every step (``tools/soak.py``'s
tests use the first two to show that its checks catch a real leak and a real slowdown):

- ``leak:<MiB>``: every actor worker keeps another ``MiB`` of memory per ``actor.update``.
- ``sync_drift:<ms>``: every ``actor.sync`` sleeps ``ms`` times the number of updates so far.
- ``rollout_slow:<ms>``: a disaggregated rollout worker sleeps ``ms`` before every engine
  step of a training generation (partial rollout's tests and ``tools/bench_async.py
  --partial``: a rollout slower than training, so that syncs meet generations in flight).

``RLHF_STOP_AFTER_STEP=k`` raises ``StopTraining`` at ``trainer.step_end`` of step ``k``
(tests simulate a pre-emption with it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping

import torch

from rlhf_megatron.platform.faults import Handler, StopTraining

FAULT_ENV = "RLHF_FAULT"
ONCE_ENV = "RLHF_FAULT_ONCE_DIR"
STOP_ENV = "RLHF_STOP_AFTER_STEP"
FORWARD_ENV = (STOP_ENV,)
"""What the seam forwards to worker processes besides ``RLHF_FAULT*``."""

_leaked: list[bytes] = []  # the planted leak: kept alive for the life of the process


def _entries(spec: str) -> list[list[str]]:
    return [e.strip().split(":") for e in spec.split(",") if e.strip()]


def _matches(entry: list[str], step: int, rank: int | None) -> bool:
    return int(entry[1]) == step and (len(entry) < 3 or rank is None or int(entry[2]) == rank)


def _first_time(entry: list[str], once_dir: str | None) -> bool:
    """Whether this process is the first of the run to act on ``entry`` (always, without
    ``RLHF_FAULT_ONCE_DIR``)."""
    if not once_dir:
        return True
    try:
        os.close(os.open(os.path.join(once_dir, ":".join(entry)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _kill(entry: list[str], once_dir: str | None = None) -> Handler:
    def handler(step: int, rank: int | None = None, **_) -> None:
        if _matches(entry, step, rank) and _first_time(entry, once_dir):
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: like the OOM killer

    return handler


def _hang(entry: list[str], once_dir: str | None = None) -> Handler:
    def handler(step: int, rank: int | None = None, **_) -> None:
        if _matches(entry, step, rank) and _first_time(entry, once_dir):
            time.sleep(3600)

    return handler


def _poison(entry: list[str], key: str, value: float) -> Handler:
    def handler(step: int, rank: int | None = None, batch=None, **_) -> None:
        if _matches(entry, step, rank):
            batch[key] = torch.full_like(batch[key], value)

    return handler


def _leak(mib: int) -> Handler:
    def handler(**_) -> None:
        _leaked.append(b"\x01" * (mib << 20))  # bytes written, so resident

    return handler


def _pause(ms: int) -> Handler:
    def handler(**_) -> None:
        time.sleep(ms / 1000)

    return handler


def _drift(ms: int) -> Handler:
    def handler(step: int, **_) -> None:
        time.sleep(ms * step / 1000)

    return handler


def _stop_after(k: int) -> Handler:
    def handler(step: int, **_) -> None:
        if step >= k:
            raise StopTraining(f"stopped after step {step} ({STOP_ENV}={k})")

    return handler


_KILL_POINTS = {
    "gen": "actor.generate",
    "val": "actor.validate",
    "ckpt": "actor.save",
    "rollout_gen": "rollout.generate",
    "rollout_sync": "rollout.sync",
    "update": "actor.update",
    "sync": "actor.sync",
    "save": "trainer.save",
}


def handlers_from_env(env: Mapping[str, str]) -> dict[str, list[Handler]]:
    """Point name -> handlers, from ``RLHF_FAULT`` / ``RLHF_STOP_AFTER_STEP``."""
    registry: dict[str, list[Handler]] = {}

    def add(point: str, handler: Handler) -> None:
        registry.setdefault(point, []).append(handler)

    once_dir = env.get(ONCE_ENV)
    for entry in _entries(env.get(FAULT_ENV, "")):
        phase = entry[0]
        if phase in _KILL_POINTS:
            add(_KILL_POINTS[phase], _kill(entry, once_dir))
        elif phase == "hang":
            add("actor.update", _hang(entry, once_dir))
        elif phase == "rollout_hang":
            add("rollout.generate", _hang(entry, once_dir))
        elif phase == "nan":
            add("actor.update", _poison(entry, "advantages", float("nan")))
        elif phase == "critic_nan":
            add("critic.update", _poison(entry, "returns", float("inf")))
        elif phase == "leak":
            add("actor.update", _leak(int(entry[1])))
        elif phase == "sync_drift":
            add("actor.sync", _drift(int(entry[1])))
        elif phase == "rollout_slow":
            add("rollout.engine_step", _pause(int(entry[1])))
        else:
            raise ValueError(f"{FAULT_ENV}: unknown phase {phase!r} in entry {':'.join(entry)!r}")
    if env.get(STOP_ENV):
        add("trainer.step_end", _stop_after(int(env[STOP_ENV])))
    return registry
