"""The one place that reads the distributed environment (torchrun/elastic or Slurm) into a dataclass."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0
    launcher: str = "none"  # torchrun | slurm | env | none
    uses_agent_store: bool = False
    hostname: str = ""
    launcher_rank: int = 0  # the rank the launcher gave (torchrun numbers nodes in its own order)
    node_sizes: tuple[int, ...] = ()  # ranks on each node, in node order (known once the ranks met: distributed.join)
    peer_host: str = ""  # under Slurm, another node of the job (where the master's store must be reachable from)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return len(self.node_sizes) or 1

    @property
    def node_ranks(self) -> list[list[int]]:
        """The global ranks of each node, in node order."""
        out, start = [], 0
        for n in self.node_sizes or (self.world_size,):
            out.append(list(range(start, start + n)))
            start += n
        return out

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        e = os.environ if env is None else env
        host = node_name(e)
        if "RANK" in e and "WORLD_SIZE" in e:
            # torchrun / the elastic agent (also what submitit's TorchDistributedEnvironment exports).
            rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
            local_rank, local_world = int(e.get("LOCAL_RANK", "0")), int(e.get("LOCAL_WORLD_SIZE", "1"))
            node_rank = int(e.get("GROUP_RANK", e.get("NODE_RANK", "0")))
            launcher_rank = rank
            nnodes = int(e.get("AURA_NNODES", e.get("GROUP_WORLD_SIZE", "0")) or 0)
            sizes: tuple[int, ...] = ()
            if "AURA_NODE_RANK" in e:
                # c10d orders nodes by address string, not by --node-rank: the machine the user calls node 0
                # (the master) holds global rank 0 and the checkpoints. With equal nodes that is known here;
                # otherwise the ranks learn it together (distributed.join) before anything is logged.
                node_rank = int(e["AURA_NODE_RANK"])
            if nnodes and nnodes * local_world == world:
                sizes = (local_world,) * nnodes
                rank = node_rank * local_world + local_rank
            return cls(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                local_world_size=local_world,
                node_rank=node_rank,
                master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(e.get("MASTER_PORT", "29500")),
                restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
                launcher="torchrun" if "TORCHELASTIC_RUN_ID" in e else "env",
                uses_agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                hostname=host,
                launcher_rank=launcher_rank,
                node_sizes=sizes,
            )
        if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
            # One task per GPU under srun: ranks come from Slurm; the master is where srun ran (slurm/job.py).
            rank = int(e["SLURM_PROCID"])
            nodes = hostnames(e.get("SLURM_JOB_NODELIST", ""))
            return cls(
                rank=rank,
                local_rank=int(e.get("SLURM_LOCALID", "0")),
                world_size=int(e["SLURM_NTASKS"]),
                local_world_size=int(e.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
                node_rank=int(e.get("SLURM_NODEID", "0")),
                master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(e.get("MASTER_PORT", "29500")),
                restart_count=int(e.get("SLURM_RESTART_COUNT", "0")),
                launcher="slurm",
                hostname=host,
                launcher_rank=rank,
                node_sizes=tasks_per_node(e.get("SLURM_TASKS_PER_NODE", "")),
                peer_host=nodes[1] if len(nodes) > 1 else "",
            )
        return cls(hostname=host)


def tasks_per_node(spec: str) -> tuple[int, ...]:
    """Slurm's SLURM_TASKS_PER_NODE ('2(x3),1') as (2, 2, 2, 1); () when absent or unreadable."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return ()
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(out)


def hostnames(nodelist: str, limit: int = 2) -> list[str]:
    """The first `limit` hosts of a Slurm hostlist: 'gpu[007-008],cpu3' -> gpu007, gpu008; 'node[1-2]-ib' ->
    node1-ib, node2-ib; 'rack[1-2]-node[01-04]' -> rack1-node01, rack1-node02 (the text after a bracket was lost)."""
    names: list[str] = []
    depth, start = 0, 0
    for i, c in enumerate(nodelist + ","):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            for name in _expand(nodelist[start:i]):
                if name:
                    names.append(name)
                if len(names) >= limit:
                    return names
            start = i + 1
    return names


def _expand(item: str) -> Iterator[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if m is None:
        yield item
        return
    prefix, ranges, rest = m.groups()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit():
            yield item  # not a hostlist Slurm writes: the text as it is
            return
        for n in range(int(lo), int(hi or lo) + 1):
            for tail in _expand(rest):
                yield f"{prefix}{n:0{len(lo)}d}{tail}"


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node as the scheduler names it: Slurm's node name (what squeue shows and --exclude takes; several
    slurmd may share one host), else the host name."""
    e = os.environ if env is None else env
    return e.get("SLURMD_NODENAME") or socket.gethostname()
