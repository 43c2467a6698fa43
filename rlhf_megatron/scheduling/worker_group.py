"""Worker groups: one Ray actor per bundle, a torch.distributed world, explicit dispatch.

``WorkerGroup(role, pool, worker_cls, ...)`` starts ``pool.world_size`` Ray
actors of ``worker_cls`` (a ``workers.base.Worker`` subclass), one per bundle,
and wires them into one process group (rank 0's node address and a free port
are the rendezvous). The workers' methods are called as methods of the group's
proxies, typed as the worker class so that an IDE follows a call to the worker's
code and a type checker (or the first call) catches a wrong name:
``group.call.update_critic(batch, step)`` waits for the result,
``group.submit.update_actor(batch, step)`` returns a ``PendingCall`` at once, and
``group.call_within(60).generate(...)`` sets the call's deadline. Each call moves
data the way the method declares (``@dispatch(...)`` on the worker class,
``dispatch.py``):

- ``Dispatch.ALL`` (undeclared methods too): every rank gets the same
  arguments; returns the per-rank results.
- ``Dispatch.DP_COMPUTE``: the ``Batch`` is split into ``dp_size`` equal chunks;
  every TP/PP/CP rank of data-parallel group ``d`` gets chunk ``d``; results are
  collected only from the ranks that own outputs (last PP stage, TP rank 0, CP
  rank 0) and concatenated in DP order (a list of per-DP results when they are
  not Batches). The declaration's ``layout`` names whose data-parallel grouping
  applies: each worker answers ``dispatch_info(layout)`` (the actor also has
  ``rollout``, its rollout engine's grouping).
- ``Dispatch.RANK0``: every rank runs it, rank 0's result is returned.

Failures never hang the driver: results are awaited one at a time with a
deadline; the first exception or dead process raises ``WorkerError`` naming
the role, the rank, the node and the remote traceback, and the remaining
ranks (likely stuck in a collective) are killed. A death names the calls
still queued behind the one it surfaced on: a process killed as a queued call
starts can take the reply of the call before it with it.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform import stacks
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch_spec
from rlhf_megatron.scheduling.resource_pool import ResourcePool

logger = logging.getLogger(__name__)

W = TypeVar("W")
"""The worker class of a group."""
R = TypeVar("R")
"""What a call gives the driver."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


DEATH_GRACE_S = 5.0
"""After a rank raises, how long to watch the others for a dead process (the likelier cause)."""


class WorkerError(RuntimeError):
    """A rank of a worker group raised, died or missed its deadline.

    ``cause``: ``died`` (the process or its node is gone), ``hung`` (the call missed its deadline;
    the group was stopped) or ``raised`` (the worker's code raised; ``detail`` holds its traceback)."""

    def __init__(self, role: str, rank: int | None, node: str, detail: str, cause: str = "raised"):
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"[{role}] {where} on node {node}: {detail}")
        self.role, self.rank, self.node, self.cause = role, rank, node, cause
        self.detail = detail


class PendingCall(Generic[R]):
    """A submitted ``WorkerGroup`` call: ``done()`` polls, ``result()`` waits (raising ``WorkerError``)."""

    pad: int = 0
    """Rows of padding the submitter added (``trainer.rollout_client``), 0 otherwise."""
    rows: int = 0

    def __init__(self, group: WorkerGroup, method: str, refs: list, timeout_s: float, collect):
        self.group, self.method, self.refs = group, method, refs
        self.deadline_s = timeout_s
        self._collect = collect
        self.seq = next(group._seq)  # submission order: every rank runs the group's calls in it
        group._inflight.add(self)

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> R:
        try:
            return self._collect(self.group._wait(self.refs, self.deadline_s, self.method, self))
        finally:
            self.group._inflight.discard(self)


def wait_all(pendings: list[PendingCall]) -> list[Any]:
    """The results of calls on several groups that depend on each other (one collective spanning
    them). The first failure stops every group involved; a process that died is named in preference
    to the peers that then failed talking to it."""
    import ray

    results: dict[int, Any] = {}
    left = dict(enumerate(pendings))
    while left:
        done = [i for i, p in left.items() if p.done()]
        if not done:
            refs = [r for p in left.values() for r in p.refs]
            ray.wait(refs, num_returns=1, timeout=1.0)
            continue
        for i in done:
            try:
                results[i] = left.pop(i).result()
            except WorkerError as err:
                death = None if "process died" in str(err) else _death_among(left.values())
                for p in pendings:
                    p.group.kill()
                raise (death or err) from err
    return [results[i] for i in range(len(pendings))]


def _death_among(pendings) -> WorkerError | None:
    """A ``WorkerError`` naming a dead process among ``pendings`` (within ``DEATH_GRACE_S``), else None."""
    for p in pendings:
        dead = WorkerGroup._dead_peer(list(p.refs), {r: k for k, r in enumerate(p.refs)}, DEATH_GRACE_S)
        if dead is not None:
            rank, err = dead
            return p.group._death_error(rank, p.method, err, call=p)
    return None


