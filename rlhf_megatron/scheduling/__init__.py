"""Placement and dispatch: resource pools (Ray placement groups) and worker groups."""

from rlhf_megatron.scheduling.resource_pool import ResourcePool
from rlhf_megatron.scheduling.worker_group import DISPATCH_MODES, WorkerError, WorkerGroup

__all__ = ["DISPATCH_MODES", "ResourcePool", "WorkerError", "WorkerGroup"]
