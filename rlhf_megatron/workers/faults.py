"""Test hook: inject a fault at a named point of a run (``RLHF_FAULT``). Not for production use.

``RLHF_FAULT`` holds comma-separated entries ``<phase>:<step>[:<rank>]``; an entry without a
rank applies to every rank. ``step`` counts the training steps *this process* has run
(1 = the first step after start or resume), so a restarted run without the variable is
unaffected. Phases, and where they act:

- ``gen``, ``update``, ``sync``: the actor worker of that rank SIGKILLs itself at the start of
  ``generate_sequences`` / ``update_actor`` / ``sync_weights`` (a crashed or OOM-killed process).
- ``nan``: the actor's ``update_actor`` turns that step's advantages into NaN (a poisoned loss).
- ``critic_nan``: the critic's ``update_critic`` turns that step's returns into inf (an
  overflowing value loss).
- ``save``: the driver SIGKILLs itself mid-checkpoint: after the workers wrote their files
  into the temporary directory, before the trainer commits it.

Two entries take an amount instead of a step, and act at every step (``tools/soak.py``'s
tests use them to show that its checks catch a real leak and a real slowdown):

- ``leak:<MiB>``: every actor worker keeps another ``MiB`` of memory per ``update_actor``.
- ``sync_drift:<ms>``: every actor worker's ``sync_weights`` sleeps ``ms`` times the number of
  updates so far (a weight sync that gets slower every step).

The reliability tests (``tests/reliability``) drive these; nothing reads the variable otherwise.
"""

from __future__ import annotations

import os
import signal

ENV = "RLHF_FAULT"


def _entries(phase: str) -> list[list[str]]:
    """The ``RLHF_FAULT`` entries for ``phase``, each split into its ``:`` fields."""
    entries = (e.strip().split(":") for e in os.environ.get(ENV, "").split(",") if e.strip())
    return [parts for parts in entries if parts[0] == phase]


def fault_requested(phase: str, step: int, rank: int | None = None) -> bool:
    """True if ``RLHF_FAULT`` asks for ``phase`` at ``step`` (on ``rank``, when the entry names one)."""
    return any(
        int(parts[1]) == step and (len(parts) < 3 or rank is None or int(parts[2]) == rank)
        for parts in _entries(phase)
    )


def fault_amount(phase: str) -> int:
    """The amount of the ``<phase>:<amount>`` entry of ``RLHF_FAULT`` (0 without one)."""
    found = _entries(phase)
    return int(found[0][1]) if found else 0


def kill_self_if_requested(phase: str, step: int, rank: int | None = None) -> None:
    """SIGKILL this process (no cleanup, no exception: like the OOM killer) when asked to."""
    if fault_requested(phase, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
