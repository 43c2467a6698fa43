"""Next-token-prediction (MTP) layers of an HF checkpoint: kept aside, never trained, never lost.

DeepSeek-V3 and GLM-4.5 checkpoints hold ``num_nextn_predict_layers`` extra decoder layers after
the last one (``model.layers.<num_hidden_layers + i>.*``: ``eh_proj``, ``enorm``, ``hnorm``, a
full attention + MoE block, ``shared_head``) for speculative decoding. transformers and this
engine build only the first ``num_hidden_layers`` layers, so these tensors would silently vanish
from the trained model's export, breaking the checkpoint for servers that use them.

Instead, loading an HF checkpoint says on stderr that they are not trained
(``warn_untrained_mtp``); saving a model checkpoint copies them, as read, into
the ``MTP_DIR`` safetensors directory beside the dist-checkpoint (``save_mtp_tensors``), and
``mcore-to-hf`` writes them back untouched (``saved_mtp``). Both stream one tensor at a time:
DeepSeek-V3's MTP layer alone is a full MoE layer (~11B parameters). Since they never change, a
training run writes them once, into a store beside its step directories (``MTP_STORE``), and every
checkpoint hard-links the store's files (``store``): no bytes written per save, and pruning or
deleting a checkpoint leaves the others whole (a link is a name of the same file). Where a link is
refused (another filesystem) the files are copied whole instead of tensor by tensor.

Boundaries: safetensors files and names only; no megatron, no model.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from rlhf_megatron.models.hf_io import INDEX_FILE, SINGLE_FILE, HFCheckpoint, SafetensorsShardWriter
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["MTP_DIR", "MTP_STORE", "mtp_tensor_names", "save_mtp_tensors", "saved_mtp", "warn_untrained_mtp"]

MTP_DIR = "mtp_layers"
"""In a model checkpoint directory: the HF tensors of the layers past ``num_hidden_layers``
(safetensors shards and index, as an HF model directory holds them)."""

MTP_STORE = ".mtp_layers"
"""Beside a run's checkpoint step directories: one ``MTP_DIR``-like directory per trained model,
written by the run's first save and hard-linked into every checkpoint's ``MTP_DIR``."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_tensor_names(checkpoint: HFCheckpoint, arch: ModelArch) -> list[str]:
    """HF names of ``checkpoint``'s tensors in layers ``>= arch.num_layers``, sorted."""
    out = []
    for name in checkpoint.names():
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= arch.num_layers:
            out.append(name)
    return sorted(out)


def warn_untrained_mtp(checkpoint: HFCheckpoint, arch: ModelArch) -> list[str]:
    """Say on stderr that the checkpoint's MTP tensors are not trained; returns their names."""
    names = mtp_tensor_names(checkpoint, arch)
    if names:
        layers = sorted({int(_LAYER.match(n).group(1)) for n in names})
        print(
            f"rlhf_megatron: {checkpoint.dir} holds {len(names)} tensor(s) of layer(s) {layers} past "
            f"num_hidden_layers={arch.num_layers} (next-token-prediction layers, "
            f"num_nextn_predict_layers={arch.mtp_layers}); they are NOT trained: a model checkpoint "
            f"keeps them as read in {MTP_DIR}/ and `convert mcore-to-hf` writes them back unchanged",
            file=sys.stderr,
        )
    return names


def save_mtp_tensors(
    hf_dir: str | Path, arch: ModelArch, out_dir: str | Path, store: str | Path | None = None
) -> Path | None:
    """Copy the MTP tensors of ``hf_dir``, as stored, into ``out_dir / MTP_DIR``; returns that
    directory, or None (nothing written) if there are none.

    ``store``: a directory that outlives this checkpoint (``MTP_STORE``). Unless it already holds
    exactly these tensors (an earlier save of the run wrote it) they are written there first; then
    its files are hard-linked into ``out_dir / MTP_DIR`` (copied where a link fails).

    A checkpoint saved from a model whose HF directory is itself an export carries them on, as the
    export holds them again. A directory without weights (a config-only ``hf_dir``) has none."""
    if not any((Path(hf_dir) / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)):
        return None
    checkpoint = HFCheckpoint(hf_dir)
    names = mtp_tensor_names(checkpoint, arch)
    if not names:
        return None
    path = Path(out_dir) / MTP_DIR
    if store is None:
        _write(checkpoint, names, path)
        return path
    store = Path(store)
    if not _holds_exactly(store, names):
        shutil.rmtree(store, ignore_errors=True)  # a partial or stale store
        _write(checkpoint, names, store)
    _link_or_copy_files(store, path)
    return path


def _write(checkpoint: HFCheckpoint, names: list[str], path: Path) -> None:
    """``names`` read from ``checkpoint`` one tensor at a time into safetensors shards at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsShardWriter(path, [(n, checkpoint.shape(n), checkpoint.dtype(n)) for n in names])
    for n in names:
        writer.write(n, checkpoint.read(n))
    writer.close()


def _holds_exactly(mtp_dir: Path, names: list[str]) -> bool:
    """Whether ``mtp_dir`` is a readable ``MTP_DIR`` of exactly ``names`` (``HFCheckpoint`` checks
    that every shard its index names is there and has a header)."""
    try:
        return sorted(HFCheckpoint(mtp_dir).names()) == names
    except (OSError, ValueError):  # gone (a deleted checkpoint), or not an HF directory
        return False


def _link_or_copy_files(src: Path, dst: Path) -> None:
    """Each file of ``src`` into ``dst``: a hard link (same inode, no bytes written), or a copy where
    the filesystem refuses one (``EXDEV`` across devices, ``EPERM`` where links are unsupported)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        target = dst / f.name
        try:
            os.link(f, target)
        except OSError:
            shutil.copyfile(f, target)


def saved_mtp(ckpt_dir: str | Path) -> HFCheckpoint | None:
    """The MTP tensors a model checkpoint kept (``MTP_DIR``), or None if it kept none."""
    path = Path(ckpt_dir) / MTP_DIR
    return HFCheckpoint(path) if path.is_dir() else None
