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
DeepSeek-V3's MTP layer alone is a full MoE layer (~11B parameters).

Boundaries: safetensors files and names only; no megatron, no model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from rlhf_megatron.models.hf_io import INDEX_FILE, SINGLE_FILE, HFCheckpoint, SafetensorsShardWriter
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["MTP_DIR", "mtp_tensor_names", "save_mtp_tensors", "saved_mtp", "warn_untrained_mtp"]

MTP_DIR = "mtp_layers"
"""In a model checkpoint directory: the HF tensors of the layers past ``num_hidden_layers``
(safetensors shards and index, as an HF model directory holds them)."""

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


def save_mtp_tensors(hf_dir: str | Path, arch: ModelArch, out_dir: str | Path) -> Path | None:
    """Copy the MTP tensors of ``hf_dir``, as stored, into ``out_dir / MTP_DIR``; returns that
    directory, or None (nothing written) if there are none.

    A checkpoint saved from a model whose HF directory is itself an export carries them on, as the
    export holds them again. A directory without weights (a config-only ``hf_dir``) has none."""
    if not any((Path(hf_dir) / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)):
        return None
    checkpoint = HFCheckpoint(hf_dir)
    names = mtp_tensor_names(checkpoint, arch)
    if not names:
        return None
    path = Path(out_dir) / MTP_DIR
    path.mkdir(parents=True, exist_ok=True)
    plan = [(n, checkpoint.shape(n), checkpoint.dtype(n)) for n in names]
    writer = SafetensorsShardWriter(path, plan)
    for n in names:
        writer.write(n, checkpoint.read(n))
    writer.close()
    return path


def saved_mtp(ckpt_dir: str | Path) -> HFCheckpoint | None:
    """The MTP tensors a model checkpoint kept (``MTP_DIR``), or None if it kept none."""
    path = Path(ckpt_dir) / MTP_DIR
    return HFCheckpoint(path) if path.is_dir() else None
