"""Where prompt rows come from: one ``data.train_files`` / ``data.val_files`` entry -> Arrow tables.

An entry is a local path, optionally followed by EasyR1's ``@split`` (``hiyouga/geometry3k@train``):

* a parquet file (verl's format; what ``tools/data/`` writes);
* a JSON Lines file (``.jsonl``, or ``.json`` with one object per line) or a ``.json`` file
  holding one list of objects;
* a directory written by Hugging Face ``datasets``' ``save_to_disk``: a ``Dataset``, or a
  ``DatasetDict`` whose split ``@split`` picks (default ``train``);
* a dataset repository checked out on disk (``hiyouga/geometry3k`` downloaded with
  ``huggingface-cli download --repo-type dataset``): its parquet/JSON files, found under it
  (usually in ``data/``) and assigned to splits the way the Hub does, by the split name as a
  word of the file's path (``data/train-00000-of-00001.parquet``, ``test.jsonl``,
  ``data/validation/part-0.parquet``). Files that name no known split are all ``train``.

The default split is ``train``, as in EasyR1. No hub is ever contacted: a path that does not
exist is an error naming the config key and what forms are accepted.

Tables are returned as read (parquet and JSON in memory; ``save_to_disk`` data memory-mapped),
one `SourceTable` per file, so row numbers in error messages are those of that file.

Boundaries: file discovery and reading; no tokenization, no schema checks beyond "has rows".
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

__all__ = ["ACCEPTED_FORMS", "SourceTable", "load_source", "split_spec"]

DEFAULT_SPLIT = "train"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# Split names the Hub recognises in file paths; a repository whose files name none of them
# is all "train".
KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
# Metadata files a dataset repository or a datasets cache may hold beside the data.
METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")
ACCEPTED_FORMS = (
    "a parquet file, a JSON Lines file (.jsonl/.json), a .json file holding a list of objects, "
    "a directory written by datasets' save_to_disk (Dataset or DatasetDict), or a dataset "
    "repository checked out on disk (parquet/JSON files named after their split, usually under "
    "data/); directories take an optional @split suffix (default train)"
)


@dataclass
class SourceTable:
    """One file's rows. ``name`` is what errors cite; relative image paths resolve in ``base_dir``."""

    name: str
    table: pa.Table
    base_dir: str
    dataset_name: str
    """The entry's dataset name (directory or file stem), the default ``data_source``."""


def split_spec(spec: str, files_key: str) -> tuple[str, str | None]:
    """``path@split`` -> (path, split); an existing path containing '@' is taken whole."""
    path = os.path.expanduser(os.fspath(spec))
    if os.path.exists(path):
        return path, None
    if "@" in path:
        base, split = path.rsplit("@", 1)
        if os.path.exists(base):
            if not split:
                raise ValueError(
                    f"{files_key}: {spec!r} ends in '@' without a split name; write {base}@train."
                )
            return base, split
        path = base
    raise FileNotFoundError(
        f"RLHFDataset: {files_key} entry {spec!r}: {path} does not exist. Accepted: {ACCEPTED_FORMS}. "
        "Datasets are only read from local paths (no hub is contacted): download it first, e.g. "
        "`huggingface-cli download --repo-type dataset hiyouga/geometry3k --local-dir hiyouga/geometry3k`, "
        f"and set {files_key} to the local copy."
    )


def load_source(spec: str, files_key: str = "data.train_files") -> list[SourceTable]:
    """The tables of one entry (see the module docstring); raises naming ``files_key`` and the path."""
    path, split = split_spec(spec, files_key)
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(path))
        if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(
            os.path.join(path, "state.json")
        ):
            return [_load_saved(path, split, name, files_key)]
        return [_read_file(f, name, files_key) for f in _repo_files(path, split or DEFAULT_SPLIT, files_key)]
    if split not in (None, DEFAULT_SPLIT):
        raise ValueError(
            f"{files_key}: {spec!r}: {path} is a single file, which has no splits (only @{DEFAULT_SPLIT}); "
            "drop the @ suffix or point at a dataset directory."
        )
    return [_read_file(path, os.path.splitext(os.path.basename(path))[0], files_key)]


