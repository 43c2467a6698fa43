"""The sandbox tests' shared check that a test left nothing behind: ``sandboxes_in(tmp_path)``.

Points the sandboxes' temporary directory at ``<tmp_path>/sandboxes`` for one test and, after
it, asserts that no sandbox directory, child process or open file descriptor of this process is
left (only ``<tmp>/rlhf-sandboxes-<uid>/<this process>`` and its compiled bootstrap may stay,
until the process exits).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def children() -> set[int]:
    """The pids whose parent is this process (Linux /proc)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                found.add(int(entry))
    return found


@contextlib.contextmanager
def sandboxes_in(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    before, fds = children(), set(os.listdir("/proc/self/fd"))
    yield root
    left = [
        p for p in root.rglob("*") if len(p.relative_to(root).parts) > 2 and p.name != "bootstrap.marshal"
    ]
    assert left == [], f"a sandbox directory was left behind: {left[:3]}"
    assert children() - before == set(), "a sandbox process was left behind"
    # Another thread of this process (a library's: Ray's, in an xdist worker that hosted a cluster)
    # may hold a file open for a moment, or open a connection of its own: a leak is a descriptor
    # still open after a grace period and still open when it is read back, reported with what it
    # points at. Sockets are not the sandbox's: its parent side opens files, pipes and a pidfd only
    # (its child may not create a socket at all), so a socket here is such a thread's.
    deadline = time.monotonic() + 5.0
    while (opened := set(os.listdir("/proc/self/fd")) - fds) and time.monotonic() < deadline:
        time.sleep(0.05)
    still_open = {
        fd: target
        for fd, target in _targets(opened).items()
        if target != CLOSED and not target.startswith("socket:")
    }
    assert still_open == {}, f"a file descriptor was left open: {still_open}"


CLOSED = "(closed since)"


def _targets(fds: set[str]) -> dict[str, str]:
    out = {}
    for fd in sorted(fds):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            out[fd] = CLOSED
    return out
