"""Where a hung worker is stuck: its Python stack, on request, without stopping it.

Every worker process calls ``arm()`` when it starts: ``faulthandler`` then writes the main
thread's stack to the process's stderr when it receives ``SIGUSR1``, from C, so even a thread
blocked in a collective or a ``sleep`` answers. Ray writes a worker's stderr to
``<session>/logs/worker-*-<pid>.err`` (and forwards it to the driver's console). When a call misses
its deadline the driver's worker group calls ``collect`` for the late ranks on its own node, reads
the stacks back from those files, and names in its error where each rank was: the innermost
frame, and whether it was waiting in a ``torch.distributed`` collective, which tells the rank that
holds the others up (not in one) from the ranks that wait for it.

Boundaries: signals and log files on the driver's node; ranks elsewhere are named without a stack
(their stack is still in their own log).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SIGNAL = signal.SIGUSR1
HEADER = re.compile(r"^(Stack|(Current thread|Thread) 0x[0-9a-f]+) \(most recent call first\):$")
FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)$')
COLLECTIVE_PATHS = ("torch/distributed/", "megatron/core/parallel_state", "megatron/core/distributed/")


def arm() -> None:
    """Dump this process's stack to stderr on ``SIGUSR1`` (idempotent; no-op where unsupported)."""
    # No SIGUSR1 (Windows) or no real stderr (a captured one): no stacks, nothing else changes.
    with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):
        faulthandler.register(SIGNAL, file=sys.stderr, all_threads=False, chain=False)


@dataclass
class Stack:
    """A dumped stack, innermost frame first: ``(path, line, function)``."""

    frames: list[tuple[str, int, str]]

    @property
    def in_collective(self) -> bool:
        return any(any(p in path for p in COLLECTIVE_PATHS) for path, _, _ in self.frames)

    def where(self, depth: int = 3) -> str:
        """``file:line in func <- ...`` for the innermost frames, leaving out Ray's and torch's
        wrappers (tracing, c10d logging) and threading, shortest paths."""
        skip = ("/threading.py", "/ray/", "c10d_logger.py")
        shown = [f for f in self.frames if not any(k in f[0] for k in skip)][:depth]
        return " <- ".join(f"{_short(path)}:{line} in {func}" for path, line, func in shown)


def _short(path: str) -> str:
    for marker in ("site-packages/", "rlhf_megatron/", "tests/", "tools/"):
        if marker in path:
            return (marker if marker != "site-packages/" else "") + path.split(marker, 1)[1]
    return path


def parse_last(text: str) -> Stack | None:
    """The last stack ``faulthandler`` wrote into ``text`` (a worker's stderr log), if any."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if HEADER.match(line)]
    if not starts:
        return None
    frames = []
    for line in lines[starts[-1] + 1 :]:
        m = FRAME.match(line)
        if not m:
            break
        frames.append((m["path"], int(m["line"]), m["func"]))
    return Stack(frames) if frames else None


def _log_file(log_dir: Path, pid: int) -> Path | None:
    found = sorted(log_dir.glob(f"worker-*-{pid}.err"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def collect(pids: dict[int, int], log_dir: Path | None, wait_s: float = 2.0) -> dict[int, Stack]:
    """``{rank: Stack}`` for the ``{rank: pid}`` of processes on this node: each is sent ``SIGUSR1``
    and its stack read back from its Ray log in ``log_dir``. Ranks that cannot be read are left out."""
    if log_dir is None or not pids:
        return {}
    before = {}
    for rank, pid in pids.items():
        log = _log_file(log_dir, pid)
        if log is None:
            continue
        before[rank] = (log, log.stat().st_size)
        try:
            os.kill(pid, SIGNAL)
        except (ProcessLookupError, PermissionError):
            before.pop(rank)
    stacks: dict[int, Stack] = {}
    deadline = time.monotonic() + wait_s
    while before and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank, (log, size) in list(before.items()):
            with open(log, "rb") as f:  # only what the process wrote since the signal
                f.seek(size)
                stack = parse_last(f.read().decode(errors="replace"))
            if stack is not None:
                stacks[rank] = stack
                del before[rank]
    return stacks


def describe(stacks: dict[int, Stack]) -> str:
    """One line per rank: where it was, and whether it waited in a collective."""
    out = []
    for rank, stack in sorted(stacks.items()):
        kind = "waiting in a collective" if stack.in_collective else "not in a collective"
        out.append(f"rank {rank} ({kind}) at {stack.where()}")
    return "; ".join(out)
