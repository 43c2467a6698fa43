"""Model checkpoints in megatron-core's distributed format, with our metadata beside them.

Layout of a model checkpoint directory (what ``tools/convert_ckpt.py
hf-to-mcore`` writes, and what a trainer checkpoint keeps under
``<ckpt>/model/``)::

    <dir>/
      .metadata, *.distcp, common.pt, metadata.json   megatron dist-checkpoint (torch_dist)
      config.json, generation_config.json, tokenizer*  copied from the HF model
      mtp_layers/                                      the HF model's next-token-prediction
                                                       layers, untrained (models/mtp.py)
      rlhf_megatron_ckpt.json                          CheckpointMetadata, written last

The dist-checkpoint is layout-independent: it can be loaded at any TP/PP/VPP
(megatron reshards on load, including the vocabulary padding). Our metadata
file is written after everything else, so its presence marks a complete
checkpoint; it records the ``ModelArch``, the layout it was saved from, the
dtype and a sha256 of every other file.

``iter_checkpoint_tensors`` reads a checkpoint one full tensor (one layer's
slice of megatron's layer-stacked tensors, one expert's slice of a layer's
experts) at a time, in one process, for export without materialising the model.
Mixture-of-experts checkpoints store a layer's experts as one tensor with a
leading expert dimension (``mlp.experts.experts.linear_fc1.weight``: ``[E, ...]``
per layer, ``[L, E, ...]`` stacked), which megatron reshards across EP sizes on
load; a model whose layers are not all alike (dense layers among sparse ones)
stores every layer under its own key (``decoder.layers.3.…``).
"""

from __future__ import annotations

import json
import queue
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_megatron.models.loader import unwrap_model
from rlhf_megatron.models.mtp import save_mtp_tensors
from rlhf_megatron.models.parallel_config import ParallelConfig
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.platform.digests import sha256

__all__ = [
    "CKPT_METADATA_FILE",
    "CheckpointError",
    "CheckpointMetadata",
    "check_checkpoint_sizes",
    "FORMAT_VERSION",
    "checkpoint_tensor_specs",
    "copy_hf_side_files",
    "iter_checkpoint_tensors",
    "load_model_checkpoint",
    "read_checkpoint_metadata",
    "resolve_checkpoint_dir",
    "save_model_checkpoint",
    "sha256_of_files",
    "verify_checkpoint_files",
]

CKPT_METADATA_FILE = "rlhf_megatron_ckpt.json"
FORMAT_NAME = "rlhf_megatron/mcore-dist-checkpoint"
FORMAT_VERSION = 1
# Files of an HF model directory that travel with the weights (not the weights).
HF_SIDE_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
    # Vision-language models: the image processor (and its processor wrapper) load from these.
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# Layer-stacked tensors of the dist-checkpoint: the decoder's, the vision tower's
# (``vision_model.decoder.layers.``) and a vision-language model's language model's.
_LAYERS = "decoder.layers."
# A layer's routed experts in the dist-checkpoint, and the per-expert name the spec uses.
_EXPERTS, _LOCAL_EXPERT = ".mlp.experts.experts.", ".mlp.experts.local_experts.{}."


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt or of another format."""


@dataclass
class CheckpointMetadata:
    """The content of ``rlhf_megatron_ckpt.json``."""

    arch: ModelArch
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    dtype: str
    expert_model_parallel_size: int = 1
    """EP size it was saved at (informational: a checkpoint loads at any EP that divides the experts)."""
    expert_tensor_parallel_size: int | None = None
    """Parameter dtype as saved, e.g. ``float32`` or ``bfloat16``."""
    files: dict[str, str] = field(default_factory=dict)
    """sha256 of every other file in the directory (relative path -> hex digest)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Size in bytes of every file in ``files`` (empty in checkpoints from before sizes were kept)."""
    source: str | None = None
    """Where the weights came from (an HF directory, a training step)."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = {
            "format": self.format,
            "format_version": self.format_version,
            "arch": self.arch.to_dict(),
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
            "padded_vocab_size": self.arch.padded_vocab_size(self.tensor_model_parallel_size),
            "dtype": self.dtype,
            "source": self.source,
            "files": self.files,
            "sizes": self.sizes,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, path: str = CKPT_METADATA_FILE) -> CheckpointMetadata:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
        if data.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path}: format is {data.get('format')!r}, expected {FORMAT_NAME!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {data.get('format_version')} is not supported by this version "
                f"of rlhf_megatron (it reads version {FORMAT_VERSION})"
            )
        return cls(
            arch=ModelArch.from_dict(data["arch"]),
            tensor_model_parallel_size=data["tensor_model_parallel_size"],
            pipeline_model_parallel_size=data["pipeline_model_parallel_size"],
            virtual_pipeline_model_parallel_size=data["virtual_pipeline_model_parallel_size"],
            dtype=data["dtype"],
            expert_model_parallel_size=data.get("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=data.get("expert_tensor_parallel_size"),
            files=data.get("files", {}),
            sizes=data.get("sizes", {}),
            source=data.get("source"),
        )


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The directory holding the model dist-checkpoint: ``path`` itself or ``path/model``."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / CKPT_METADATA_FILE).is_file():
            return candidate
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    raise CheckpointError(
        f"{path} is not an rlhf_megatron model checkpoint: neither {path / CKPT_METADATA_FILE} nor "
        f"{path / 'model' / CKPT_METADATA_FILE} exists (an interrupted save leaves no metadata file)"
    )


def read_checkpoint_metadata(path: str | Path) -> CheckpointMetadata:
    ckpt = resolve_checkpoint_dir(path)
    meta_path = ckpt / CKPT_METADATA_FILE
    return CheckpointMetadata.from_json(meta_path.read_text(), str(meta_path))


def sha256_of_files(
    root: Path, exclude: Sequence[str] = (CKPT_METADATA_FILE,), reuse_linked: bool = False
) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative POSIX path -> digest). ``reuse_linked`` (a
    save): a hard-linked file's is read once per process (``platform.digests``); verification
    reads every file."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in exclude:
            continue
        out[rel] = sha256(path, reuse_linked)
    return out


