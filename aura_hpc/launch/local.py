"""`python -m aura_hpc local`: the trainer on this machine, or on several LAN machines, without Slurm.

Workers are started by torch's own elastic agent (torch.distributed.launcher.api, the code
behind torchrun) with a c10d rendezvous hosted by node 0; the worker command is the same
`python -m aura_hpc.train RUN_DIR/config.yaml` that Slurm jobs run.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.config import RunConfig, load_config
from aura_hpc.errors import (
    EXIT_DIVERGED,
    EXIT_GPU_FAULT,
    EXIT_RESUMABLE,
    EXIT_TRAIN_FAILED,
    EXIT_USER_ERROR,
    ConfigError,
    LaunchError,
    TrainingFailed,
)
from aura_hpc.launch.run_setup import prepare_run_dir
from aura_hpc.ops.network import route_to

WORKER_MODULE = "aura_hpc.train"
RDZV_RUN_ID = "aura_hpc"


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
    shutdown_timeout: int = 120

    @property
    def config_path(self) -> Path:
        return self.cfg.run_dir / "config.yaml"

    @property
    def worker_cmd(self) -> list[str]:
        return [sys.executable, "-u", "-m", WORKER_MODULE, str(self.config_path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def wait_for_master(addr: str, port: int, timeout: float) -> None:
    """Fail with a clear message, never hang, when the master cannot be reached."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, timeout))):
                return
        except socket.gaierror:
            raise LaunchError(f"master address {addr!r} does not resolve (fix: use node 0's IP address, e.g. 192.168.1.10)") from None
        except OSError as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"cannot reach the master at {addr}:{port} within {timeout:.0f}s ({last}) (fix: start node 0 first, "
                f"check that {addr} is node 0's IP, and allow TCP port {port} and gloo's ports in its firewall)"
            )
        time.sleep(0.5)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_local(
    config: str | None,
    overrides: list[str],
    output_dir: str | None,
    run_name: str | None,
    nnodes: int = 1,
    node_rank: int = 0,
    nproc: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int = 120,
    backend: str | None = None,
    ifname: str | None = None,
) -> LocalPlan:
    """Everything `local` will do, decided and checked up front; nothing is written."""
    if backend:
        overrides = [*overrides, f"dist.backend={backend}"]
    cfg = load_config(config, overrides, output_dir, run_name)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    if cfg.data.path:
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes} (fix: --nnodes 1 for this machine alone)")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is not below --nnodes {nnodes} (fix: use 0..{nnodes - 1}, 0 on the master)")
    if rdzv_timeout <= 0:
        raise LaunchError(f"--rdzv-timeout must be positive, got {rdzv_timeout} (fix: --rdzv-timeout 120)")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts must be 0 or more, got {max_restarts} (fix: --max-restarts 0 or a positive count)")
    if nnodes > 1 and not master_addr:
        raise LaunchError("--nnodes > 1 needs --master-addr (fix: --master-addr <IP of node 0> on every node)")
    gpus = _cuda_count()
    wanted = cfg.dist.backend
    if wanted == "nccl" and gpus == 0:
        raise ConfigError("--backend nccl needs CUDA GPUs, and this machine has none (fix: --backend gloo or auto)")
    if cfg.train.precision == "fp16" and gpus == 0:
        raise ConfigError("train.precision fp16 needs a CUDA GPU and this machine has none (fix: --set train.precision=auto)")
    if nproc is None:
        nproc = gpus if gpus and wanted != "gloo" else 2
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {nproc} (fix: omit it for one per GPU, or 2 on CPU)")
    if gpus and wanted != "gloo" and nproc > gpus:
        raise LaunchError(f"--nproc-per-node {nproc} is more than the {gpus} GPUs on this machine (fix: --nproc-per-node {gpus})")

    if nnodes == 1 and not master_addr:
        master_addr = "127.0.0.1"
    assert master_addr is not None
    if master_port is None:
        master_port = _free_port() if nnodes == 1 else 29500
    if not 1 <= master_port <= 65535:
        raise LaunchError(f"--master-port must be 1..65535, got {master_port} (fix: --master-port 29500)")

    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "AURA_NODE_RANK": str(node_rank), "AURA_NNODES": str(nnodes)}
    cores = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // nproc))
    if platform.system() == "Windows":
        env["TORCH_DISTRIBUTED_USE_LIBUV"] = "0"  # the Windows build of torch has no libuv TCPStore
    local_addr = None
    if nnodes > 1:
        ip, iface = route_to(master_addr)
        iface = ifname or iface
        local_addr = ip
        if iface:
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", iface))
            if gpus:
                env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", iface))
    elif ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return LocalPlan(cfg, nnodes, node_rank, nproc, master_addr, master_port, max_restarts, rdzv_timeout, local_addr, env)


