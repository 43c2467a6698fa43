"""What the weight-sync benchmark measures on one rank: one ``engine.update_weights`` timed by phase
with its peak resident memory (``measure_sync``, ``RssSampler``, ``TimedIterator``), the memcpy and
first-touch bandwidths of the same processes (``copy_bandwidth``, ``first_touch_bandwidth``) and
glibc's mmap threshold, which decides whether RSS follows the live tensors
(``set_malloc_mmap_threshold``). ``tests/weights/test_sync_memory.py`` measures with these too.

Boundaries: timing and memory of a sync it is handed; building the actor, the engine and the
syncer is ``engines.py``'s.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterable, Iterator


def set_malloc_mmap_threshold(nbytes: int) -> None:
    """Make glibc serve every allocation of ``nbytes`` or more with its own mmap, unmapped on free.

    By default glibc raises its mmap threshold as large blocks are freed (up
    to 32 MiB) and keeps freed heap memory resident for reuse, so RSS counts
    tensors that are already dead and grows with fragmentation. A fixed
    threshold turns that off (``mallopt(M_MMAP_THRESHOLD)``), and RSS then
    follows the live tensors. Call it early in a fresh process.
    """
    import ctypes

    m_mmap_threshold = -3
    if not ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, int(nbytes)):
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")


def rss_bytes() -> int:
    """This process's resident set size, from /proc (cheap enough to poll every millisecond)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak resident memory above the value at ``__enter__``, polled on a background thread.

    The thread only reads /proc between sleeps; heavy torch ops release the
    GIL, so it keeps sampling while the sync copies tensors.
    """

    def __init__(self, interval_s: float = 0.002, tag=None):
        self.interval_s = interval_s
        self.tag = tag
        """Optional callable; its value at the peak sample is kept as ``peak_tag`` (where the peak was)."""
        self.peak_tag = None
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_extra(self) -> int:
        return self.peak - self.baseline

    def _poll(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            if rss > self.peak:
                self.peak = rss
                self.peak_tag = self.tag() if self.tag else None
            self.samples += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        gc.collect()
        self.baseline = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class TimedIterator:
    """Wraps a (name, tensor) iterator and adds up the seconds spent producing its items (``own_s``).

    Whatever the consumer does between items is not counted, so
    ``wall − own_s`` is the consumer's (vLLM's) share.
    """

    def __init__(self, items: Iterable):
        self._it = iter(items)
        self.own_s = 0.0
        self.count = 0
        self.last_name: str | None = None
        """Name of the last (name, tensor) pair handed out; only the name, so no tensor is kept alive."""

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            item = next(self._it)
        finally:
            self.own_s += time.perf_counter() - t0
        self.count += 1
        self.last_name = item[0]
        return item


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, barrier=None) -> float:
    """Best memcpy bandwidth of ``dst.copy_(src)`` in bytes/s, counting the read and the write.

    Both buffers are touched first so page faults are not timed. ``barrier``
    (called before every repeat) lines the ranks up so they copy at once.
    """
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def first_touch_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 3, barrier=None) -> float:
    """Bytes/s written into freshly allocated memory (page faults included), best of ``repeats``.

    What any step pays that writes into new pages (vLLM re-materialising a
    layer, a gather's output): buffers this large are mmap'ed and returned to
    the OS on free, so every repeat faults its pages in again.
    """
    import torch

    best = float("inf")
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
        buf.fill_(1.0)
        best = min(best, time.perf_counter() - t0)
        del buf
    return nbytes / best


def _retained(baseline: int) -> int:
    """Resident memory still above ``baseline`` once the sync's garbage is collected."""
    gc.collect()
    return rss_bytes() - baseline


def measure_sync(engine, syncer, sample_s: float = 0.002, profile: int = 0) -> dict:
    """One ``engine.update_weights(syncer.iter_weights())``: seconds by phase and peak extra RSS."""
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    stream = TimedIterator(syncer.iter_weights())
    with RssSampler(sample_s, tag=lambda: stream.last_name) as rss:
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.update_weights(stream)
        if profiler:
            profiler.disable()
        total = time.perf_counter() - t0
    out = {
        "total_s": total,
        "generator_s": stream.own_s,
        "load_s": total - stream.own_s,
        **{k: syncer.stats[k] for k in ("gather_s", "broadcast_s", "convert_s")},
        "tensors": stream.count,
        "rss_baseline_bytes": rss.baseline,
        "peak_extra_bytes": rss.peak_extra,
        "peak_after_tensor": rss.peak_tag,
        "retained_bytes": _retained(rss.baseline),
        "rss_samples": rss.samples,
        "peak_bucket_bytes": int(syncer.stats["peak_bucket_bytes"]),
    }
    if profiler:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
        out["profile"] = text.getvalue()
    return out
