"""What `local` will do on this machine, decided up front (`plan_local` in local.py builds it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from aura_hpc.config import RunConfig
from aura_hpc.launch.memory import MemoryPlan

# The one worker entry point; Slurm jobs run the same (aura_hpc.slurm.job).
WORKER_MODULE = "aura_hpc.train"


@dataclass
class LocalPlan:
    cfg: RunConfig
    nnodes: int
    node_rank: int
    nproc: int
    master_addr: str
    master_port: int
    max_restarts: int
    rdzv_timeout: int
    local_addr: str | None
    env: dict[str, str] = field(default_factory=dict)
    shutdown_timeout: int = 120  # the agent's wait for the workers after a stop signal (hang_watch.stop_grace_s)
    memory: MemoryPlan | None = None  # per GPU (per process on CPU)
    gpu_mem_gib: float = 0.0  # this machine's GPU memory (0: no GPU)
    warnings: list[str] = field(default_factory=list)
    data_lines: list[str] = field(default_factory=list)  # how the data covers the run (launch/data_plan.py)
    refusal: str | None = None  # why the run would not start (a --dry-run shows the plan, then this)

    @property
    def master(self) -> str:
        """Where the rendezvous listens, as messages say it (port 0: a free one, which its store binds when it starts)."""
        return f"{self.master_addr}:{self.master_port}" if self.master_port else f"{self.master_addr} (a free port)"

    @property
    def config_path(self) -> Path:
        """Node 0's config.yaml; another node's own file beside it: LAN nodes may share the run folder
        (NFS), and each node's workers must read the settings that node was started with (the ranks
        then compare them, and refuse a difference)."""
        return self.cfg.run_dir / ("config.yaml" if self.node_rank == 0 else f"config.node{self.node_rank}.yaml")

    @property
    def worker_cmd(self) -> list[str]:
        return [sys.executable, "-u", "-m", WORKER_MODULE, str(self.config_path)]