def launch(plan: LocalPlan) -> int:
    """Run the plan through the elastic agent; returns the exit status for the CLI."""
    if plan.nnodes > 1 and plan.node_rank == 0 and _port_in_use(plan.master_port):
        raise LaunchError(
            f"port {plan.master_port} is already in use on this machine (fix: --master-port {plan.master_port + 1} "
            "on every node, or stop the program using it)"
        )
    if plan.node_rank > 0:
        wait_for_master(plan.master_addr, plan.master_port, plan.rdzv_timeout)
    prepare_run_dir(plan.cfg, plan.nproc * plan.nnodes)
    os.environ.update(plan.env)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # The verdict on failed workers is ours (one line naming the ranks, the cause and the fix).
        logging.getLogger(name).setLevel(logging.CRITICAL)
    lc = LaunchConfig(
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc,
        run_id=RDZV_RUN_ID,
        role="trainer",
        rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
        rdzv_backend="c10d",
        rdzv_configs={"join_timeout": plan.rdzv_timeout, "is_host": plan.node_rank == 0},
        max_restarts=plan.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=plan.local_addr,
        # On Ctrl+C/SIGTERM the agent forwards the signal and waits this long for the workers to
        # finish their step and write a checkpoint before it kills them.
        shutdown_timeout=plan.shutdown_timeout,
        # SIGUSR2 is the pre-timeout/preemption signal: forward it like SIGTERM instead of dying on it.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2",
    )
    cmd = plan.worker_cmd
    try:
        elastic_launch(lc, cmd[0])(*cmd[1:])
    except SignalException as exc:
        return _resumable(plan, exc.sigval.name)
    except ChildFailedError as exc:
        if all(f.exitcode == EXIT_RESUMABLE for f in exc.failures.values()):
            return _resumable(plan, "a stop signal to the workers")
        if any(f.exitcode == EXIT_GPU_FAULT for f in exc.failures.values()):
            from aura_hpc import console

            console.error(
                f"the GPU circuit breaker stopped training (see {plan.cfg.run_dir / 'logs'}): take this machine's GPU out of "
                "service before training on it again; re-run the same command on healthy hardware to resume"
            )
            return EXIT_GPU_FAULT
        raise _failure(plan, exc.failures) from None
    except RendezvousError as exc:
        raise LaunchError(
            f"the {plan.nnodes} nodes did not all join at {plan.master_addr}:{plan.master_port} within "
            f"{plan.rdzv_timeout}s ({type(exc).__name__}) (fix: start every node with the same --nnodes, "
            "--master-addr and --master-port, and check the firewall)"
        ) from None
    return 0


def _failure(plan: LocalPlan, failures: dict[int, Any]) -> TrainingFailed:
    """The one-line verdict on failed workers, with the exit status README.md documents."""
    log_dir = plan.cfg.run_dir / "logs"
    codes = {f.exitcode for f in failures.values()}
    said = _worker_error(plan)
    if codes == {EXIT_DIVERGED}:
        return TrainingFailed(f"training stopped: {said or 'the loss stayed non-finite'} (see {log_dir})", EXIT_DIVERGED)
    if codes == {EXIT_USER_ERROR} and said:
        # A worker refused its input (e.g. a checkpoint that does not fit): nothing was trained.
        return TrainingFailed(f"{said} (see {log_dir})", EXIT_USER_ERROR)
    # A killed rank makes its peers fail too (broken collectives): name every failed rank,
    # the ones killed by a signal first, since they are usually the cause.
    ordered = sorted(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp))
    what = "; ".join(f"rank {r} {_exit_description(f.exitcode)}" for r, f in ordered)
    restarts = f" after {plan.max_restarts} restart(s)" if plan.max_restarts else ""
    return TrainingFailed(f"training failed{restarts}: {what} (see {log_dir}); {_resume_hint(plan)}", EXIT_TRAIN_FAILED)


def _worker_error(plan: LocalPlan) -> str | None:
    """The last error a worker of this machine logged: why it exited (each logs its error before leaving)."""
    first = plan.node_rank * plan.nproc
    for rank in range(first, first + plan.nproc):
        try:
            with open(plan.cfg.run_dir / "logs" / f"rank_{rank}.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if " ERROR " in line:
                return line.split(" ERROR ", 1)[1].strip()
    return None


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _resume_hint(plan: LocalPlan) -> str:
    from aura_hpc.train import checkpoint

    ckpts = checkpoint.list_complete(plan.cfg.run_dir / "checkpoints")
    where = f"from {ckpts[0].path.name}" if ckpts else "(no checkpoint yet: it starts from step 0)"
    return f"to resume {where}, fix the cause and re-run the same command"


def _resumable(plan: LocalPlan, why: str) -> int:
    from aura_hpc import console
    from aura_hpc.train import checkpoint

    ckpts = checkpoint.list_complete(plan.cfg.run_dir / "checkpoints")
    saved = f"checkpoint {ckpts[0].path.name} saved" if ckpts else "no checkpoint was saved"
    console.info(f"stopped by {why}: {saved}; re-run the same command to resume")
    return EXIT_RESUMABLE


def summary(plan: LocalPlan) -> dict[str, object] | None:
    path = plan.cfg.run_dir / "summary.json"
    if not path.exists():
        return None
    data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return data
