"""`Batch`: the container that carries one PPO/GRPO step's data between the driver and workers.

A `Batch` holds three things:

* ``tensors``: a `tensordict.TensorDict` with ``batch_size=[B]``; every tensor's first
  dimension is the batch dimension.
* ``non_tensors``: ``dict[str, np.ndarray]``; numpy arrays (usually 1-D ``dtype=object``)
  whose first dimension is also ``B``. Lists handed in are stored as 1-D object arrays, one
  element per row, whatever the elements are.
* ``meta_info``: a plain dict of batch-level values (temperature, flags, timing...). It is not
  indexed or split; every part of a split gets a shallow copy.

Standard field names (``B`` rows, ``P`` prompt tokens, ``R`` response tokens):

==========================  ============  ===================================================
tensor                      shape         meaning
==========================  ============  ===================================================
``prompts``                 [B, P]        left-padded prompt token ids
``responses``               [B, R]        right-padded response token ids
``input_ids``               [B, P+R]      prompts followed by responses
``attention_mask``          [B, P+R]      1 on real tokens (prompt and response), 0 on padding
``position_ids``            [B, P+R]      ``cumsum(attention_mask) - 1``, clipped at 0;
                            [B, 3, P+R]   for vision-language models: M-RoPE (time, height,
                                          width) positions, see ``rope_index``
``response_mask``           [B, R]        1 on response tokens that take part in the loss
``rollout_log_probs``       [B, R]        the rollout engine's log-probs of the sampled tokens
``old_log_probs``           [B, R]        the actor's log-probs of them before the update (PPO's
                                          old policy)
``ref_log_probs``           [B, R]        log-probs of the reference policy
``values``                  [B, R]        critic values
``token_level_scores``      [B, R]        reward-function scores (the score sits on the last
                                          valid response token)
``token_level_rewards``     [B, R]        scores after the KL penalty (if any)
``advantages``              [B, R]        advantage estimates
``returns``                 [B, R]        value targets
``rollout_is_weights``      [B, R]        truncated importance weights rollout -> actor policy
                                          (``algorithms.rollout_correction``), 0 on padding
==========================  ============  ===================================================

Non-tensor columns: ``data_source`` (str, picks the reward function), ``reward_model``
(dict with ``ground_truth``), ``extra_info`` (dict), ``index`` (the dataset's id of the prompt,
``extra_info.index``), ``uid`` (set by the trainer, unique per prompt and step: the GRPO-family
estimators group a prompt's responses by it), ``raw_prompt_ids`` (list[int], unpadded prompt
ids for the rollout engine; one ``<|image_pad|>`` per image), ``raw_prompt`` (chat messages,
optional). Vision-language prompts add two per-row columns: ``multi_modal_data``
(``{"image": [PIL.Image, ...]}``, for vLLM) and ``multi_modal_inputs`` (``{"pixel_values":
[num_patches, patch_dim], "image_grid_thw": [num_images, 3]}``, for the model). Their tensors'
first dimension is patches, not rows, so they stay one dict per row: indexing, splitting and
balancing a batch by row keep each row's patches with it. Image tokens are already counted in
``input_ids``/``attention_mask`` (each image's pad is expanded to its merged patch count).

Boundaries: pure data structure. It knows nothing about ranks, Ray or Megatron; splitting a
batch over data-parallel ranks is ``chunk``/``split`` called by the scheduling layer. Pickle is
the serialisation (Ray uses it): CPU tensors travel as numpy arrays, which pickle protocol 5
(Ray's) hands over as raw buffers, ~10x faster than torch's own per-storage pickling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["Batch"]


def _as_non_tensor_column(name: str, value: Any) -> np.ndarray:
    """Store a non-tensor column as a numpy array with the batch on axis 0."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"Batch: non-tensor column '{name}' is a 0-d array; it needs one value per row.")
        return value
    if isinstance(value, (list, tuple)):
        # Fill element by element: np.array(list_of_lists) would build a 2-D array (or fail
        # on ragged lists) instead of one object per row.
        column = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            column[i] = item
        return column
    raise TypeError(
        f"Batch: non-tensor column '{name}' must be a numpy array, list or tuple with one value per row, "
        f"got {type(value).__name__}."
    )


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality that works for tensors, numpy (object) arrays, dicts and lists."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype != object and b.dtype != object:
            return bool(np.array_equal(a, b))
        return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    result = a == b
    return bool(np.all(result)) if isinstance(result, np.ndarray) else bool(result)


