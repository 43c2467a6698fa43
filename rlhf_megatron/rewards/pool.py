"""`ScoringPool`: run a reward function over many rows in worker processes, with a per-row timeout.

A user's reward function can hang (a regex blow-up, a sympy simplification, a sandbox that
never answers). Threads cannot be stopped, so scoring runs in a
`concurrent.futures.ProcessPoolExecutor` ('spawn' context: no inherited locks or CUDA state),
and a row that runs longer than ``timeout_s`` gets its worker killed.

How the timeout is measured: each worker announces ``(task, start time)`` on a queue when it
*starts* a row, so queueing behind other rows does not count against a row's budget. When a
row exceeds the budget, every worker of the pool is killed (ProcessPoolExecutor cannot lose a
single worker without breaking), rows that had not finished are resubmitted to a fresh pool,
and the late row is reported as a timeout. If a worker dies on its own (``os._exit`` or a
segfault in user code), the pool cannot say which running row did it: rows that had not
started are resubmitted, and each row that was running is rerun alone, so the culprit is
reported as an error and the innocent rows still get scored. No row is retried forever.

Boundaries: generic over the function; it returns per-row outcomes and leaves policy (raise or
score zero) to the reward manager. Imports no torch, so workers start fast.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "ScoringPool", "WorkerDiedError"]

_POLL_S = 0.05  # how often deadlines are checked while rows run

_worker_fn: Callable[..., Any] | None = None
_worker_started: Any = None


class WorkerDiedError(RuntimeError):
    """The worker process scoring a row exited without returning."""


def _init_worker(fn: Callable[..., Any], started: Any) -> None:
    global _worker_fn, _worker_started
    _worker_fn, _worker_started = fn, started


def _run(task: int, kwargs: dict) -> Any:
    _worker_started.put((task, os.getpid(), time.monotonic()))
    return _worker_fn(**kwargs)


@dataclass
class Outcome:
    """What happened to one row: ``status`` is 'ok' (``value`` set), 'error' (``error`` set) or 'timeout'."""

    status: str
    value: Any = None
    error: BaseException | None = None
    elapsed_s: float = 0.0


class ScoringPool:
    """A lazily started pool of ``num_workers`` processes that call ``fn(**kwargs)`` per row."""

    def __init__(
        self, fn: Callable[..., Any], num_workers: int, timeout_s: float | None = None, context: str = "spawn"
    ):
        if num_workers <= 0:
            raise ValueError(f"ScoringPool: num_workers must be positive, got {num_workers}.")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"ScoringPool: timeout_s must be positive or None, got {timeout_s}.")
        self.fn = fn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._ctx = multiprocessing.get_context(context)
        self._executor: ProcessPoolExecutor | None = None
        self._started: Any = None
        self.killed_pids: list[int] = []  # workers killed over the pool's life (for tests and logs)

    # ------------------------------------------------------------------ lifecycle
    def _ensure_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # SimpleQueue writes synchronously, so a start message is not lost if the worker
            # dies right after. A fresh queue per executor: a worker killed mid-put could
            # leave the old one's lock held.
            self._started = self._ctx.SimpleQueue()
            self._executor = ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=self._ctx,
                initializer=_init_worker,
                initargs=(self.fn, self._started),
            )
        return self._executor

    def _workers(self, executor: ProcessPoolExecutor) -> list:
        # ProcessPoolExecutor has no public handle on its processes before Python 3.14
        # (terminate_workers); `_processes` ({pid: Process}) has been stable since 3.2.
        return list((getattr(executor, "_processes", None) or {}).values())

    def _kill(self) -> None:
        """Kill every worker and drop the executor; the next call starts a new one."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = self._workers(executor)
        for process in processes:
            if process.is_alive():
                self.killed_pids.append(process.pid)
                process.kill()  # SIGKILL: a hung function may ignore SIGTERM
        executor.shutdown(wait=True, cancel_futures=True)
        for process in processes:
            process.join(timeout=5)
        self._close_queue()

    def _close_queue(self) -> None:
        if self._started is not None:
            self._started.close()
            self._started = None

    def close(self) -> None:
        """Stop the workers (killing any that are still busy)."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            processes = self._workers(executor)
            executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.join(timeout=1)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
            self._close_queue()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring
    def _drain_started(self, started: dict[int, float]) -> None:
        # Safe without a lock: this process is the queue's only reader.
        while not self._started.empty():
            task, _pid, t = self._started.get()
            started[task] = t

    def map(self, kwargs_list: list[dict]) -> list[Outcome]:
        """One `Outcome` per element of ``kwargs_list``, in order."""
        outcomes: list[Outcome | None] = [None] * len(kwargs_list)
        pending, suspects = list(range(len(kwargs_list))), []
        while pending or suspects:
            if suspects:
                # Rows that were running when a worker died: rerun each alone, so the one that
                # kills its worker is identified and the others are scored normally.
                retry, _ = self._run_round(kwargs_list, [suspects.pop(0)], outcomes, isolated=True)
                pending += retry
            else:
                pending, new_suspects = self._run_round(
                    kwargs_list, pending, outcomes, isolated=self.num_workers == 1
                )
                suspects += new_suspects
        return outcomes  # type: ignore[return-value]

    def _run_round(
        self, kwargs_list: list[dict], pending: list[int], outcomes: list[Outcome | None], isolated: bool
    ) -> tuple[list[int], list[int]]:
        """Submit ``pending`` to one executor. Returns (rows to retry, rows suspected of killing a
        worker). With ``isolated`` at most one row runs at a time, so a running row that loses its
        worker is the culprit and gets an error outcome instead of being suspected."""
        executor = self._ensure_executor()
        futures: dict[Future, int] = {executor.submit(_run, i, kwargs_list[i]): i for i in pending}
        started: dict[int, float] = {}
        not_done, broken, timed_out = set(futures), False, False
        while not_done and not broken:
            done, not_done = wait(
                not_done, timeout=_POLL_S if self.timeout_s else None, return_when=FIRST_COMPLETED
            )
            self._drain_started(started)
            for future in done:
                broken |= self._record(future, futures[future], started, outcomes)
            if self.timeout_s is not None and not broken:
                now = time.monotonic()
                for future in not_done:
                    i = futures[future]
                    if i in started and now - started[i] > self.timeout_s:
                        outcomes[i] = Outcome("timeout", elapsed_s=now - started[i])
                        broken = timed_out = True
        if not broken:
            return [], []

        self._drain_started(started)
        self._kill()
        for future, i in futures.items():  # rows that finished just before the kill still count
            if (
                outcomes[i] is None
                and future.done()
                and not future.cancelled()  # the kill cancels queued rows; exception() would raise
                and not isinstance(future.exception(), BrokenProcessPool)
            ):
                self._record(future, i, started, outcomes)
        unfinished = [i for i in pending if outcomes[i] is None]
        if timed_out:
            return unfinished, []  # the kill interrupted these rows; they were not at fault
        if not started:
            # Nothing ever started: the workers cannot initialise (e.g. the function fails to unpickle).
            error = WorkerDiedError(
                "scoring workers failed to start; is the reward function importable in a new process?"
            )
            for i in unfinished:
                outcomes[i] = Outcome("error", error=error)
            return [], []
        # A worker died on its own. Rows that had not started are retried; the ones running are
        # suspects, or, when they ran alone, the culprit (so a crashing row is never retried forever).
        running = [i for i in unfinished if i in started]
        if isolated:
            for i in running:
                outcomes[i] = Outcome(
                    "error", error=WorkerDiedError("the scoring worker died while scoring this row")
                )
            running = []
        return [i for i in unfinished if i not in started], running

    @staticmethod
    def _record(future: Future, i: int, started: dict[int, float], outcomes: list[Outcome | None]) -> bool:
        """Store a finished row's outcome; return True if the pool turned out to be broken."""
        error = future.exception()
        if isinstance(error, BrokenProcessPool):
            return True
        elapsed = time.monotonic() - started.get(i, time.monotonic())
        outcomes[i] = (
            Outcome("ok", value=future.result(), elapsed_s=elapsed)
            if error is None
            else Outcome("error", error=error, elapsed_s=elapsed)
        )
        return False
