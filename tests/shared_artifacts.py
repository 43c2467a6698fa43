"""Artefacts built once per pytest session and shared by its xdist workers (see tests/conftest.py).

A uniquely named module (not conftest) so that test helpers in any directory can import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's xdist worker id (``gw0``, ...), None without xdist."""


def session_dir(tmp_path_factory) -> Path:
    """A directory of this pytest session shared by all its xdist workers."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is <session base>/popen-gwN.
    root = base.parent if WORKER else base
    path = root / "shared"
    path.mkdir(exist_ok=True)
    return path


def shared_artifact(tmp_path_factory, name: str, build: Callable[[Path], object]) -> tuple[Path, object]:
    """Build ``name`` once per session for every xdist worker: ``build(path)`` fills the directory
    ``path`` and returns a JSON-serialisable result. Returns ``(path, result)``; the first worker to
    ask builds, the others wait for it. A failed build leaves nothing behind (the next caller
    builds again and meets the same error)."""
    root = session_dir(tmp_path_factory)
    path, done = root / name, root / f"{name}.result.json"
    with FileLock(str(root / f"{name}.lock")):
        if done.exists():
            return path, json.loads(done.read_text())["result"]
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        try:
            result = build(path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps({"result": result}))
        os.replace(tmp, done)
        return path, result


@contextlib.contextmanager
def machine_share(tmp_path_factory, exclusive: bool):
    """Hold the machine shared with the other xdist workers' tests, or ``exclusive``: alone.

    A turnstile in front keeps an exclusive holder from waiting forever behind a stream of shared
    ones: whoever holds the turnstile is next, and an exclusive holder keeps it until the tests
    running beside it have finished. No effect without xdist."""
    if not WORKER:
        yield
        return
    root = session_dir(tmp_path_factory)
    with open(root / "machine.lock", "a") as machine, open(root / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