_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def _rebuild_batch(tensors: dict, non_tensors: dict, meta_info: dict, size: int) -> Batch:
    """Unpickling a `Batch`: numpy arrays back to tensors (copied when read-only, as arrays in Ray's
    shared-memory object store are: torch must be able to write into its tensors)."""
    tensors = {
        k: torch.from_numpy(v if v.flags.writeable else v.copy()) if isinstance(v, np.ndarray) else v
        for k, v in tensors.items()
    }
    return Batch(tensors, non_tensors, meta_info, batch_size=size)


class Batch:
    """Tensors plus non-tensor columns sharing one batch dimension, plus `meta_info`.

    See the module docstring for the standard field names. Indexing (``batch[idx]``) and the
    split operations return new `Batch` objects; slices are views of the same storage, as with
    torch and numpy. ``batch["name"]`` returns one column.
    """

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ):
        """``batch_size`` is only needed for a batch without columns (its length cannot be inferred)."""
        tensors = dict(tensors.items()) if tensors is not None else {}
        non_tensors = {k: _as_non_tensor_column(k, v) for k, v in (non_tensors or {}).items()}
        overlap = sorted(set(tensors) & set(non_tensors))
        if overlap:
            raise ValueError(f"Batch: keys {overlap} are given both as tensors and as non-tensor columns.")
        lengths: dict[str, int] = {}
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Batch: tensor column '{key}' is a {type(value).__name__}; pass it in non_tensors instead."
                )
            if value.dim() == 0:
                raise ValueError(
                    f"Batch: tensor '{key}' is 0-d; every tensor needs a leading batch dimension."
                )
            lengths[key] = value.shape[0]
        for key, value in non_tensors.items():
            lengths[key] = value.shape[0]
        if len(set(lengths.values())) > 1:
            described = ", ".join(f"{k}={n}" for k, n in lengths.items())
            raise ValueError(
                f"Batch: columns have different lengths ({described}); every tensor and non-tensor column "
                "must share the leading batch dimension."
            )
        size = next(iter(lengths.values()), batch_size or 0)
        if batch_size is not None and size != batch_size:
            raise ValueError(f"Batch: batch_size={batch_size} but the columns have {size} rows.")
        self.tensors = TensorDict(tensors, batch_size=[size])
        self.non_tensors: dict[str, np.ndarray] = non_tensors
        self.meta_info: dict[str, Any] = dict(meta_info or {})

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a batch from a dict of tensors, a dict of per-row columns and batch-level info."""
        return cls(tensors, non_tensors, meta_info)

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __reduce__(self):
        # CPU tensors as numpy arrays (raw buffers under pickle protocol 5); the rest (CUDA tensors,
        # dtypes numpy lacks, such as bfloat16) through torch's own pickling.
        tensors = {
            k: v.numpy() if v.device.type == "cpu" and v.dtype in _NUMPY_DTYPES and not v.requires_grad else v
            for k, v in self.tensors.items()
        }
        return _rebuild_batch, (tensors, self.non_tensors, self.meta_info, len(self))

    @property
    def tensor_keys(self) -> list[str]:
        return list(self.tensors.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensors.keys())

    def keys(self) -> list[str]:
        """All column names, tensors first."""
        return self.tensor_keys + self.non_tensor_keys

    def _has_tensor(self, key: object) -> bool:
        # Through keys(): some tensordict releases reject `key in tensordict`.
        return key in self.tensors.keys()  # noqa: SIM118

    def __contains__(self, key: object) -> bool:
        return self._has_tensor(key) or key in self.non_tensors

    def __iter__(self):
        # Without this, Python would iterate through __getitem__(0), (1), ... which is rarely
        # what anyone means; ask for the explicit operation instead.
        raise TypeError("Batch is not iterable; use batch.keys(), batch[i] or batch.chunk(n).")

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        non_tensors = ", ".join(f"{k}: {v.dtype}" for k, v in self.non_tensors.items())
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors={{{non_tensors}}}, "
            f"meta_info_keys={sorted(self.meta_info)})"
        )

    def _missing(self, key: str) -> KeyError:
        return KeyError(f"Batch has no column '{key}'; columns are {self.keys()}.")

    # ------------------------------------------------------------------ indexing
    def _normalise_index(self, index: Any) -> slice | torch.Tensor:
        """Turn any supported index into a slice or a 1-D int64 tensor of row numbers."""
        n = len(self)
        if isinstance(index, slice):
            return index
        if isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim == 0:
            index = index.item()
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"Batch index {i} is out of range for a batch of {n} rows.")
            i %= n
            return slice(i, i + 1)
        if isinstance(index, torch.Tensor):
            index = index.detach().cpu().numpy()
        index = np.asarray(index)
        if index.dtype == bool:
            if index.shape != (n,):
                raise IndexError(f"Batch: boolean mask has shape {index.shape}, expected ({n},).")
            index = np.flatnonzero(index)
        if index.size == 0:
            index = index.astype(np.int64)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise IndexError(
                f"Batch: unsupported index of dtype {index.dtype} and shape {index.shape}; use an int, a slice, "
                "or a 1-D integer/boolean array or tensor."
            )
        if index.size and (index.min() < -n or index.max() >= n):
            raise IndexError(
                f"Batch: index values must lie in [-{n}, {n}) for a batch of {n} rows, got "
                f"min={index.min()} max={index.max()}."
            )
        return torch.as_tensor(index % n if n else index, dtype=torch.long)

    def __getitem__(self, index: Any) -> Any:
        """``batch["key"]`` returns a column; any other index returns a new `Batch`.

        An int returns a one-row batch (the batch dimension is kept, so it can be concatenated).
        Slices, integer arrays/tensors and boolean masks select and reorder rows.
        """
        if isinstance(index, str):
            if self._has_tensor(index):
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise self._missing(index)
        rows = self._normalise_index(index)
        n = len(self)
        np_rows = rows if isinstance(rows, slice) else rows.numpy()
        return Batch(
            self.tensors[rows],
            {k: v[np_rows] for k, v in self.non_tensors.items()},
            self.meta_info,
            batch_size=len(range(n)[rows]) if isinstance(rows, slice) else len(rows),
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The column ``key``, or ``default`` when the batch has no such column."""
        return self[key] if key in self else default  # noqa: SIM401 (this is get itself)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column; tensors go to ``tensors``, anything else to ``non_tensors``."""
        if not isinstance(key, str):
            raise TypeError(f"Batch column names are strings, got {type(key).__name__}.")
        if isinstance(value, torch.Tensor):
            column_len = value.shape[0] if value.dim() else None
        else:
            value = _as_non_tensor_column(key, value)
            column_len = value.shape[0]
        # The first column of an empty, column-less batch sets its length.
        empty = len(self) == 0 and not self.keys()
        if column_len is None or (column_len != len(self) and not empty):
            raise ValueError(
                f"Batch: column '{key}' has length {column_len}, but the batch has {len(self)} rows."
            )
        if empty:
            self.tensors = TensorDict({}, batch_size=[column_len])
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def reorder(self, indices: Any) -> None:
        """Permute rows in place (verl semantics); ``batch[indices]`` is the copying version."""
        reordered = self[indices]
        if len(reordered) != len(self):
            raise ValueError(f"Batch.reorder: got {len(reordered)} indices for a batch of {len(self)} rows.")
        self.tensors, self.non_tensors = reordered.tensors, reordered.non_tensors

    # ------------------------------------------------------------------ column selection
    def select(
        self,
        keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A new batch with only the named columns; ``None`` keeps all of that kind."""
        keys = self.tensor_keys if keys is None else list(keys)
        non_tensor_keys = self.non_tensor_keys if non_tensor_keys is None else list(non_tensor_keys)
        meta_info_keys = list(self.meta_info) if meta_info_keys is None else list(meta_info_keys)
        for key in keys:
            if not self._has_tensor(key):
                raise KeyError(f"Batch.select: no tensor '{key}'; tensors are {self.tensor_keys}.")
        for key in non_tensor_keys:
            if key not in self.non_tensors:
                raise KeyError(
                    f"Batch.select: no non-tensor column '{key}'; they are {self.non_tensor_keys}."
                )
        for key in meta_info_keys:
            if key not in self.meta_info:
                raise KeyError(f"Batch.select: no meta_info key '{key}'; keys are {sorted(self.meta_info)}.")
        return Batch(
            {k: self.tensors[k] for k in keys},
            {k: self.non_tensors[k] for k in non_tensor_keys},
            {k: self.meta_info[k] for k in meta_info_keys},
            batch_size=len(self),
        )

    def pop(
        self,
        keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> Batch:
        """Remove the named columns from this batch and return them as a new batch."""
        keys, non_tensor_keys, meta_info_keys = list(keys), list(non_tensor_keys), list(meta_info_keys)
        popped = self.select(keys, non_tensor_keys, meta_info_keys)
        for key in keys:
            del self.tensors[key]
        for key in non_tensor_keys:
            del self.non_tensors[key]
        for key in meta_info_keys:
            del self.meta_info[key]
        return popped

    def union(self, other: Batch) -> Batch:
        """A new batch with the columns of both; a key present in both must hold equal values."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"Batch.union: batches have {len(self)} and {len(other)} rows.")
        tensors = dict(self.tensors.items())
        for key, value in other.tensors.items():
            if key in tensors and not _values_equal(tensors[key], value):
                raise ValueError(f"Batch.union: tensor '{key}' differs between the two batches.")
            tensors[key] = value
        non_tensors = dict(self.non_tensors)
        for key, value in other.non_tensors.items():
            if key in non_tensors and not _values_equal(non_tensors[key], value):
                raise ValueError(f"Batch.union: non-tensor column '{key}' differs between the two batches.")
            non_tensors[key] = value
        meta_info = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta_info and not _values_equal(meta_info[key], value):
                raise ValueError(
                    f"Batch.union: meta_info['{key}'] differs between the two batches ({meta_info[key]!r} vs {value!r})."
                )
            meta_info[key] = value
        return Batch(tensors, non_tensors, meta_info, batch_size=max(len(self), len(other)))

    # ------------------------------------------------------------------ splitting and joining
    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive parts of the given sizes (which must sum to ``len(self)``)."""
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != len(self):
            raise ValueError(
                f"Batch.split: sizes {sizes} (sum {sum(sizes)}) must be non-negative and sum to the batch size {len(self)}."
            )
        parts, start = [], 0
        for size in sizes:
            part = self[start : start + size]
            part.meta_info = dict(self.meta_info)
            parts.append(part)
            start += size
        return parts

    def chunk(self, n: int) -> list[Batch]:
        """``n`` equal consecutive parts; the batch size must be divisible by ``n``."""
        if n <= 0:
            raise ValueError(f"Batch.chunk: number of chunks must be positive, got {n}.")
        if len(self) % n:
            raise ValueError(
                f"Batch.chunk: {len(self)} rows cannot be split into {n} equal chunks "
                f"({len(self)} % {n} = {len(self) % n}); use pad_to_divisor({n}) first, or split(sizes)."
            )
        return self.split([len(self) // n] * n)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches row-wise. Columns must match; meta_info is merged, the first batch winning."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat: got an empty list of batches.")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensor_keys) != set(first.tensor_keys) or set(b.non_tensor_keys) != set(
                first.non_tensor_keys
            ):
                raise ValueError(
                    f"Batch.concat: batch {i} has columns {sorted(b.keys())}, batch 0 has {sorted(first.keys())}."
                )
        tensors = {}
        for key in first.tensor_keys:
            parts = [b.tensors[key] for b in batches]
            try:
                tensors[key] = torch.cat(parts, dim=0)
            except RuntimeError as err:
                shapes = [tuple(p.shape) for p in parts]
                raise ValueError(f"Batch.concat: tensor '{key}' has incompatible shapes {shapes}.") from err
        non_tensors = {}
        for key in first.non_tensor_keys:
            parts = [b.non_tensors[key] for b in batches]
            try:
                non_tensors[key] = np.concatenate(parts, axis=0)
            except ValueError as err:
                shapes = [p.shape for p in parts]
                raise ValueError(
                    f"Batch.concat: non-tensor '{key}' has incompatible shapes {shapes}."
                ) from err
        meta_info: dict[str, Any] = {}
        for b in reversed(batches):
            meta_info.update(b.meta_info)
        return Batch(tensors, non_tensors, meta_info, batch_size=sum(len(b) for b in batches))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``aabb`` with ``interleave`` (rollout.n samples), else ``abab``."""
        if n <= 0:
            raise ValueError(f"Batch.repeat: repeat count must be positive, got {n}.")
        rows = np.arange(len(self))
        rows = np.repeat(rows, n) if interleave else np.tile(rows, n)
        return self[rows]

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append copies of the first rows so the size divides by ``divisor``; returns (batch, pad_size)."""
        if divisor <= 0:
            raise ValueError(f"Batch.pad_to_divisor: divisor must be positive, got {divisor}.")
        pad_size = -len(self) % divisor
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("Batch.pad_to_divisor: cannot pad an empty batch (no rows to copy).")
        padding = self[np.arange(pad_size) % len(self)]
        return Batch.concat([self, padding]), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows added by `pad_to_divisor`."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"Batch.unpad: pad_size {pad_size} is outside [0, {len(self)}].")
        return self[: len(self) - pad_size]

    def to(self, device: torch.device | str) -> Batch:
        """Move the tensors to ``device``; non-tensor columns are shared, not copied."""
        return Batch(self.tensors.to(device), self.non_tensors, self.meta_info, batch_size=len(self))
