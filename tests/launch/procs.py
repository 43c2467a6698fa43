"""Finding processes by their command line, to check that a launcher stopped its Ray."""

from __future__ import annotations

import time
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """Command lines (first 200 chars) of the live processes whose command line contains ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if text in args:
            found.append(args[:200])
    return found


def assert_gone(text: str, what: str, within_s: float = 15.0) -> None:
    """Fail unless every process mentioning ``text`` is gone within ``within_s``."""
    deadline = time.monotonic() + within_s
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{what} survived: {left}"
