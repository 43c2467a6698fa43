"""What processes leave in ``/dev/shm``: the names there, and those no live process maps.

A process killed with SIGKILL cannot remove its shared-memory segments; a restart on the same
host may then collide with them, and repeated crashes fill ``/dev/shm``. The fault tests and
``tools/chaos.py`` take ``shm_names()`` before a run and ``left_behind`` after it.

Boundaries: the standard library only; reads ``/dev/shm`` and ``/proc/*/maps``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["left_behind", "mapped_shm_names", "shm_names"]


def shm_names() -> set[str]:
    """The entries of ``/dev/shm`` now (none where it does not exist)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_shm_names() -> set[str]:
    """The ``/dev/shm`` names some live process maps (another run beside this one has its own)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        names.update(
            line.split("/dev/shm/", 1)[1].split()[0] for line in text.splitlines() if "/dev/shm/" in line
        )
    return names


def left_behind(before: set[str]) -> set[str]:
    """Segments that appeared since ``before`` and no live process maps: what dead processes left.
    Python's named semaphores (``sem.mp-*``, made by multiprocessing queues of other processes,
    which pass them to their children by name) are not a run's segments and are left out."""
    return {n for n in shm_names() - before - mapped_shm_names() if not n.startswith("sem.")}
