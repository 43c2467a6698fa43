"""A real 2-node Ray cluster on one machine (ray.cluster_utils.Cluster): placement and collectives."""

import os
from pathlib import Path

import pytest

from rlhf_megatron.scheduling import ResourcePool, WorkerGroup

ray = pytest.importorskip("ray")
HERE = str(Path(__file__).resolve().parent)
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}}
pytestmark = pytest.mark.slow


def test_two_node_cluster_places_bundles_per_strategy_and_runs_a_collective():
    from ray.cluster_utils import Cluster
    from sched_workers import EchoWorker

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, runtime_env=RUNTIME_ENV, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        pool = ResourcePool("multi", [2, 2], strategy="STRICT_PACK")
        group = WorkerGroup("critic", pool, EchoWorker, call_timeout_s=120)
        nodes = [info["node_id"] for info in group.nodes]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
        assert group.call.all_reduce_sum(1.0) == [4.0] * 4
        group.shutdown()
        pool.remove()
        # A pool that can't fit (3 processes on one 2-CPU node) fails with a clear message, not a hang.
        with pytest.raises(TimeoutError, match="placement groups .* were placed within 5 s"):
            ResourcePool("toobig", [3], strategy="STRICT_PACK").create(timeout_s=5)
    finally:
        ray.shutdown()
        cluster.shutdown()
