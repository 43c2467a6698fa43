"""Reading and writing Hugging Face safetensors checkpoints, one tensor (or slice) at a time.

- ``HFCheckpoint``: an index over a model directory (``model.safetensors`` or
  shards + ``model.safetensors.index.json``) that is a ``spec.TensorSource``:
  it reads whole tensors or slices through ``safe_open(...).get_slice``,
  opening the file per read so no mapping (and no resident page of it)
  outlives the read. The directory is validated when opened: a missing
  shard, a tensor the index promises but the shard lacks, or a truncated
  header is an error naming the file.
- ``SafetensorsShardWriter``: writes shards whose tensors arrive one by one,
  in an order planned up front, so exporting never holds more than one tensor.

No megatron here; only ``safetensors`` and the file format.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["HFCheckpoint", "HFCheckpointError", "SafetensorsShardWriter", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class HFCheckpointError(ValueError):
    """The HF checkpoint directory is incomplete or inconsistent; the message names the file."""


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise HFCheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise HFCheckpointError(f"{path} is not a safetensors file (header length {n})")
            header = f.read(n)
            size = path.stat().st_size
    except OSError as e:
        raise HFCheckpointError(f"cannot read {path}: {e}") from e
    if len(header) < n:
        raise HFCheckpointError(f"{path} is truncated: its header is cut short")
    try:
        meta = json.loads(header)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    meta.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in meta.values()), default=0)
    if 8 + n + end > size:
        raise HFCheckpointError(f"{path} is truncated: tensors need {8 + n + end} bytes, the file has {size}")
    return meta


class HFCheckpoint:
    """The tensors of an HF model directory: names, shapes, files, and sliced reads."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise HFCheckpointError(f"{self.dir} is not a directory")
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFCheckpointError(
                    f"{index} is not a valid safetensors index (needs 'weight_map'): {e}"
                ) from e
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise HFCheckpointError(
                    f"{index} references {len(missing)} missing shard file(s): {', '.join(missing)}; "
                    "copy the complete checkpoint"
                )
        elif (self.dir / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            found = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = f" (found {found[:3]}: convert PyTorch .bin weights to safetensors first)" if found else ""
            raise HFCheckpointError(f"{self.dir} has neither {INDEX_FILE} nor {SINGLE_FILE}{hint}")
        # name -> (file, name stored in the file, shape, dtype)
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            path = self.dir / file
            for name, info in _read_header(path).items():
                if info["dtype"] not in _DTYPES:
                    raise HFCheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
                self._entries[name] = (path, name, tuple(info["shape"]), _DTYPES[info["dtype"]])
        if weight_map is not None:
            for name, file in weight_map.items():
                entry = self._entries.get(name)
                if entry is None or entry[0].name != file:
                    raise HFCheckpointError(
                        f"{index} maps tensor {name} to {file}, but {file} does not contain it"
                    )
        # Checkpoints of a bare base model (LlamaModel) lack the "model." prefix.
        if not any(n.startswith("model.") for n in self._entries):
            for name in list(self._entries):
                self._entries.setdefault("model." + name, self._entries[name])

    # -- spec.TensorSource ------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise HFCheckpointError(f"tensor {name} is not in the checkpoint at {self.dir}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[3]

    def where(self, name: str) -> str:
        return f"tensor {name} in {self._entry(name)[0]}"

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        path, stored, shape, _ = self._entry(name)
        # Opened per read: the mapping (and the pages it made resident) goes away
        # with the handle, so reading a model never accumulates it in memory.
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(stored)
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, shape[dim] if stop is None else stop)
            return sl[tuple(index)]


class SafetensorsShardWriter:
    """Writes ``model-0000k-of-0000n.safetensors`` shards plus the index, one tensor at a time.

    ``plan`` lists every tensor ``(name, shape, dtype)`` in the order ``write``
    will receive them; shard boundaries and headers come from it, so each
    tensor's bytes go straight to disk.
    """

    def __init__(
        self,
        out_dir: str | Path,
        plan: Sequence[tuple[str, Sequence[int], torch.dtype]],
        max_shard_bytes: int = 2 * 1024**3,
    ):
        self.dir = Path(out_dir)
        self._plan = [(n, tuple(int(s) for s in shape), dt) for n, shape, dt in plan]
        shards: list[list[int]] = [[]]
        size = 0
        for i, (_, shape, dt) in enumerate(self._plan):
            nbytes = _nbytes(shape, dt)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nbytes
        n = len(shards)
        self._files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self._shard_of = {i: k for k, members in enumerate(shards) for i in members}
        self._shards = shards
        self._next = 0
        self._handle = None
        self.total_bytes = sum(_nbytes(s, d) for _, s, d in self._plan)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._plan):
            raise RuntimeError(
                f"SafetensorsShardWriter: {name} arrived after the planned {len(self._plan)} tensors"
            )
        want_name, shape, dtype = self._plan[self._next]
        if name != want_name or tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"SafetensorsShardWriter: expected {want_name} {list(shape)} next, got {name} {list(tensor.shape)}"
            )
        shard = self._shard_of[self._next]
        if self._handle is None:
            self._open(shard)
        data = tensor.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(data.numpy()))
        self._next += 1
        if self._next == len(self._plan) or self._shard_of[self._next] != shard:
            self._handle.close()
            self._handle = None

    def _open(self, shard: int) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in self._shards[shard]:
            name, shape, dt = self._plan[i]
            nbytes = _nbytes(shape, dt)
            header[name] = {
                "dtype": _DTYPE_NAMES[dt],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        self._handle = open(self.dir / self._files[shard], "wb")  # noqa: SIM115 - closed when the shard is full
        self._handle.write(struct.pack("<Q", len(raw)))
        self._handle.write(raw)

    def close(self) -> list[str]:
        """Check every planned tensor was written, write the index; returns the shard file names."""
        if self._next != len(self._plan):
            missing = [n for n, _, _ in self._plan[self._next :]]
            raise RuntimeError(
                f"SafetensorsShardWriter: {len(missing)} planned tensors never arrived: {missing[:5]}"
            )
        weight_map = {name: self._files[self._shard_of[i]] for i, (name, _, _) in enumerate(self._plan)}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return list(self._files)


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
