"""Build an output directory once: the stamp, temporary-directory and rename steps the tiny-model
builders (``make_tiny_model.py``, ``make_tiny_tool_model.py``, ``make_tiny_vl_model.py``) share.

    from stamped_build import args_hash, build_once, read_stamp, replace_dir   # tools/ on sys.path

``build_once`` skips the build when ``--out`` holds a ``stamp.json`` with the same arguments hash
(and the data the build writes is there), refuses an ``--out`` the tool did not write unless
``--force``, and otherwise builds into a temporary sibling that replaces ``--out`` only when
complete. It prints the build's JSON result (``skipped`` says which way it went).

Boundaries: files only; the builders train and write the models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

STAMP_FILE = "stamp.json"


def args_hash(args: argparse.Namespace, recipe_version: int) -> str:
    """Hash of everything that changes the outputs: every argument but ``--out`` and ``--force``
    (threads change rounding), and the recipe's version (bumped when the recipe changes in a way the
    arguments do not show)."""
    keys = {k: v for k, v in sorted(vars(args).items()) if k not in ("out", "force")}
    keys["recipe_version"] = recipe_version
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def read_stamp(out: Path) -> dict | None:
    path = out / STAMP_FILE
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an old ``out`` is moved aside first, since rename won't overwrite a dir."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def build_once(
    tool: str,
    args: argparse.Namespace,
    recipe_version: int,
    build: Callable[[argparse.Namespace, Path], dict],
    data_present: Callable[[], bool],
    write_data: Callable[[], object] | None = None,
) -> int:
    """Build ``args.out`` with ``build(args, tmp_dir)`` unless its stamp matches (see the module doc).

    ``write_data`` writes the data files beside the model first (deterministic, so a matching stamp
    with the data gone rewrites only the data); without it ``build`` writes them, and a matching
    stamp with the data gone rebuilds."""
    out, digest = Path(args.out), args_hash(args, recipe_version)
    stamp = read_stamp(out)
    if out.exists() and stamp is None and not args.force:
        raise SystemExit(
            f"{tool}: {out} exists but has no {STAMP_FILE}, so this tool did not write it; "
            "pass --force to replace it or choose another --out."
        )
    if stamp is not None and stamp.get("args_hash") == digest and not args.force:
        if not data_present():
            if write_data is None:
                stamp = None  # the build writes the data: rebuild
            else:
                write_data()
        if stamp is not None:
            print(json.dumps({**stamp["result"], "skipped": True}))
            return 0
    if write_data is not None:
        write_data()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        result = build(args, tmp)
        with open(tmp / STAMP_FILE, "w") as f:
            json.dump({"args_hash": digest, "args": vars(args), "result": result}, f, indent=2)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({**result, "skipped": False}))
    return 0
