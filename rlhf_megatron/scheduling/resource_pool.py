"""Resource pools: Ray placement groups that say where each role's processes run.

A pool is a list of process counts per node (``[8, 8]`` = two nodes, eight
processes each). Each node becomes one placement group whose bundles are one
process slot each: ``{"GPU": 1, "CPU": c}`` on GPU clusters, ``{"CPU": c}`` on
CPU machines. ``STRICT_PACK`` keeps a node's bundles on one Ray node, so the
processes of a tensor-parallel group stay inside a node; ``PACK`` lets Ray
spill when a node is short.

Colocation is sharing bundles: every role placed in the same pool gets a
fraction of each bundle (``1 / roles_in_pool`` of its GPU and CPU), so the
actor/rollout/ref process and, say, the critic process of rank ``r`` land on
the same GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass
class ResourcePool:
    """Processes per node for one or more colocated roles, backed by placement groups."""

    name: str
    process_on_nodes: list[int]
    use_gpu: bool = False
    cpus_per_process: float = 1.0
    strategy: str = "STRICT_PACK"
    placement_groups: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.process_on_nodes or any(n < 1 for n in self.process_on_nodes):
            raise ValueError(
                f"resource pool '{self.name}': process_on_nodes={self.process_on_nodes} needs at least one node "
                "and at least one process per node (trainer.nnodes x trainer.n_gpus_per_node)"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"resource pool '{self.name}': strategy {self.strategy!r} is not one of {STRATEGIES}"
            )

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_process, **({"GPU": 1.0} if self.use_gpu else {})}

    def create(self, timeout_s: float = 120.0) -> list:
        """Reserve the placement groups (one per node) and wait until Ray has placed them."""
        import ray
        from ray.util.placement_group import placement_group

        if self.placement_groups:
            return self.placement_groups
        pgs = [
            placement_group([self.bundle()] * count, strategy=self.strategy, name=f"{self.name}_node{i}")
            for i, count in enumerate(self.process_on_nodes)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) != len(pgs):
            available = ray.available_resources()
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise TimeoutError(
                f"resource pool '{self.name}': only {len(ready)} of {len(pgs)} placement groups "
                f"(bundles {self.bundle()} x {self.process_on_nodes}, strategy {self.strategy}) were placed within "
                f"{timeout_s:.0f} s; the cluster has {available}. Lower trainer.nnodes / n_gpus_per_node or add nodes."
            )
        self.placement_groups = pgs
        return pgs

    def slots(self) -> list[tuple[object, int]]:
        """(placement group, bundle index) for every process, rank order: node by node."""
        if not self.placement_groups:
            self.create()
        return [
            (pg, i) for pg, count in zip(self.placement_groups, self.process_on_nodes) for i in range(count)
        ]

    def remove(self) -> None:
        import ray

        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.placement_groups = []
