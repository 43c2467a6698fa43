"""How a worker method's arguments reach the ranks and its results come back, declared on the method.

A worker class declares each method's dispatch once, where the method is written::

    @dispatch(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch: ...

and every ``WorkerGroup.call.compute_log_prob(batch)`` uses it (``worker_group.py`` explains
the modes). A method without a declaration runs on every rank with the same arguments
(``Dispatch.ALL``), as verl's default does.

Boundaries: standard library only; reads the method's attribute, never scans a class for them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Dispatch", "DispatchSpec", "dispatch", "dispatch_spec"]

F = TypeVar("F", bound=Callable)


class Dispatch(str, enum.Enum):
    """How a call's arguments are split over the ranks and which results come back."""

    ALL = "all"
    """Every rank gets the same arguments; the driver gets every rank's result (a list)."""
    DP_COMPUTE = "dp_compute"
    """The first argument, a ``Batch``, is split by data-parallel rank; results come from the ranks
    that own them, concatenated in DP order (a list of per-DP results when they are not Batches)."""
    RANK0 = "rank0"
    """Every rank runs it (collectives need them all); the driver gets rank 0's result."""


@dataclass(frozen=True)
class DispatchSpec:
    mode: Dispatch
    layout: str = "megatron"
    """Whose data-parallel grouping splits a ``DP_COMPUTE`` batch: the worker's
    ``dispatch_info(layout)`` (the actor's rollout engine has its own, ``rollout``)."""


_ATTR = "__rlhf_dispatch__"
_DEFAULT = DispatchSpec(Dispatch.ALL)


def dispatch(mode: Dispatch, layout: str = "megatron") -> Callable[[F], F]:
    """Declare the dispatch of a worker method (see the module docstring)."""
    spec = DispatchSpec(Dispatch(mode), layout)

    def declare(fn: F) -> F:
        setattr(fn, _ATTR, spec)
        return fn

    return declare


def dispatch_spec(worker_cls: type, method: str) -> DispatchSpec:
    """The declared dispatch of ``worker_cls.method`` (``Dispatch.ALL`` when undeclared)."""
    fn = getattr(worker_cls, method, None)
    if not callable(fn):
        raise AttributeError(f"{worker_cls.__name__} has no method {method!r} to call on its workers")
    return getattr(fn, _ATTR, _DEFAULT)
