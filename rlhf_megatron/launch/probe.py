"""A smoke driver that checks a freshly launched Ray cluster before a long run.

Role: ``--driver-cmd 'python -m rlhf_megatron.launch.probe --nodes N'`` in place of the
trainer. It connects through ``RAY_ADDRESS``, checks that exactly N nodes are alive, runs
one task pinned to each node, and prints (or writes with ``--out``) where each task ran:
the Ray node id, hostname, the Slurm node name, GPUs Ray assigned. It exits non-zero with
a message when the count is wrong or a node cannot run a task. The launcher tests use it,
and users can use it to check a cluster allocation in a minute.

Boundaries: Ray only; no torch, no trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

__all__ = ["probe_cluster"]


def _where() -> dict:
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


def probe_cluster(expected_nodes: int, task_timeout_s: float = 120.0) -> dict:
    """Run one task on every alive node; raise RuntimeError if the node count is wrong."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(logging_level="ERROR")  # RAY_ADDRESS names the cluster
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) != expected_nodes:
            raise RuntimeError(f"expected {expected_nodes} alive Ray nodes, found {len(nodes)}")
        # num_cpus=0: the probe must run even when the trainer's actors hold every CPU.
        where = ray.remote(num_cpus=0)(_where)
        refs = [
            where.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote()
            for n in nodes
        ]
        tasks = ray.get(refs, timeout=task_timeout_s)
    finally:
        ray.shutdown()
    if sorted(t["node_id"] for t in tasks) != sorted(n["NodeID"] for n in nodes):
        raise RuntimeError("a pinned task ran on the wrong node")
    return {"nodes": len(nodes), "tasks": tasks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_megatron.launch.probe", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", type=int, required=True, help="alive Ray nodes expected")
    parser.add_argument("--out", default=None, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    try:
        result = probe_cluster(args.nodes)
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        print(f"probe failed: {exc}", file=sys.stderr, flush=True)
        return 1
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
