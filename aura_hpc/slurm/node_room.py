"""Whether a job Slurm finds no nodes for now would fit its partition once the partition's unusable nodes return.

`sbatch --test-only` judges a request against the nodes that are up: a node down, drained or not responding is
left out (slurmctld's job_start_data), and its answer is "Requested node configuration is not available", the
same as for a size no node of the partition could ever hold. Plain sbatch queues the first kind to wait for the
node; refusing it sent a user with one drained node of four away from a job the cluster would run tomorrow.
Told apart here from the nodes' configuration (CPUs, memory, GPUs, features), counted with the unusable ones.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from aura_hpc.config.tree import SlurmConfig
from aura_hpc.slurm.exclude import unusable_state

NOT_AVAILABLE = "node configuration is not available"  # ESLURM_REQUESTED_NODE_CONFIG_UNAVAILABLE's text


@dataclass
class Node:
    name: str
    state: str  # sinfo's compact state, suffix included: drain, down*, idle*
    cpus: int
    memory_mb: int
    gpus: dict[str, int]  # GPU type ("" where the gres names none) -> count
    features: set[str]

    @property
    def usable(self) -> bool:
        return not unusable_state(self.state)  # as a requeue counts a spare node


def waiting_for(slurm: SlurmConfig, tasks_per_node: int, least: int) -> list[Node]:
    """The partition's unusable nodes whose return would let the job start on `least` nodes, or [] where even every
    node of the partition would not hold it (an impossible size), or where the partition cannot be read."""
    nodes = [n for n in partition_nodes(slurm.partition) if n.name not in _excluded(slurm.exclude) and holds(n, slurm, tasks_per_node)]
    if len(nodes) < least:
        return []
    return [n for n in nodes if not n.usable]


def holds(node: Node, slurm: SlurmConfig, tasks_per_node: int) -> bool:
    """The node's configuration holds one node's share of the job (its state aside)."""
    if node.cpus < tasks_per_node * max(1, slurm.cpus_per_task):
        return False
    wanted_mb = _megabytes(slurm.mem)
    if wanted_mb and node.memory_mb and node.memory_mb < wanted_mb:
        return False
    if slurm.gpus_per_node:
        have = node.gpus.get(slurm.gpu_type, 0) if slurm.gpu_type else sum(node.gpus.values())
        if have < slurm.gpus_per_node:
            return False
    # A plain list of features (a&b); an expression with |, [...] or counts is left to Slurm.
    wanted = [f for f in re.split(r"[&,]", slurm.constraint) if f.strip()]
    if wanted and not re.search(r"[|\[\]*()!]", slurm.constraint):
        return all(f.strip() in node.features for f in wanted)
    return True


def partition_nodes(partition: str) -> list[Node]:
    """The nodes of `partition` (the default one where ""), from sinfo; [] when sinfo does not answer."""
    args = ["sinfo", "-h", "-N", "-o", "%N|%P|%t|%c|%m|%G|%f"] + (["-p", partition] if partition else [])
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    nodes: dict[str, Node] = {}
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        fields = line.split("|")
        if len(fields) != 7 or (not partition and not fields[1].endswith("*")):
            continue
        name, _, state, cpus, memory, gres, features = (f.strip() for f in fields)
        try:
            nodes[name] = Node(name, state, int(cpus), int(memory), _gpus(gres), set(features.split(",")) - {"(null)", ""})
        except ValueError:  # a field sinfo could not give (N/A)
            continue
    return list(nodes.values())


def _gpus(gres: str) -> dict[str, int]:
    """'gpu:h100:8(S:0-1),gpu:a100:2' -> {'h100': 8, 'a100': 2}; 'gpu:4' -> {'': 4}."""
    out: dict[str, int] = {}
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2 or not parts[-1].isdigit():
            continue
        kind = parts[1] if len(parts) > 2 else ""
        out[kind] = out.get(kind, 0) + int(parts[-1])
    return out


def _megabytes(mem: str) -> int:
    """sbatch's --mem ('64G', '500M', '1T', '64000' in MB) in MB; 0 for none or "all of it" ('0')."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)B?\s*", mem.upper())
    if not match:
        return 0
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]
    return int(int(match.group(1)) * scale)


def _excluded(expr: str) -> set[str]:
    from aura_hpc.train.process.dist_env import hostnames

    return set(hostnames(expr, 1 << 20)) if expr.strip() else set()
