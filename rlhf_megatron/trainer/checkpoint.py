"""Atomic, prunable run checkpoints under ``trainer.default_local_dir``.

Layout (verl's names, so tooling that reads verl runs finds its way):

    <root>/global_step_<k>/actor/...          actor model (dist-checkpoint) + per-rank optimizer/RNG
    <root>/global_step_<k>/critic/...         the same for the critic
    <root>/global_step_<k>/trainer_state.json step, dataloader position, KL controller
    <root>/global_step_<k>/manifest.json      size and sha256 of every other file, written last
                                              (a model file's as its worker hashed it)
    <root>/latest_checkpointed_iteration.txt  the step of the newest complete checkpoint

A save goes to ``<root>/.global_step_<k>.tmp`` and is renamed into place only
after every worker finished writing and the trainer state is on disk; the
marker is rewritten (temp file + rename) last. A crash at any point leaves
the previous checkpoint and marker untouched, and a leftover ``.tmp``
directory is never mistaken for a checkpoint (it is removed by the next
save). ``max_to_keep`` prunes the oldest complete checkpoints.

The manifest makes a resume refuse a corrupt or truncated checkpoint instead of
loading garbage: ``verify(path, mode)`` checks every file's size (``size``) and
sha256 (``sha256``) before any worker reads it, and names the first bad file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rlhf_megatron.platform.digests import file_sha256

MARKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
VERIFY_MODES = ("sha256", "size", "none")


MODEL_METADATA_FILE = "rlhf_megatron_ckpt.json"
"""A model checkpoint's own metadata (``models.checkpoint.CKPT_METADATA_FILE``): the sha256 and size of
each of its files, which the worker that saved it hashed as it wrote them."""


def _worker_digests(tmp: Path) -> dict[str, tuple[int, str]]:
    """What the workers already hashed: path under ``tmp`` -> (size, sha256), read from each model
    checkpoint's metadata in ``tmp``. The manifest takes these instead of reading the files again
    (a save reads the model once, not twice); ``verify`` still reads every file."""
    known: dict[str, tuple[int, str]] = {}
    for meta_path in tmp.rglob(MODEL_METADATA_FILE):
        try:
            meta = json.loads(meta_path.read_text())
            files, sizes = dict(meta.get("files") or {}), dict(meta.get("sizes") or {})
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # unreadable: its files are hashed here like any other
        base = meta_path.parent.relative_to(tmp)
        for rel, digest in files.items():
            if rel in sizes and isinstance(digest, str):
                known[(base / rel).as_posix()] = (sizes[rel], digest)
    return known


def _digest(path: Path, rel: str, size: int, known: dict[str, tuple[int, str]]) -> str:
    if rel in known and known[rel][0] == size:
        return known[rel][1]
    return file_sha256(path)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the path."""


class CheckpointManager:
    def __init__(self, root: str | Path, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep if max_to_keep and max_to_keep > 0 else None

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for step ``step``'s checkpoint (workers write into it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise CheckpointError(f"cannot write checkpoints: {self.root} is not writable")
        tmp = self.root / f".global_step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: Path, trainer_state: dict[str, Any]) -> Path:
        """Finish a save: trainer state, rename into place, move the marker, prune."""
        try:
            _write_atomic(tmp / STATE_FILE, json.dumps(trainer_state, indent=1, sort_keys=True))
            known = _worker_digests(tmp)
            manifest = {}
            for p in _files(tmp):
                rel, size = p.relative_to(tmp).as_posix(), p.stat().st_size
                manifest[rel] = {"size": size, "sha256": _digest(p, rel, size, known)}
            _write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
        except OSError as e:  # ENOSPC and friends: say where, keep the previous checkpoint
            raise CheckpointError(
                f"saving step {step} failed writing under {tmp}: {e}; the previous checkpoint is untouched"
            ) from e
        final = self.step_dir(step)
        if final.exists():  # re-saving a step (e.g. a resumed run ends where the last save was)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(self.root / MARKER, f"{step}\n")
        self._prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def complete_steps(self) -> list[int]:
        steps = []
        for d in self.root.glob("global_step_*"):
            suffix = d.name.removeprefix("global_step_")
            if suffix.isdigit() and (d / STATE_FILE).is_file():
                steps.append(int(suffix))
        return sorted(steps)

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        for step in self.complete_steps()[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint named by the marker, or None when there is none."""
        marker = self.root / MARKER
        if not marker.is_file():
            return None
        text = marker.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(
                f"{marker} should hold a step number, found {text!r}; delete it to start fresh"
            )
        path = self.step_dir(int(text))
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(
                f"{marker} points at step {text}, but {path / STATE_FILE} is missing: the checkpoint is incomplete. "
                f"Point trainer.resume_from_path at another global_step_* directory or set trainer.resume_mode=disable"
            )
        return path

    def resolve(self, resume_mode: str, resume_from_path: str | None) -> Path | None:
        """What to resume from: ``auto`` (latest, if any), ``disable`` (nothing) or an explicit path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto" and not resume_from_path:
            return self.latest()
        path = Path(resume_from_path or resume_mode)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(
                f"trainer.resume_from_path={path} is not a complete checkpoint (no {STATE_FILE}); "
                "pass a global_step_* directory"
            )
        return path

    @staticmethod
    def verify(path: Path, mode: str = "sha256") -> None:
        """Check ``path`` against its manifest: every listed file present, same size (and sha256).

        Raises ``CheckpointError`` naming the first bad file. Checkpoints saved before manifests
        existed (no manifest.json) are accepted unchecked.
        """
        if mode not in VERIFY_MODES:
            raise CheckpointError(f"trainer.verify_checkpoint={mode!r} is not one of {VERIFY_MODES}")
        manifest_path = path / MANIFEST_FILE
        if mode == "none" or not manifest_path.is_file():
            return
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"cannot read {manifest_path}: {e}; the checkpoint cannot be verified"
            ) from e
        hint = "restore the file, or resume from another global_step_* (trainer.resume_from_path)"
        for rel, entry in sorted(manifest.items()):
            file = path / rel
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} is missing; {hint}")
            size = file.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"checkpoint file {file} is {size} bytes, the manifest says {entry['size']} "
                    f"(truncated or overwritten); {hint}"
                )
            if mode == "sha256" and file_sha256(file) != entry["sha256"]:
                raise CheckpointError(f"checkpoint file {file} fails its sha256 check (corrupt); {hint}")

    @classmethod
    def step_of(cls, path: Path) -> int:
        """The step a complete checkpoint was saved after."""
        return int(cls.read_state(path)["global_step"])

    def newest_since(self, started: float, fallback: Path | None) -> Path | None:
        """The newest complete checkpoint written at or after ``started`` (a time.time()), else
        ``fallback``: what a run restarting in-job resumes from (never an older run's checkpoint
        that this run chose not to resume from)."""
        latest = self.latest()
        if latest is not None and (latest / STATE_FILE).stat().st_mtime >= started:
            return latest
        return fallback

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        try:
            return json.loads((path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {path / STATE_FILE}: {e}") from e