def verify_checkpoint_files(ckpt_dir: Path, meta: CheckpointMetadata) -> None:
    """Raise ``CheckpointError`` naming any file that is missing or whose sha256 differs."""
    if not meta.files:
        raise CheckpointError(f"{ckpt_dir / CKPT_METADATA_FILE} lists no files; the checkpoint is incomplete")
    missing = [f for f in meta.files if not (ckpt_dir / f).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: checkpoint files missing: {', '.join(missing)}")
    actual = sha256_of_files(ckpt_dir)
    bad = [f for f, digest in meta.files.items() if actual.get(f) != digest]
    if bad:
        raise CheckpointError(f"{ckpt_dir}: sha256 mismatch (corrupt or modified) for: {', '.join(bad)}")


def check_checkpoint_sizes(ckpt_dir: Path, meta: CheckpointMetadata) -> None:
    """Cheap integrity check (no reads): every listed file exists with its recorded size."""
    for rel in meta.files:
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (listed in {CKPT_METADATA_FILE})")
        expected = meta.sizes.get(rel)
        if expected is not None and path.stat().st_size != expected:
            raise CheckpointError(
                f"checkpoint file {path} is {path.stat().st_size} bytes, {CKPT_METADATA_FILE} says {expected} "
                "(truncated or overwritten); restore it or re-create the checkpoint"
            )


def copy_hf_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and tokenizer files of an HF directory; returns their names."""
    copied = []
    for pattern in HF_SIDE_FILE_PATTERNS:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and path.name not in copied:
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return copied


def _sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict:
    models = [unwrap_model(c) for c in chunks]
    if len(models) == 1:
        return models[0].sharded_state_dict()
    # One entry per virtual stage; the sharded tensors inside carry global keys,
    # so the nesting does not tie the checkpoint to this VPP size.
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def _in_process_write_results() -> None:
    """Give megatron's checkpoint writer an in-process queue for its results.

    megatron's ``torch_dist`` writer forks processes that write the files, and the call that
    collects them puts the results on a queue that the save then reads. It creates that queue
    on first use as ``multiprocessing.get_context("spawn").Manager().Queue()``: a new Python
    interpreter, ~3 s of every process's first save on a 2-core machine. A synchronous save
    (the only kind here) puts and reads it in this process, where a plain ``queue.Queue`` does
    the same. An asynchronous save (``async_sharded_save``, not used) would need the manager's."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def save_model_checkpoint(
    model_chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | Path,
    arch: ModelArch,
    parallel: ParallelConfig,
    *,
    hf_dir: str | Path | None = None,
    source: str | None = None,
    mtp_store: str | Path | None = None,
) -> CheckpointMetadata:
    """Save this rank's chunks into ``ckpt_dir`` (collective over all ranks).

    After megatron's save, rank 0 copies the HF side files from ``hf_dir`` and
    its next-token-prediction layers' tensors (``models/mtp.py``; hard-linked from ``mtp_store``, a
    directory that a run's first save fills, when given), hashes every file and writes
    ``rlhf_megatron_ckpt.json`` last.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    if torch.distributed.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    _in_process_write_results()
    dist_checkpointing.save(_sharded_state_dict(model_chunks), str(ckpt_dir))
    torch.distributed.barrier()  # every rank's shards are on disk before they are hashed
    dtype = next(unwrap_model(model_chunks[0]).parameters()).dtype
    meta = CheckpointMetadata(
        arch=arch,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        dtype=str(dtype).removeprefix("torch."),
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size if arch.moe is not None else None,
        source=source,
    )
    if torch.distributed.get_rank() == 0:
        if hf_dir is not None:
            copy_hf_side_files(Path(hf_dir), ckpt_dir)
            save_mtp_tensors(hf_dir, arch, ckpt_dir, store=mtp_store)  # untrained MTP layers, for the export
        meta.files = sha256_of_files(ckpt_dir, reuse_linked=True)
        meta.sizes = {rel: (ckpt_dir / rel).stat().st_size for rel in meta.files}
        (ckpt_dir / CKPT_METADATA_FILE).write_text(meta.to_json())
    torch.distributed.barrier()
    return meta


def load_model_checkpoint(
    model_chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path, verify_sha256: bool = False
) -> CheckpointMetadata:
    """Load a model checkpoint saved at any layout into this rank's chunks (collective).

    Always checks that every file of the metadata exists with its recorded size (a
    truncated shard otherwise loads as garbage or fails deep inside torch); with
    ``verify_sha256`` also hashes every file (reads the whole checkpoint once more).
    """
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint_dir(ckpt_dir)
    meta = read_checkpoint_metadata(ckpt)
    if verify_sha256:
        verify_checkpoint_files(ckpt, meta)
    else:
        check_checkpoint_sizes(ckpt, meta)
    state = dist_checkpointing.load(_sharded_state_dict(model_chunks), str(ckpt))
    if len(model_chunks) == 1:
        unwrap_model(model_chunks[0]).load_state_dict(state)
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap_model(chunk).load_state_dict(state[f"model{i}"])
    return meta


@dataclass(frozen=True)
class TensorSpec:
    """One full megatron tensor of a checkpoint: a slice of a stored tensor along its leading
    layer and/or expert dimensions (``offsets``), or a whole one."""

    name: str  # global megatron name, e.g. decoder.layers.3.mlp.linear_fc1.weight
    key: str  # key in the dist-checkpoint, e.g. decoder.layers.mlp.linear_fc1.weight
    layer: int | None
    num_layers: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: int | None = None
    """The global expert index of a routed expert's weight."""
    offsets: tuple[tuple[int, int, int], ...] = ()
    """``(dim, index, size)`` of each leading dimension this tensor is one entry of."""


