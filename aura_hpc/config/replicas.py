"""DiLoCo's replicas, ranks by node: one replica per node by default, else equal replicas that each stay on one node
(a replica across nodes would send its gradients over the slow link every step). Pure arithmetic, so the plans
refuse a count that cannot work before anything starts (the workers found it only after the process group)."""

from __future__ import annotations

from aura_hpc.errors import ConfigError


def replica_partition(nodes: list[list[int]], replicas: int) -> list[list[int]]:
    """The ranks of each replica; `nodes`: each node's ranks, in rank order."""
    if not replicas:
        return nodes
    world = sum(len(n) for n in nodes)
    if world % replicas:
        raise ConfigError(
            f"dist.diloco_replicas={replicas} does not divide the {world} ranks into equal replicas "
            f"(fix: a divisor of {world}, or 0 for one replica per node)"
        )
    per = world // replicas
    parts = [list(range(start, start + per)) for start in range(0, world, per)]
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    for part in parts:
        if node_of[part[0]] != node_of[part[-1]]:
            raise ConfigError(
                f"dist.diloco_replicas={replicas} puts ranks {part[0]}-{part[-1]} in one replica across nodes "
                f"{node_of[part[0]]} and {node_of[part[-1]]} (processes per node: {[len(n) for n in nodes]}); a replica trains with "
                "DDP inside one node (fix: dist.diloco_replicas=0 for one replica per node, or a count that splits each node evenly)"
            )
    return parts


def check_equal_nodes(replicas: int, node_counts: range, per_node: int) -> None:
    """Refuse a replica count that fails for any node count the job may get (Slurm's --nodes=MIN-MAX), `per_node`
    ranks each."""
    for n in node_counts if replicas else ():
        replica_partition([list(range(i * per_node, (i + 1) * per_node)) for i in range(n)], replicas)
