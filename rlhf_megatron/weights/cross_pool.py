"""Weight sync across resource pools: the trainer's rank 0 streams buckets to every rollout rank.

With the rollout on its own pool (``actor_rollout_ref.hybrid_engine=false``) the
sync is the colocated one plus one hop. Every training rank executes the plan
(gathers over TP/EP/PP inside the trainer's world, ``execute.WeightSyncer``), so
training rank 0 holds each bucket's full HF-named tensors; it then broadcasts the
bucket over a process group of its own that spans both pools (gloo on CPU, NCCL on
GPU): group rank 0 is the sender, group ranks ``1..R`` the rollout ranks
(``CrossPoolRoute``; the two sets never overlap). Each rollout rank hands the
tensors to its vLLM engine, whose loader slices them for its own TP rank.

Pipelining: on both sides a background thread moves buckets while the main thread
works, through a queue of depth one. The sender's thread broadcasts bucket ``k``
while the main thread gathers bucket ``k+1``; the receiver's thread receives
bucket ``k+1`` while vLLM loads bucket ``k``. Peak extra memory is bounded by three
buckets per side (one being produced, one queued, one on the wire).

Wire format per bucket: a length (int64), a header (UTF-8 JSON: the weight version
and each tensor's name, shape and dtype), then one flat buffer per dtype. An empty
tensor list ends the stream, so a receiver never guesses how many buckets come.

Atomicity: ``RolloutWorker`` runs one call at a time, so a generation never starts
while a sync is loading; a sync that fails half-way (the sender died) leaves the
engine marked unusable, and the next generation refuses to run.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

_END = object()


@dataclass(frozen=True)
class CrossPoolRoute:
    """Source and destination ranks of a cross-pool sync and their ranks in its process group."""

    sources: tuple[int, ...]
    """Training ranks (of the trainer's world) that send: rank 0, which holds every full tensor
    after the plan's gathers and broadcasts."""
    destinations: tuple[int, ...]
    """Rollout ranks (of the rollout's world) that receive: all of them (each vLLM TP rank loads
    full HF tensors and slices its own part)."""

    def __post_init__(self):
        if len(self.sources) != 1:
            raise ValueError(f"CrossPoolRoute: one sending training rank is supported, got {self.sources}")
        if not self.destinations or len(set(self.destinations)) != len(self.destinations):
            raise ValueError(
                f"CrossPoolRoute: destinations {self.destinations} must be distinct and non-empty"
            )

    @classmethod
    def of(cls, rollout_world: int) -> CrossPoolRoute:
        return cls(sources=(0,), destinations=tuple(range(rollout_world)))

    @property
    def group_size(self) -> int:
        return len(self.sources) + len(self.destinations)

    def group_rank(self, pool: str, rank: int) -> int | None:
        """This process's rank in the sync group (``pool`` is ``trainer`` or ``rollout``), or None."""
        if pool == "trainer":
            return self.sources.index(rank) if rank in self.sources else None
        if pool == "rollout":
            return len(self.sources) + self.destinations.index(rank) if rank in self.destinations else None
        raise ValueError(f"CrossPoolRoute.group_rank: unknown pool {pool!r}")


def open_sync_group(
    host: str, port: int, group_rank: int, group_size: int, timeout_s: float = 600.0
) -> SyncGroup:
    """A process group of its own over a TCP store hosted by group rank 0 (NCCL on GPU, gloo on CPU).

    It lives beside each process's own ``torch.distributed`` world (the trainer's, the rollout's)
    and is used only through its own methods."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, group_size, group_rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("rlhf_weight_sync", store)
    if torch.cuda.is_available():
        group = dist.ProcessGroupNCCL(prefixed, group_rank, group_size)
    else:
        group = dist.ProcessGroupGloo(prefixed, group_rank, group_size, timeout)
    return SyncGroup(group, store)


@dataclass
class SyncGroup:
    """The process group and its TCP store (which must outlive it: group rank 0 hosts the store)."""

    group: object
    store: object


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _broadcast(sync: SyncGroup, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    sync.group.broadcast([tensor], opts).wait()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: the sender announced an unknown dtype {name!r}")
    return dtype


class _Pipe:
    """A depth-one queue between the main thread and a worker thread; the thread's error is kept
    and raised by ``join``. Both sides poll, so neither waits forever on a dead partner."""

    def __init__(self, target, name: str):
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _run(self, target) -> None:
        try:
            target(self)
        except BaseException as err:  # noqa: BLE001 (re-raised in the main thread by join)
            self.error = err
            return
        self.put(_END)  # wake the consumer now rather than at its next poll

    def put(self, item) -> bool:
        """Hand ``item`` over; False when the thread has died (``join`` raises its error)."""
        while self.error is None:
            try:
                self.queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        """The next item, or ``_END`` when the thread finished or died."""
        while True:
            try:
                return self.queue.get(timeout=0.5)
            except queue.Empty:
                if not self.thread.is_alive():  # it may have put a last item just before ending
                    try:
                        return self.queue.get_nowait()
                    except queue.Empty:
                        return _END

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def send_buckets(group, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
    """Broadcast every bucket from group rank 0; returns ``send_s`` (time on the wire, overlapped with
    producing the buckets), ``wait_s`` (the main thread waiting for the wire) and ``bytes``."""
    stats = {"send_s": 0.0, "wait_s": 0.0, "bytes": 0.0}

    def wire(pipe: _Pipe) -> None:
        while True:
            item = pipe.get()
            if item is _END:
                return
            start = time.perf_counter()
            for tensor in item:
                _broadcast(group, tensor)
            del item, tensor
            stats["send_s"] += time.perf_counter() - start

    pipe = _Pipe(wire, "weight-sync-send")
    try:
        for bucket in itertools.chain(buckets, [[]]):  # an empty bucket ends the stream
            frames = _frames(bucket, version)
            del bucket  # the frames are copies: free the bucket before the next is gathered
            stats["bytes"] += sum(f.numel() * f.element_size() for f in frames[2:])
            start = time.perf_counter()
            delivered = pipe.put(frames)
            del frames
            stats["wait_s"] += time.perf_counter() - start
            if not delivered:
                break
    finally:
        pipe.put(_END)
        pipe.join()
    return stats


def _frames(bucket: list[tuple[str, torch.Tensor]], version: int) -> list[torch.Tensor]:
    device = _device()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, tensor in bucket:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
    header = json.dumps(
        {
            "version": version,
            "tensors": [[name, list(t.shape), str(t.dtype)] for name, t in bucket],
            "flats": [str(d) for d in by_dtype],
        }
    ).encode()
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    frames = [torch.tensor([payload.numel()], dtype=torch.int64, device=device), payload]
    frames += [torch.cat(parts).to(device) for parts in by_dtype.values()]
    return frames


def receive_buckets(group, stats: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as the sender streams them, bucket by bucket; the next bucket is on the
    wire while the caller consumes this one. ``stats`` receives ``version``, ``recv_s`` and ``bytes``."""
    stats = stats if stats is not None else {}
    stats.update(recv_s=0.0, bytes=0.0)
    device = _device()

    def wire(pipe: _Pipe) -> None:
        while True:
            start = time.perf_counter()
            length = torch.empty(1, dtype=torch.int64, device=device)
            _broadcast(group, length)
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
            _broadcast(group, payload)
            header = json.loads(bytes(payload.cpu().numpy()).decode())
            flats = {}
            for name in header["flats"]:
                dtype = _dtype(name)
                count = sum(
                    torch.Size(shape).numel() for _, shape, d in header["tensors"] if _dtype(d) == dtype
                )
                flats[dtype] = torch.empty(count, dtype=dtype, device=device)
                _broadcast(group, flats[dtype])
            stats["recv_s"] += time.perf_counter() - start
            stats["version"] = header["version"]
            if not header["tensors"]:
                return
            offsets = dict.fromkeys(flats, 0)
            out = []
            for name, shape, d in header["tensors"]:
                dtype, numel = _dtype(d), torch.Size(shape).numel()
                out.append((name, flats[dtype][offsets[dtype] : offsets[dtype] + numel].view(shape)))
                offsets[dtype] += numel
            stats["bytes"] += sum(f.numel() * f.element_size() for f in flats.values())
            if not pipe.put(out):
                return
            del out

    pipe = _Pipe(wire, "weight-sync-receive")
    while (item := pipe.get()) is not _END:
        yield from item
    pipe.join()
