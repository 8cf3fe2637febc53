"""The one place that reads the distributed environment (torchrun/elastic or Slurm) into a dataclass."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
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
    launcher: str = "none"  # torchrun | slurm | none
    uses_agent_store: bool = False
    hostname: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        e = os.environ if env is None else env
        host = socket.gethostname()
        if "RANK" in e and "WORLD_SIZE" in e:
            # torchrun / the elastic agent (also what submitit's TorchDistributedEnvironment exports).
            rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
            local_rank, local_world = int(e.get("LOCAL_RANK", "0")), int(e.get("LOCAL_WORLD_SIZE", "1"))
            node_rank = int(e.get("GROUP_RANK", e.get("NODE_RANK", "0")))
            if "AURA_NODE_RANK" in e and int(e.get("AURA_NNODES", "0")) * local_world == world:
                # c10d orders nodes by address string, not by --node-rank; renumber so that the
                # machine the user calls node 0 (the master) holds global rank 0 and the checkpoints.
                node_rank = int(e["AURA_NODE_RANK"])
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
            )
        if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
            # One task per GPU under srun: ranks come from Slurm; the master is the first node.
            return cls(
                rank=int(e["SLURM_PROCID"]),
                local_rank=int(e.get("SLURM_LOCALID", "0")),
                world_size=int(e["SLURM_NTASKS"]),
                local_world_size=int(e.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
                node_rank=int(e.get("SLURM_NODEID", "0")),
                master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(e.get("MASTER_PORT", "29500")),
                restart_count=int(e.get("SLURM_RESTART_COUNT", "0")),
                launcher="slurm",
                hostname=host,
            )
        return cls(hostname=host)
