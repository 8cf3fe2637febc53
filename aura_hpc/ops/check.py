"""`python -m aura_hpc check`: find the network, storage and GPU problems of a multi-node setup.

Single machine: Python/torch/CUDA/NCCL, GPUs, working backends, free disk. Across machines
(the classic test_ddp.py all_reduce check done right): TCP reachability of the master, a
rendezvous that catches duplicate node ranks, an all_reduce every rank verifies, bus bandwidth
over a few sizes, clock skew, the address each node uses, and a shared-directory test.
Each failure is one line with the cause and the fix. A watchdog ends the check (--timeout for the
across-machines part, and for the local checks the larger of 60 s and --timeout), so an unhealthy setup never
hangs it.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from collections.abc import Callable

from aura_hpc.errors import LaunchError
from aura_hpc.ops.check_cluster import ClusterArgs, cluster_checks
from aura_hpc.ops.check_local import DISK_STAGE, local_checks
from aura_hpc.ops.check_report import Failed, Report
from aura_hpc.ops.network import exported_interface_problem, interface_problem, lan_master_problem

LOCAL_CHECKS_S = 60.0  # CUDA's start and NCCL's self-test on 8 GPUs take seconds
SERVER_STAGE = "the parameter server"


def local_deadline(timeout: float) -> float:
    """Seconds the local checks may take: a slower machine's CUDA start (persistence mode off, 8 GPUs) asks --timeout for more."""
    return max(LOCAL_CHECKS_S, timeout)


def probe_deadline(timeout: float) -> float:
    """Seconds `check --server` may take after the local checks: its five steps (port, store, join, pair, round
    trip) are each bounded by --timeout; a peer that stalls between them does not hang the check."""
    return 5 * timeout


def run(
    output_dir: str | None,
    cluster: ClusterArgs | None,
    on_timeout: Callable[[Report, str], None],
    timeout: float = 0.0,
    server: Callable[[Report], None] | None = None,
) -> Report:
    """All checks; a watchdog thread calls on_timeout(report, stage) and ends the process at the deadline.
    `server`: the parameter server's probe (`check --server`), run after the local checks."""
    report = Report()
    t0 = time.perf_counter()
    stage = ["local checks"]
    timer: threading.Timer | None = None

    def fire() -> None:
        report.elapsed_s = time.perf_counter() - t0
        on_timeout(report, stage[0])
        os._exit(1)

    def watch(seconds: float) -> threading.Timer:
        # The safety net: every stage has its own timeout, but nothing may hang past the deadline.
        t = threading.Timer(seconds + 1.0, fire)
        t.daemon = True
        t.start()
        return t

    if cluster is not None:
        report.node_rank, report.nnodes = cluster.node_rank, cluster.nnodes
        if cluster.ifname and cluster.nnodes > 1:  # over the environment, as `local` does (an exported name won, in silence)
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = cluster.ifname
    # This machine alone too: a GPU or driver that stops answering hung a plain `check` for ever.
    timer = watch(local_deadline(cluster.timeout if cluster is not None else timeout))
    try:
        local_checks(report, output_dir, stage)
        if server is not None:
            timer.cancel()
            stage[0] = SERVER_STAGE
            timer = watch(probe_deadline(timeout))
            server(report)
        if cluster is not None:
            # --timeout is the across-machines part's own: the local checks used up the 10 s before the master was tried.
            timer.cancel()
            cluster.deadline = time.monotonic() + cluster.timeout
            timer = watch(cluster.timeout)
            try:
                cluster_checks(report, cluster, stage)
            except Failed:
                pass
            except (RuntimeError, OSError, TimeoutError) as exc:  # a peer gone mid-check (Ctrl+C there, Wi-Fi): the report
                why = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
                report.add(
                    stage[0], False, f"stopped: {why}", "a node stopped or the link dropped during the check: run it again on every node"
                )
    finally:
        report.elapsed_s = time.perf_counter() - t0
        if timer is not None:
            timer.cancel()
    return report


