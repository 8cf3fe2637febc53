"""`python -m aura_hpc local`: the trainer on this machine, or on several LAN machines, without Slurm.

Workers are started by torch's own elastic agent (torch.distributed.launcher.api, the code
behind torchrun) with a c10d rendezvous hosted by node 0; the worker command is the same
`python -m aura_hpc.train RUN_DIR/config.yaml` that Slurm jobs run.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aura_hpc.comm.stores import SECRET_ENV, SECRET_FILE, strong_enough
from aura_hpc.config import check_at_world_size, load_config
from aura_hpc.config.device import validate_for_device
from aura_hpc.errors import ConfigError, LaunchError
from aura_hpc.launch.agent import run_workers
from aura_hpc.launch.plan import LocalPlan
from aura_hpc.launch.run_setup import ensure_run_secret, prepare_run_dir
from aura_hpc.ops.network import (
    exported_interface_problem,
    interface_problem,
    is_own_address,
    is_trusted_range,
    lan_master_problem,
    loopback_interface,
    port_in_use,
    resolve,
    route_to,
)


def wait_for_master(
    addr: str,
    port: int,
    timeout: float,
    progress: Callable[[str], None] | None = None,
    every_s: float = 10.0,
    who: str = "the master",
    peer: str = "node 0",
    fix: str = "",
    stopping: Callable[[], bool] | None = None,
) -> None:
    """Fail with a clear message, never hang, when `who` cannot be reached; say so while waiting.
    `peer` names the machine in the likely causes; `fix` replaces the LAN-training fix. Returns early
    (the caller asks `stopping` again) once `stopping()` says a stop was asked for."""
    start = time.monotonic()
    deadline = start + timeout
    next_note = start + every_s
    last = "no answer"
    while True:
        now = time.monotonic()
        if progress is not None and now >= next_note:
            progress(f"waiting for {who} at {addr}:{port} ({now - start:.0f}s of {timeout:.0f}s; {last})...")
            next_note += every_s
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, timeout))):
                return
        except socket.gaierror:
            raise LaunchError(f"master address {addr!r} does not resolve (fix: use node 0's IP address, e.g. 192.168.1.10)") from None
        except OSError as exc:
            last = exc.strerror or str(exc)
        if stopping is not None and stopping():
            return
        if time.monotonic() >= deadline:
            cause = {
                "Connection refused": f"{addr} answers but nothing listens on port {port}: {peer} is not started yet, "
                "or was started with another port",
                "No route to host": f"{addr} is unreachable: a firewall on {peer} rejects port {port}, or the address is wrong",
            }.get(last, f"no answer from {addr}: {peer} is off or not at that address, or a firewall drops port {port}")
            fix = fix or (
                f"start node 0 first with --master-addr {addr}, the same --master-port on every node; let each node's firewall "
                f"allow TCP between the nodes both ways, port {port} on node 0 included"
            )
            raise LaunchError(f"cannot reach {who} at {addr}:{port} within {timeout:.0f}s ({last}; likely: {cause}) (fix: {fix})")
        time.sleep(0.5)


def _check_master_addr(addr: str, nnodes: int, node_rank: int) -> list[str]:
    """Node 0 hosts the rendezvous on --master-addr, so it must be one of its own addresses; and the
    peers there are trusted (the process group unpickles what they send)."""
    if problem := lan_master_problem(addr, nnodes):
        raise LaunchError(problem)
    if nnodes == 1:
        return _one_machine_master_addr(addr)
    if node_rank == 0 and not is_own_address(addr):
        raise LaunchError(
            f"{addr} is not an address of this machine; node 0 must be started with its own address as --master-addr "
            "(fix: --master-addr <this machine's LAN IP, see `ip -4 addr`>, and the same on every node)"
        )
    if not is_trusted_range(addr):
        return [
            f"master address {addr} is neither private nor loopback: the rendezvous port and the process group trust "
            "every peer that connects (fix: run LAN nodes on a private network or VPN, and firewall the port to them)"
        ]
    return []


def _one_machine_master_addr(addr: str) -> list[str]:
    """One machine listens on loopback unless told otherwise; told otherwise, it says where it listens."""
    import ipaddress

    if ipaddress.ip_address(resolve(addr) or "127.0.0.1").is_loopback:
        return []
    if not is_own_address(addr):
        raise LaunchError(f"{addr} is not an address of this machine (fix: omit --master-addr on a single machine)")
    return [
        f"--master-addr {addr} with --nnodes 1: this run's rendezvous listens on {addr}, where other machines reach it "
        "(fix: omit --master-addr on a single machine; it then listens on loopback only)"
    ]


def _cuda_count() -> int:
    # On Linux a GPU that CUDA (or ROCm, as torch.cuda) can use has its device nodes, in a container too (WSL2:
    # /dev/dxg). Without any, `local`'s refusals and dry runs answer without importing torch (1-2 s of CPU).
    nodes = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
    if sys.platform.startswith("linux") and not glob.glob("/dev/nvidia*") and not any(map(os.path.exists, nodes)):
        return 0
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
    force: bool = False,
    dry_run: bool = False,
) -> LocalPlan:
    """Everything `local` will do, decided and checked up front; nothing is written."""
    if backend:
        overrides = [*overrides, f"dist.backend={backend}"]
    cfg = load_config(config, overrides, output_dir, run_name)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    if cfg.data.path and "://" not in cfg.data.path:
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes} (fix: --nnodes 1 for this machine alone)")
    if not 0 <= node_rank < nnodes:
        if nnodes == 1 and node_rank > 0:
            raise LaunchError(
                f"--node-rank {node_rank} needs a run across machines (fix: --nnodes {node_rank + 1} or more with --master-addr "
                "of node 0, the same on every machine; --node-rank 0 on the master)"
            )
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

    if ifname and (problem := interface_problem(ifname)):
        raise LaunchError(problem)  # gloo said "Unable to find address for" it inside every worker, after the rendezvous
    nccl = gpus and wanted != "gloo" and not (ifname and nnodes > 1)  # NCCL reads it only where it runs
    exported = ("NCCL_SOCKET_IFNAME",) * bool(nccl) + ("GLOO_SOCKET_IFNAME",) * (not ifname)
    if problem := exported_interface_problem(exported):  # what --ifname does not replace reaches the workers as it is
        raise LaunchError(problem)
    if nnodes == 1 and not master_addr:
        master_addr = "127.0.0.1"
    assert master_addr is not None
    warnings = _check_master_addr(master_addr, nnodes, node_rank)
    if master_port is None:
        # One machine: port 0, the rendezvous store binds a free port itself when it starts (a port picked here and
        # bound seconds later could be taken meanwhile, e.g. as some connection's local port: a start that failed).
        master_port = 0 if nnodes == 1 else 29500
    elif not 1 <= master_port <= 65535:
        raise LaunchError(f"--master-port must be 1..65535, got {master_port} (fix: --master-port 29500)")

    # PYTHONFAULTHANDLER: a worker that crashes in native code still leaves a Python stack in its log.
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "AURA_NODE_RANK": str(node_rank), "AURA_NNODES": str(nnodes)}
    cores = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // nproc))
    if platform.system() == "Windows":
        env["TORCH_DISTRIBUTED_USE_LIBUV"] = "0"  # the Windows build of torch has no libuv TCPStore
    if gpus and wanted != "gloo":  # as the cluster profiles: torch's agent gives its workers 1, which aborts NCCL's
        # communicators before the process ends, and that abort can hang itself (a survivor of a lost peer stuck in it).
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") or "3"
    # The agent's stores listen on this address alone (comm/stores.py): loopback on one machine.
    local_addr: str | None = "127.0.0.1" if nnodes == 1 else None
    if nnodes > 1:
        ip, iface = route_to(master_addr)
        local_addr = ip
        # --ifname over the environment (an exported GLOO_SOCKET_IFNAME won, in silence), the environment over the route.
        names = {"GLOO_SOCKET_IFNAME": ifname or os.environ.get("GLOO_SOCKET_IFNAME", iface or "")}
        if gpus:
            names["NCCL_SOCKET_IFNAME"] = ifname or os.environ.get("NCCL_SOCKET_IFNAME", iface or "")
        env.update({k: v for k, v in names.items() if v})
    elif ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    elif loopback_interface():
        # One machine: gloo's and NCCL's own sockets listen on loopback too, not on the LAN address.
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", loopback_interface() or ""))
        if gpus:
            env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", loopback_interface() or ""))
    if cfg.dist.strategy == "diloco" and nnodes == 1:  # other nodes may run other counts: their workers judge it
        from aura_hpc.config.replicas import check_equal_nodes

        check_equal_nodes(cfg.dist.diloco_replicas, range(1, 2), nproc)
    warnings += check_at_world_size(cfg, nproc * nnodes)
    plan = LocalPlan(cfg, nnodes, node_rank, nproc, master_addr, master_port, max_restarts, rdzv_timeout, local_addr, env)
    from aura_hpc.launch.hang_calibration import stop_grace_s

    plan.shutdown_timeout = stop_grace_s(cfg)
    from aura_hpc.launch.data_plan import coverage

    plan.data_lines, data_warnings = coverage(cfg, nproc * nnodes)
    plan.warnings = warnings + data_warnings
    gpu = gpus > 0 and wanted != "gloo"
    validate_for_device(plan.cfg, gpu, importlib.metadata.version("torch"))  # a refusal even in a dry run: nothing to plan
    try:
        _plan_memory(plan, gpu, force)
        if dry_run:  # the real run checks it once the data (and its tokenizer) is ready
            from aura_hpc.launch.run_setup import check_sample_prompt

            local = cfg.data.path and "://" not in cfg.data.path
            check_sample_prompt(cfg, Path(cfg.data.path) / "tokenizer" if local else None, estimate=True)
    except ConfigError as exc:
        if not dry_run:
            raise
        plan.refusal = str(exc)  # the dry run still shows the memory plan, then says it would not fit
    return plan


def _plan_memory(plan: LocalPlan, gpu: bool, force: bool) -> None:
    """The memory plan per GPU; refused here, before any worker starts, when it cannot fit."""
    from aura_hpc.data.vocab import tokenizer_vocab
    from aura_hpc.launch.memory import check_fits
    from aura_hpc.launch.memory import plan as plan_memory

    world = plan.nproc * plan.nnodes
    vocab = tokenizer_vocab(plan.cfg)
    cfg = plan.cfg
    if gpu:
        import copy

        import torch

        props = torch.cuda.get_device_properties(0)
        plan.gpu_mem_gib = props.total_memory / 2**30
        if cfg.train.precision == "auto" and props.major < 8:  # T4, V100, RTX 20xx: auto trains in fp32 there (runtime.py)
            cfg = copy.deepcopy(cfg)
            cfg.train.precision = "fp32"
    plan.memory = plan_memory(cfg, vocab, world, gpu=gpu)
    if gpu:
        refusal, warning = check_fits(cfg, vocab, world, plan.gpu_mem_gib, force)
        if refusal:
            raise ConfigError(refusal.replace("this cluster's GPUs", "this machine's GPUs"))
        if warning:
            plan.warnings.append(warning.replace("their", "this machine's"))
    else:
        try:
            note = check_ram(plan.memory, plan.nproc)
        except ConfigError as exc:
            if not force:
                raise
            note = f"--force: starting although {exc}"
        if note:
            plan.warnings.append(note)


def check_ram(memory: Any, nproc: int) -> str | None:
    """On CPU the plan is compared with this machine's RAM: a run that cannot fit is refused before
    any worker allocates (the kernel's OOM killer would end it, maybe with other programs); one
    that fits only in RAM now in use by other programs is warned about."""
    import psutil

    from aura_hpc.launch.memory import CPU_PROCESS_BYTES, GIB

    # Rank 0 keeps a host copy for its checkpoints (each rank its shard under sharded strategies).
    need = nproc * (memory.training_total + CPU_PROCESS_BYTES) + memory.checkpoint_copies_on_node(nproc)
    vm = psutil.virtual_memory()
    if need > vm.total:
        raise ConfigError(
            f"the memory plan needs ~{need / GIB:,.1f} GiB of RAM for {nproc} process(es) on this CPU machine, more than its "
            f"{vm.total / GIB:.1f} GiB (fix: a smaller model, train.batch_size or data.seq_len, fewer --nproc-per-node, or "
            "--set train.activation_checkpointing=true; or --force to try anyway)"
        )
    if need > vm.available:
        return (
            f"the memory plan needs ~{need / GIB:,.1f} GiB of RAM for {nproc} process(es); {vm.available / GIB:.1f} GiB is free "
            "now (other programs hold the rest): the run may swap or be killed"
        )
    return None


def launch(plan: LocalPlan, ready: Callable[[], None] | None = None) -> int:
    """Run the plan through the elastic agent; returns the exit status for the CLI. `ready` is
    called once the run directory is set up, just before the workers start: a refusal before it
    is the only line the user sees."""
    from aura_hpc.config.tracking import require_installed

    require_installed(plan.cfg)  # before any worker: a tracker that cannot start is bad input
    if plan.node_rank == 0 and plan.master_port and port_in_use(plan.master_port):
        where = " on every node" if plan.nnodes > 1 else " (or omit --master-port: a free one is picked)"
        raise LaunchError(
            f"port {plan.master_port} is already in use on this machine (fix: --master-port {plan.master_port + 1}{where}, "
            "or stop the program using it)"
        )
    # Node 0 holds the run directory for the whole run: a second `local` there is refused.
    node0 = plan.node_rank == 0
    # A secret given in the environment is judged before the wait (one too short is refused now); without one, a node
    # sharing node 0's folder finds it there once node 0 has written it: after the wait.
    secret = _secret_of_other_node(plan) if not node0 and os.environ.get(SECRET_ENV, "").strip() else None
    if plan.node_rank > 0:
        from aura_hpc import console

        wait_for_master(plan.master_addr, plan.master_port, plan.rdzv_timeout, console.info)
        secret = secret or _secret_of_other_node(plan)
    world, exact = plan.nproc * plan.nnodes, plan.nnodes == 1  # a LAN's other nodes may run other process counts
    lock = prepare_run_dir(
        plan.cfg, world, lock=node0, check_lock=node0, config_name=plan.config_path.name, secret=node0, exact_world=exact
    )
    if node0:
        secret = ensure_run_secret(plan.cfg.run_dir)
        if plan.nnodes > 1:
            from aura_hpc import console

            # One whole line per machine: a "K" to replace, or a note after the command, did not paste.
            for rank in range(1, plan.nnodes):
                console.info(f"on node {rank} (another machine), run:")
                console.plain(other_nodes_command(plan, secret, rank))
                console.info("or, in Windows PowerShell (where `VAR=value command` is no command):")
                console.plain(other_nodes_command(plan, secret, rank, powershell=True))
    assert secret is not None
    os.environ[SECRET_ENV] = secret
    os.environ.update(plan.env)
    # Workers stop (checkpoint, exit) when this process is gone, even after a SIGKILL.
    os.environ["AURA_LAUNCHER_PID"] = str(os.getpid())
    try:
        from aura_hpc.train.process.startup_gc import imports_unscanned

        with imports_unscanned():
            import torch.distributed.launcher.api  # noqa: F401  (run_workers')
        if ready is not None:
            ready()
        return run_workers(plan)
    finally:
        if lock is not None:
            from aura_hpc.launch.run_lock import workers_left

            if left := workers_left(plan.cfg.run_dir, parent=os.getpid()):  # ours, stopping (a third Ctrl+C cut the wait short)
                from aura_hpc import console

                console.info(f"workers {' '.join(map(str, left))} are still stopping: the run directory stays locked until they exit")
            else:
                lock.release()


def _secret_of_other_node(plan: LocalPlan) -> str:
    """A LAN node other than node 0 proves the run's secret that node 0 printed (or finds it in a run
    folder it shares with node 0)."""
    given = os.environ.get(SECRET_ENV, "").strip()
    if given:
        return strong_enough(given, plan.node_rank)
    try:
        shared = (plan.cfg.run_dir / SECRET_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        shared = ""
    if shared:
        return shared
    raise LaunchError(
        f"node {plan.node_rank} has no secret for this run: every node proves the run's secret before training "
        f"(fix: start it with {SECRET_ENV}=... exactly as node 0 printed it)"
    )


def _powershell_quote(word: str, always: bool = False) -> str:
    """A word as PowerShell reads it back: single quotes are literal there, a quote inside one doubled (`,` makes an
    array of a bare word, `@` and `$` expand)."""
    # A bare `--name=a.b` is split at the dot by PowerShell 5.1 and 7 alike (PowerShell issue 6291): quoted.
    if not always and re.fullmatch(r"[\w./:=+-]+", word) and not (word.startswith("-") and any(c in word for c in ".:")):
        return word
    return "'" + word.replace("'", "''") + "'"


def other_nodes_command(plan: LocalPlan, secret: str, rank: int, powershell: bool = False) -> str:
    """This command line as node `rank` runs it: its --node-rank, and the run's secret (POSIX shells)."""
    import shlex
    import sys

    argv = list(sys.argv[1:]) or ["local"]
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        # --ifname too: interface names are each machine's own (wlan0 here, wlp2s0 there); each finds its route itself.
        if arg in ("--node-rank", "--ifname") and i + 1 < len(argv):
            skip = True
            continue
        if arg.startswith(("--node-rank=", "--ifname=")):
            continue
        out.append(arg)
    # Flags this node took from its environment (AURA_LOCAL_FROM_ENV, the Docker image's) are written out: the line
    # is pasted on machines whose environment is not this one's.
    for flag, value in (("--nnodes", plan.nnodes), ("--master-addr", plan.master_addr), ("--master-port", plan.master_port)):
        if flag not in out and not any(a.startswith(f"{flag}=") for a in out):
            out += [flag, str(value)]
    words = ["python", "-m", "aura_hpc", *out, "--node-rank", str(rank)]
    if powershell:
        return f"$env:{SECRET_ENV}={_powershell_quote(secret, always=True)}; {' '.join(map(_powershell_quote, words))}"
    return f"{SECRET_ENV}={shlex.quote(secret)} {shlex.join(words)}"


def summary(plan: LocalPlan) -> dict[str, object] | None:
    """The run's summary.json when this launch wrote it (after its config file, on the same filesystem's clock): on a LAN
    node with a folder of its own, an earlier run's there was shown as this one's "training finished"."""
    path = plan.cfg.run_dir / "summary.json"
    try:
        if path.stat().st_mtime < plan.config_path.stat().st_mtime:
            return None
    except OSError:
        return None
    data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return data