def _split_leading(key: str, sh) -> list[TensorSpec]:
    """The per-layer (and per-expert) tensors of one stored tensor."""
    at = key.find(_LAYERS)
    shape, dtype = tuple(sh.global_shape), sh.dtype
    if at < 0:
        return [TensorSpec(key, key, None, None, shape, dtype)]
    prefix, rest = key[: at + len(_LAYERS)], key[at + len(_LAYERS) :]
    stacked = not rest.split(".", 1)[0].isdigit()  # decoder.layers.mlp.… vs decoder.layers.3.mlp.…
    layers = [(i, (0, i, shape[0])) for i in range(shape[0])] if stacked else [(None, None)]
    dim = int(stacked)  # where the expert dimension sits
    out = []
    for layer, layer_offset in layers:
        base = f"{prefix}{layer}.{rest}" if stacked else key
        lead = (layer_offset,) if stacked else ()
        if _EXPERTS not in base:
            out.append(
                TensorSpec(base, key, layer, shape[0] if stacked else None, shape[dim:], dtype, None, lead)
            )
            continue
        for e in range(shape[dim]):
            name = base.replace(_EXPERTS, _LOCAL_EXPERT.format(e))
            offsets = (*lead, (dim, e, shape[dim]))
            out.append(TensorSpec(name, key, layer, None, shape[dim + 1 :], dtype, e, offsets))
    return out


def checkpoint_tensor_specs(ckpt_dir: str | Path) -> list[TensorSpec]:
    """The model tensors in a checkpoint: embedding, then layer by layer, then the rest.

    Layer-stacked tensors are split per layer, a layer's experts per expert.
    """
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    head, layers, tail = [], [], []
    for key, sh in metadata.items():
        if key.startswith("optimizer."):
            continue
        for spec in _split_leading(key, sh):
            if _LAYERS in spec.name:
                layers.append(spec)
            elif key.startswith(("embedding.", "language_model.embedding.", "vision_model.")):
                head.append(spec)
            else:
                tail.append(spec)
    # Vision blocks before the language model's layers, each in layer order (stable: keeps the
    # key order within a layer).
    layers.sort(key=lambda t: (not t.key.startswith("vision_model."), _layer_of(t.name)))
    return head + layers + tail


def _layer_of(name: str) -> int:
    at = name.find(_LAYERS)
    return int(name[at + len(_LAYERS) :].split(".", 1)[0])


def iter_checkpoint_tensors(
    ckpt_dir: str | Path, specs: Sequence[TensorSpec] | None = None
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Yield each full tensor of a checkpoint, reading only that tensor from disk.

    Needs ``torch.distributed`` initialised (a one-process gloo group is
    enough): megatron's loader is collective-aware even when alone.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    ckpt_dir = str(ckpt_dir)
    for spec in specs if specs is not None else checkpoint_tensor_specs(ckpt_dir):
        # One entry of each leading (layer, expert) dimension: a [1, 1, ...] slice of the stored tensor.
        lead = len(spec.offsets)
        target = ShardedTensor.from_rank_offsets(
            spec.key, torch.empty((1,) * lead + spec.shape, dtype=spec.dtype), *spec.offsets, replica_id=0
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # validate_access_integrity checks that all ranks together read
            # every shard exactly once; reading one slice alone is the point here.
            out = dist_checkpointing.load({"t": target}, ckpt_dir, validate_access_integrity=False)["t"]
        yield spec, out.reshape(spec.shape)