def gpu_nodes_here() -> bool:
    """Whether this machine has GPU device nodes: asked before the watchdog runs, so without CUDA (a GPU that stopped
    answering hung its start-up) and without torch (1-2 s)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg") or os.path.exists("/dev/kfd")


def cluster_args(
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int,
    backend: str = "auto",
    shared_dir: str | None = None,
    timeout: float = 10.0,
    sizes_mb: str = "1,8,32",
    ifname: str | None = None,
    typed_master: bool = True,
) -> ClusterArgs | None:
    """The across-machines part of a check, or None for this machine alone."""
    if nnodes <= 1 and not master_addr:
        return None
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (fix: --node-rank 0 on the master, 1..N-1 on the others)")
    if nnodes > 1 and not master_addr:
        raise LaunchError("--nnodes > 1 needs --master-addr (fix: --master-addr <IP of node 0> on every node)")
    if ifname and (problem := interface_problem(ifname)):
        raise LaunchError(problem)  # as `local` refuses it (gloo said "Unable to find address for" it, after the rendezvous)
    # What --ifname does not replace reaches gloo and NCCL as it is: NCCL's only where NCCL runs (as `local` checks it).
    nccl = os.environ.get("NCCL_SOCKET_IFNAME") and (backend == "nccl" or (backend == "auto" and gpu_nodes_here()))
    exported = ("GLOO_SOCKET_IFNAME",) + ("NCCL_SOCKET_IFNAME",) * bool(nccl)
    if not ifname and (problem := exported_interface_problem(exported)):
        raise LaunchError(problem)
    if not 1 <= master_port <= 65535:  # 0 had node 0 listen on a random port, and the others blame the firewall
        raise LaunchError(f"--master-port {master_port} is not a TCP port (fix: --master-port 29500, the same on every node)")
    # As `local` says it: check must not pass a master that training refuses. A name Slurm gave (typed_master False)
    # is the scheduler's: its nodes may share one host, loopback included (a one-machine Slurm, the test cluster).
    if master_addr and (problem := lan_master_problem(master_addr, nnodes if typed_master else 1)):
        raise LaunchError(problem)
    try:
        sizes = tuple(float(x) for x in sizes_mb.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or not all(0 < s <= 4096 for s in sizes):
        raise LaunchError(f"--sizes-mb {sizes_mb!r} is not a comma list of sizes in MB, each in (0, 4096] (fix: --sizes-mb 1,8,32)")
    return ClusterArgs(
        nnodes, node_rank, master_addr or "127.0.0.1", master_port, backend, shared_dir, timeout, sizes, ifname, slurm=not typed_master
    )


def show(report: Report, as_json: bool, timeout: float, timed_out_at: str | None = None) -> None:
    """Print a report: a table plus one line per failure, or JSON for scripts."""
    from aura_hpc import console

    if timed_out_at:
        disk = timed_out_at.startswith(DISK_STAGE)
        local = disk or timed_out_at == "local checks"
        seconds = local_deadline(timeout) if local else probe_deadline(timeout) if timed_out_at == SERVER_STAGE else timeout
        fix = (
            "its filesystem does not answer (an NFS or Lustre server gone?): check the mount (`df`, `mount`), or another --output-dir"
            if disk
            else "a GPU or driver that does not answer: see `nvidia-smi` on this machine"
            if local
            else "see the failed line above; a firewall that drops gloo/NCCL's data ports hangs here: open them between the nodes"
        )
        report.add("timeout", False, f"the check did not finish within {seconds:g}s (stuck at: {timed_out_at})", fix)
    if as_json:
        print(json.dumps(report.to_json(), indent=2), flush=True)
        return
    rows = [[("ok" if f.ok and not f.warning else "WARN" if f.warning else "FAIL"), f.name, f.detail] for f in report.findings]
    console.grid(f"aura_hpc check: node {report.node_rank}/{report.nnodes}, {report.elapsed_s:.1f}s", ["", "check", "result"], rows)
    for f in report.findings:
        if not f.ok and not f.warning:
            console.error(f.line())
        elif f.warning and f.fix:
            console.warn(f.line())


def run_and_show(
    output_dir: str | None,
    cluster: ClusterArgs | None,
    as_json: bool = False,
    timeout: float = 0.0,
    server: Callable[[Report], None] | None = None,
) -> int:
    """`check` as a command: run everything, print the report, exit status 1 on any failure."""
    timeout = cluster.timeout if cluster is not None else timeout
    report = run(output_dir, cluster, lambda r, stage: show(r, as_json, timeout, stage), timeout, server)
    show(report, as_json, timeout)
    return 0 if report.ok else 1