def _read_file(path: str, dataset_name: str, files_key: str) -> SourceTable:
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        table, kind = pq.read_table(path), "parquet file"
    elif suffix in (".jsonl", ".json"):
        table, kind = _read_json(path), "JSON file"
    else:
        raise ValueError(
            f"{files_key}: {path} has an unsupported type {suffix or '(no suffix)'!r}; accepted: {ACCEPTED_FORMS}."
        )
    if table.num_rows == 0:
        raise ValueError(f"RLHFDataset: {kind} {path} has no rows.")
    return SourceTable(path, table, os.path.dirname(os.path.abspath(path)), dataset_name)


def _read_json(path: str) -> pa.Table:
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    try:
        if head.startswith("["):
            with open(path, encoding="utf-8") as f:
                records = json.load(f)
            if not all(isinstance(r, dict) for r in records):
                raise ValueError("the list holds something other than objects")
            return pa.Table.from_pylist(records)
        return pa_json.read_json(path)
    except (ValueError, pa.ArrowInvalid) as err:
        raise ValueError(
            f"RLHFDataset: {path} is not valid JSON Lines (one object per line) nor a JSON list of objects "
            f"with consistent field types: {err}"
        ) from err


def _load_saved(path: str, split: str | None, name: str, files_key: str) -> SourceTable:
    """A ``save_to_disk`` directory, memory-mapped through ``datasets``."""
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        split = split or DEFAULT_SPLIT
        if split not in loaded:
            raise ValueError(
                f"{files_key}: {path} (a saved DatasetDict) has no split {split!r}; it has {sorted(loaded)}. "
                f"Write {path}@<split>."
            )
        loaded, where = loaded[split], f"{path}@{split}"
    else:
        saved_split = str(loaded.split) if loaded.split is not None else None
        if (
            split is not None
            and split != saved_split
            and not (saved_split is None and split == DEFAULT_SPLIT)
        ):
            raise ValueError(
                f"{files_key}: {path} is a saved Dataset of split {saved_split!r}, not {split!r}; "
                "drop the @ suffix or save a DatasetDict."
            )
        where = path
    if getattr(loaded, "_indices", None) is not None:  # a select()/shuffle() view saved as is
        loaded = loaded.flatten_indices()
    if loaded.num_rows == 0:
        raise ValueError(f"RLHFDataset: saved dataset {where} has no rows.")
    return SourceTable(where, loaded.data.table, os.path.abspath(path), name)


def _split_of(relative: str) -> str | None:
    """The known split a repository file belongs to by its path, as the Hub's patterns decide."""
    stem = os.path.splitext(relative)[0].lower()
    for split in KNOWN_SPLITS:
        if re.search(rf"(^|[-._ 0-9/]){split}([-._ 0-9/]|$)", stem):
            return split
    return None


def _repo_files(root: str, split: str, files_key: str) -> list[str]:
    """Data files of ``split`` under a dataset repository checkout, sorted (shards in order)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache
        found += [
            os.path.join(dirpath, f)
            for f in filenames
            if f.lower().endswith(DATA_SUFFIXES) and not f.startswith(".") and f not in METADATA_FILES
        ]
    found.sort()
    if not found:
        raise FileNotFoundError(
            f"{files_key}: directory {root} holds no parquet/JSON data files and is not a save_to_disk "
            f"directory (no state.json or dataset_dict.json). Accepted: {ACCEPTED_FORMS}."
        )
    relative = {f: os.path.relpath(f, root).replace(os.sep, "/") for f in found}
    splits = {f: _split_of(r) for f, r in relative.items()}
    if all(s is None for s in splits.values()):
        chosen = found if split == DEFAULT_SPLIT else []
    else:
        chosen = [f for f in found if splits[f] == split]
    if not chosen:
        present = sorted({s or DEFAULT_SPLIT for s in splits.values()})
        raise ValueError(
            f"{files_key}: {root} has no data files for split {split!r}; its files belong to splits {present} "
            f"({', '.join(list(relative.values())[:8])}{', ...' if len(found) > 8 else ''}). Write {root}@<split>."
        )
    return chosen
