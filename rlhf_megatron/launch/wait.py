"""Wait until a Ray cluster has the expected number of nodes, or fail saying how many came.

Role: the Slurm job starts one Ray node per machine in the background and must not start
the driver before all of them have joined. The driver's placement groups would otherwise
wait forever for GPUs that never come. Run as
``python -m rlhf_megatron.launch.wait --address HOST:PORT --nodes N --timeout S``; exit
status 0 when all N are alive, 1 (with a message naming joined/expected) otherwise.

Boundaries: only connects and reads the node table; never schedules work.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["RayNodesTimeout", "alive_nodes", "wait_for_nodes"]


class RayNodesTimeout(TimeoutError):
    """Fewer Ray nodes than expected joined in time (or the head never answered)."""


def alive_nodes() -> list[dict]:
    """The node table of the connected cluster, alive nodes only."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _connect(address: str, deadline: float, timeout_s: float) -> None:
    import ray

    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return
        except (ConnectionError, RuntimeError, ValueError) as exc:
            # The head may still be starting: its GCS port opens before it accepts drivers.
            if time.monotonic() >= deadline:
                raise RayNodesTimeout(
                    f"could not connect to the Ray head at {address} within {timeout_s:.0f} s ({exc}); "
                    "check the head node's Ray log"
                ) from exc
            time.sleep(1.0)


def wait_for_nodes(address: str, expected: int, timeout_s: float, poll_s: float = 1.0) -> int:
    """Block until ``expected`` nodes are alive in the cluster at ``address``; return the count.

    Raises ``RayNodesTimeout`` naming how many joined of how many were expected.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    _connect(address, deadline, timeout_s)
    try:
        while True:
            joined = len(alive_nodes())
            if joined >= expected:
                return joined
            if time.monotonic() >= deadline:
                raise RayNodesTimeout(
                    f"only {joined} of {expected} Ray nodes joined the cluster at {address} within "
                    f"{timeout_s:.0f} s; the missing nodes' Ray logs say why (can they reach {address}?). "
                    "Raise the limit with --join-timeout if the nodes are just slow to start."
                )
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_megatron.launch.wait", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--address", required=True, help="Ray head address, HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="nodes expected")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait in all")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        joined = wait_for_nodes(args.address, args.nodes, args.timeout)
    except RayNodesTimeout as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"all {joined} Ray nodes joined {args.address} after {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
