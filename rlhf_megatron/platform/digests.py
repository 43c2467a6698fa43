"""sha256 of checkpoint files, read once per process for the files a run hard-links into every save.

A run's MTP store (``models/mtp.py``) is hard-linked into each checkpoint: DeepSeek-V3's
next-token-prediction layer is 11B parameters, so hashing it for each save's model checkpoint
metadata (whose digests the trainer's manifest takes) would read ~22 GB per save for files that
never change.
``sha256(path, reuse_linked=True)`` keeps the digest of a file with more than one link by (device,
inode, size, mtime in ns): a file written again gets a new mtime or inode, so a new key.
Verification passes ``reuse_linked=False`` and reads every file.

Boundaries: the standard library only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["file_sha256", "sha256"]

_LINKED: dict[tuple[int, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The file's sha256, read now."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256(path: Path, reuse_linked: bool) -> str:
    """``file_sha256``, or for a hard-linked file (``reuse_linked``) the digest this process read
    of it before."""
    st = path.stat()
    if not reuse_linked or st.st_nlink < 2:
        return file_sha256(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _LINKED:
        _LINKED[key] = file_sha256(path)
    return _LINKED[key]
