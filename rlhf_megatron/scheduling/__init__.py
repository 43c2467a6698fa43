"""Placement and dispatch: resource pools (Ray placement groups), worker groups, and the dispatch
each worker method declares."""

from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.scheduling.resource_pool import ResourcePool
from rlhf_megatron.scheduling.worker_group import WorkerError, WorkerGroup

__all__ = ["Dispatch", "ResourcePool", "WorkerError", "WorkerGroup", "dispatch"]
