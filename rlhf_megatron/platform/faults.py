"""Fault points: named places in a run where tests inject failures. Empty, and free, in production.

Production code marks a point once, where a real failure could strike::

    fault_point("actor.update", step=..., rank=..., batch=batch)

and knows nothing else about faults. ``fault_point`` looks the name up in a registry that is
empty unless ``RLHF_FAULT_HOOKS`` names a hooks file (read once per process). Only then is
that file loaded (``importlib``, under the fixed module name ``HOOKS_MODULE``) and its
``handlers_from_env(os.environ) -> {point: [handler, ...]}`` called; the package ships no
handlers and imports nothing of the tests. The repository's hooks file is
``tests/fault_hooks.py``: its ``RLHF_FAULT`` entries are documented there, and the tests and
``tools/`` that inject faults set ``RLHF_FAULT_HOOKS`` to it. A handler receives the point's
keyword context and may kill the process, poison a tensor of the batch it is given, or end the
run (``StopTraining``).

Worker processes get the hook through ``fault_env()``: the hooks variable (as an absolute path)
and the variables it acts on, those whose name starts with ``RLHF_FAULT`` and those the hooks
file lists in ``FORWARD_ENV``. An ``RLHF_FAULT*`` variable without ``RLHF_FAULT_HOOKS`` is an
error, not silently ignored: nothing would inject the fault it asks for.

The points, and the context each passes:

- ``actor.generate`` (step, rank): a training rollout has sampled, before its call returns;
  ``step`` is this process's ``updates + 1``.
- ``actor.update`` (step, rank, batch): start of ``update_actor``.
- ``actor.sync`` (step, rank): a colocated weight sync has loaded vLLM, before its call
  returns (a disaggregated send: at its start); ``step`` counts updates so far. These two act
  mid-call because the driver may have queued them behind another call on the same worker.
- ``actor.validate`` (step, rank): a validation generation has sampled; ``step`` counts updates
  so far (0: validation before training).
- ``<role>.save`` (step, rank): a role's worker starts writing its checkpoint files (``actor.save``,
  ``critic.save``); ``step`` counts its updates so far.
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

Boundaries: standard library only; knows no role, worker or trainer, and no hook's variables
beyond the ``RLHF_FAULT`` prefix it forwards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["HOOKS_ENV", "HOOKS_MODULE", "Handler", "StopTraining", "fault_env", "fault_point"]

HOOKS_ENV = "RLHF_FAULT_HOOKS"
"""Names the hooks file: a Python file defining ``handlers_from_env(env)``."""
HOOKS_MODULE = "_rlhf_fault_hooks"
"""The module name the hooks file is loaded under (once per process)."""
_PREFIX = "RLHF_FAULT"

Handler = Callable[..., None]
_registry: dict[str, list[Handler]] | None = None
_lock = threading.RLock()  # the first fault point may be reached from several threads


class StopTraining(Exception):
    """Ends a run early and cleanly (a simulated pre-emption); the trainer returns its history."""


def _hooks_path() -> Path | None:
    """The hooks file ``RLHF_FAULT_HOOKS`` names, absolute; None when unset. An ``RLHF_FAULT*``
    variable without it is an error: nothing would act on it."""
    value = os.environ.get(HOOKS_ENV)
    if not value:
        orphans = sorted(k for k, v in os.environ.items() if k.startswith(_PREFIX) and v)
        if orphans:
            raise RuntimeError(
                f"{', '.join(orphans)} set but {HOOKS_ENV} is not: set {HOOKS_ENV} to the hooks file "
                "that acts on it (this repository's tests/fault_hooks.py)"
            )
        return None
    return Path(value).absolute()


def _hooks_module(path: Path) -> ModuleType:
    """The hooks file at ``path``, loaded once per process as ``HOOKS_MODULE``."""
    with _lock:
        module = sys.modules.get(HOOKS_MODULE)
        if module is not None and getattr(module, "__file__", None) == str(path):
            return module
        return _load(path)


def _load(path: Path) -> ModuleType:
    where = f"{HOOKS_ENV}={os.environ.get(HOOKS_ENV)!r} ({path})"
    if not path.is_file():
        raise RuntimeError(f"{where}: no such file")
    spec = importlib.util.spec_from_file_location(HOOKS_MODULE, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{where}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[HOOKS_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[HOOKS_MODULE]
        raise
    if not callable(getattr(module, "handlers_from_env", None)):
        del sys.modules[HOOKS_MODULE]
        raise RuntimeError(f"{where}: defines no handlers_from_env(env)")
    return module


def fault_env() -> dict[str, str]:
    """The hook's variables set in this process, to forward to worker processes; empty without
    ``RLHF_FAULT_HOOKS``, or when none of the variables its file acts on is set."""
    path = _hooks_path()
    if path is None:
        return {}
    forward = set(getattr(_hooks_module(path), "FORWARD_ENV", ()))
    env = {
        k: v
        for k, v in os.environ.items()
        if v and k != HOOKS_ENV and (k.startswith(_PREFIX) or k in forward)
    }
    return {HOOKS_ENV: str(path), **env} if env else {}


def _handlers() -> dict[str, list[Handler]]:
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                path = _hooks_path()
                _registry = {} if path is None else _hooks_module(path).handlers_from_env(os.environ)
    return _registry


def fault_point(point: str, **context: Any) -> None:
    """Run the handlers registered for ``point`` (none in production)."""
    for handler in _handlers().get(point, ()):
        handler(**context)