class _Methods:
    """A group's workers' methods as attributes (``WorkerGroup.call`` and friends). A name the
    worker class does not define fails at the attribute, naming the class."""

    __slots__ = ("_group", "_wait", "_timeout_s")

    def __init__(self, group: WorkerGroup, wait: bool, timeout_s: float | None):
        self._group, self._wait, self._timeout_s = group, wait, timeout_s

    def __getattr__(self, method: str) -> Callable[..., Any]:
        group = self._group
        if method.startswith("_") or not callable(getattr(group.worker_cls, method, None)):
            raise AttributeError(f"[{group.role}] {group.worker_cls.__name__} has no method {method!r}")

        def run(*args: Any, **kwargs: Any) -> Any:
            pending = group._submit(method, args, kwargs, self._timeout_s)
            return pending.result() if self._wait else pending

        run.__name__ = run.__qualname__ = method
        return run


class WorkerGroup(Generic[W]):
    """The Ray actors of one role (``worker_cls``), colocated in a resource pool's bundles."""

    def __init__(
        self,
        role: str,
        pool: ResourcePool,
        worker_cls: type[W],
        worker_kwargs: Mapping[str, object] | None = None,
        colocated_roles: int = 1,
        env: dict[str, str] | None = None,
        call_timeout_s: float = 3600.0,
        init_timeout_s: float = 300.0,
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role = role
        self.pool = pool
        self.worker_cls = worker_cls
        self.call_timeout_s = call_timeout_s
        share = 1.0 / colocated_roles
        remote_cls = ray.remote(worker_cls)
        slots = pool.slots()
        self.world_size = len(slots)
        base_env = {"RLHF_ROLE": role, **(env or {})}
        self.workers = [
            remote_cls.options(
                num_cpus=pool.cpus_per_process * share,
                num_gpus=share if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                ),
                name=None,
            ).remote(
                role=role,
                rank=rank,
                world_size=self.world_size,
                # The bundle index is the process's index on its node (one placement group per node).
                env={**base_env, "LOCAL_RANK": str(bundle)},
                **(worker_kwargs or {}),
            )
            for rank, (pg, bundle) in enumerate(slots)
        ]
        self.nodes: list[dict[str, Any]] = []
        self.nodes = self._wait([w.node_info.remote() for w in self.workers], init_timeout_s, "node_info")
        master = self.nodes[0]
        self._wait(
            [w.init_distributed.remote(master["ip"], master["free_port"]) for w in self.workers],
            init_timeout_s,
            "init_distributed",
        )
        self._dispatch: dict[str, list[tuple[int, int, bool]]] = {}
        self.killed = False
        # Submitted calls not yet collected (one nobody holds any more drops out when garbage-collected).
        self._inflight: weakref.WeakSet[PendingCall] = weakref.WeakSet()
        self._seq = itertools.count()

    # ------------------------------------------------------------------ calls
    @property
    def call(self) -> W:
        """The workers' methods, each run on the ranks as it declares (see the module docstring)
        and waited for: ``group.call.compute_values(batch)``."""
        return cast(W, _Methods(self, wait=True, timeout_s=None))

    @property
    def submit(self) -> W:
        """The workers' methods, started without waiting: each call returns a ``PendingCall`` whose
        ``.result()`` gives the result (or raises the ``WorkerError``). Calls to one group run in
        the order they were submitted on every rank. Typed as the worker class for the names; the
        calls return ``PendingCall``."""
        return cast(W, _Methods(self, wait=False, timeout_s=None))

    def call_within(self, timeout_s: float) -> W:
        """``call`` with a deadline of ``timeout_s`` seconds instead of the group's ``call_timeout_s``."""
        return cast(W, _Methods(self, wait=True, timeout_s=timeout_s))

    def submit_within(self, timeout_s: float) -> W:
        """``submit`` with a deadline of ``timeout_s`` seconds."""
        return cast(W, _Methods(self, wait=False, timeout_s=timeout_s))

    def _submit(self, method: str, args: tuple, kwargs: dict, timeout_s: float | None) -> PendingCall:
        """Start ``method`` on the ranks as it declares; the proxies' one way in."""
        spec = dispatch_spec(self.worker_cls, method)
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        if spec.mode != Dispatch.DP_COMPUTE:
            rank0 = spec.mode == Dispatch.RANK0
            refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
            return PendingCall(
                self, method, refs, timeout_s, lambda results: results[0] if rank0 else results
            )
        infos = self.dispatch_infos(spec.layout)
        if not args or not isinstance(args[0], Batch):
            raise TypeError(f"[{self.role}] {method} is dispatched by data-parallel rank: pass a Batch first")
        batch, rest = args[0], args[1:]
        dp = infos[0][1]
        if len(batch) % dp:
            raise ValueError(
                f"[{self.role}] {method}: batch of {len(batch)} rows does not split into data-parallel size {dp}; "
                "pad it (Batch.pad_to_divisor) or make the batch size a multiple of the DP size"
            )
        chunks = batch.chunk(dp)
        refs = [
            getattr(w, method).remote(chunks[info[0]], *rest, **kwargs)
            for w, info in zip(self.workers, infos)
        ]

        def collect(results: list) -> Any:
            owned = {info[0]: res for res, info in zip(results, infos) if info[2]}
            ordered = [owned[d] for d in range(dp)]
            if all(isinstance(r, Batch) for r in ordered):
                return Batch.concat(ordered)
            return ordered

        return PendingCall(self, method, refs, timeout_s, collect)

    def dispatch_infos(self, layout: str = "megatron") -> list[tuple[int, int, bool]]:
        """Every rank's (dp_rank, dp_size, owns_output) under ``layout`` (cached once known)."""
        if layout not in self._dispatch:
            infos = self.call.dispatch_info(layout)
            if any(i is None for i in infos):
                missing = [r for r, i in enumerate(infos) if i is None]
                raise RuntimeError(
                    f"[{self.role}] ranks {missing} have no parallel layout yet; build the model first"
                )
            self._dispatch[layout] = [tuple(i) for i in infos]
        return self._dispatch[layout]

    def dp_size(self, layout: str = "megatron") -> int:
        return self.dispatch_infos(layout)[0][1]

    # ------------------------------------------------------------------ failures
    def _node_name(self, rank: int) -> str:
        info = self.nodes[rank] if rank < len(self.nodes) else None
        if isinstance(info, dict):
            return f"{info['hostname']} ({info['ip']}, pid {info['pid']})"
        return "unknown"

    def _wait(self, refs: list, timeout_s: float, what: str, call: PendingCall | None = None) -> list:
        """Results in rank order; the first failure or the deadline raises ``WorkerError``
        (``call``: the submitted call these refs belong to, for the calls queued behind it)."""
        import ray

        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(index[r] for r in pending)
                where = self._hung_stacks(late)
                self.kill()
                raise WorkerError(
                    self.role,
                    None,
                    ", ".join(self._node_name(r) for r in late[:4]),
                    f"{what} did not finish within {timeout_s:.0f} s on ranks {late}; the group was stopped"
                    + (f". Where they were: {where}" if where else ""),
                    cause="hung",
                )
            done, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 5.0))
            for ref in done:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self.kill()
                    raise self._death_error(rank, what, err, call=call) from err
                except ray.exceptions.RayTaskError as err:
                    detail = _ANSI.sub("", str(err))
                    # A rank's collective fails ("Connection reset by peer") the moment a peer
                    # dies, often before Ray reports the death: name the dead rank, the cause.
                    dead = self._dead_peer(pending, index, min(DEATH_GRACE_S, max(remaining, 0.0)))
                    self.kill()
                    if dead is not None:
                        dead_rank, death = dead
                        last_line = detail.strip().splitlines()[-1] if detail.strip() else ""
                        note = f"(rank {rank} then failed too: {last_line})"
                        raise self._death_error(dead_rank, what, death, note, call) from death
                    raise WorkerError(
                        self.role, rank, self._node_name(rank), f"{what} raised:\n{detail}"
                    ) from err
        return [results[r] for r in range(len(refs))]

    def _hung_stacks(self, ranks: list[int]) -> str:
        """Where each late rank on the driver's node was stuck (``platform/stacks.py``), or ""."""
        import ray

        try:
            here = ray.util.get_node_ip_address()
            log_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
        except Exception:  # noqa: BLE001 -- a diagnosis must never hide the hang it diagnoses
            return ""
        local = {
            r: self.nodes[r]["pid"] for r in ranks if r < len(self.nodes) and self.nodes[r]["ip"] == here
        }
        return stacks.describe(stacks.collect(local, log_dir))

    def _death_error(
        self, rank: int, what: str, err: Exception, note: str = "", call: PendingCall | None = None
    ) -> WorkerError:
        # Ray sends a call's reply after the call returns; a process killed just as the next
        # queued call starts can lose it, and the death then surfaces on the earlier call.
        later = [] if call is None else sorted((p.seq, p.method) for p in self._inflight if p.seq > call.seq)
        queued = f" (or in a call queued behind it: {', '.join(m for _, m in later)})" if later else ""
        detail = f"process died during {what}{queued} ({type(err).__name__}): {err}"
        return WorkerError(
            self.role, rank, self._node_name(rank), f"{detail}\n{note}" if note else detail, cause="died"
        )

    @staticmethod
    def _dead_peer(pending: list, index: dict, grace_s: float):
        """(rank, error) of a pending call whose process died within ``grace_s``, else None."""
        import ray

        deadline = time.monotonic() + grace_s
        while pending and (left := deadline - time.monotonic()) > 0:
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    return index[ref], err
                except Exception:  # noqa: BLE001 (another rank's own error: keep looking for a death)
                    continue
        return None

    def kill(self) -> None:
        """Stop every actor of the group at once (no graceful shutdown: ranks may be stuck)."""
        import ray

        self.killed = True
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as err:  # already dead is fine; anything else is worth a line
                logger.debug("killing a %s worker: %s", self.role, err)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Graceful: tear down process groups, then stop the actors (a killed group is already gone)."""
        if self.killed:
            return
        try:
            self._wait([w.shutdown.remote() for w in self.workers], timeout_s, "shutdown")
        finally:
            self.kill()
