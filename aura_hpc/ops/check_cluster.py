"""`check` across machines: reachability of the master, a rendezvous that catches duplicate node
ranks, an all_reduce every rank verifies, bus bandwidth, clock skew, addresses and a shared directory.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from aura_hpc.comm import collectives, node_versions, stores
from aura_hpc.ops.check_inbound import inbound
from aura_hpc.ops.check_report import Failed, Report
from aura_hpc.ops.check_shared_dir import shared_dir
from aura_hpc.ops.check_store import node_from_store
from aura_hpc.ops.network import resolve, route_to


@dataclass
class ClusterArgs:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    backend: str = "auto"
    shared_dir: str | None = None
    timeout: float = 10.0
    sizes_mb: tuple[float, ...] = (1.0, 8.0, 32.0)
    ifname: str | None = None
    deadline: float = 0.0  # monotonic; set when the check starts
    run_config: Any = None  # a RunConfig: the model and batch the link advice is for (None: the defaults)
    slurm: bool = False  # a Slurm job's check (`submit --check`): its nodes' interfaces are chosen as its training's


def group_interfaces(a: ClusterArgs, iface: str | None) -> dict[str, str]:
    """The interfaces the process-group stage gives gloo and NCCL, as training does: `local`'s, the route's to the
    master for both; a Slurm job's, none (NCCL picks its own, IPoIB first; gloo's is set by the job where the node's
    name is loopback): a node whose InfiniBand interface is up but reaches no other passed, and training hung."""
    return {} if not iface or a.nnodes <= 1 or a.slurm else {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}


def reach_master(report: Report, a: ClusterArgs, deadline: float) -> None:
    """TCP connect to master:port, retried until the deadline; the error kind says what is wrong."""
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((a.master_addr, a.master_port), timeout=max(0.2, min(2.0, deadline - time.monotonic()))):
                report.add("reach master", True, f"{a.master_addr}:{a.master_port} answers")
                return
        except socket.gaierror:
            report.add(
                "reach master", False, f"{a.master_addr!r} does not resolve", "use node 0's IP address, e.g. --master-addr 192.168.1.10"
            )
            raise Failed from None
        except OSError as exc:
            if last is None:
                # Plain line on stderr (stdout may be --json): says why nothing happens yet.
                print(
                    f"node {a.node_rank}: waiting for the master at {a.master_addr}:{a.master_port} ({exc.strerror or exc}) ...",
                    file=sys.stderr,
                    flush=True,
                )
            last = exc
        if time.monotonic() >= deadline - 0.3:
            break
        time.sleep(0.2)
    report.add("reach master", False, *_explain_connect(a, last))
    raise Failed


def _explain_connect(a: ClusterArgs, exc: OSError | None) -> tuple[str, str]:
    where = f"{a.master_addr}:{a.master_port}"
    loop = a.master_addr.startswith("127.") or a.master_addr == "localhost"
    hint = "; --master-addr is a loopback address: only node 0 itself can use it" if loop and a.nnodes > 1 else ""
    code = getattr(exc, "errno", None)
    if code == errno.ECONNREFUSED:
        return (
            f"connection refused at {where}: nothing listens there, or a firewall rejects it{hint}",
            f"start `check --node-rank 0` on the master first with the same --master-port, and open TCP port {a.master_port} "
            f"on it (ufw allow {a.master_port}/tcp; Windows/WSL2: a firewall rule plus mirrored networking or a portproxy)",
        )
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        # firewalld's default reject (icmp-host-prohibited) reaches a program as "no route to host" too.
        return (
            f"no route to {a.master_addr}, or its firewall rejects port {a.master_port}{hint}",
            "check --master-addr (node 0's IP on the network both machines share: `ip -4 addr` there) and that both are on that "
            f"network; on node 0, open the port (firewalld: firewall-cmd --add-port={a.master_port}/tcp; ufw allow {a.master_port}/tcp)",
        )
    return (
        f"no answer from {where} within the timeout (packets dropped){hint}",
        f"check that {a.master_addr} is node 0's IP, and that its firewall lets TCP port {a.master_port} in; "
        "under WSL2's NAT the Windows host must forward the port (or use mirrored networking)",
    )


def _node_info(a: ClusterArgs, report: Report) -> dict[str, Any]:
    ip, iface = route_to(a.master_addr)
    host = socket.gethostname()
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        host_ip = None
    return {
        "node_rank": a.node_rank,
        "hostname": host,
        "hostname_ip": host_ip,
        "ip": ip,
        "interface": a.ifname or iface,
        "uid": os.getuid() if hasattr(os, "getuid") else None,
        "gid": os.getgid() if hasattr(os, "getgid") else None,
        "user": os.environ.get("USER") or os.environ.get("USERNAME") or "",
        "pid": os.getpid(),
        "cuda": has_cuda(),  # `auto` is decided from every node's (training agrees on one backend too)
        "versions": node_versions.of_this_process(a.node_rank, host, a.backend != "gloo" and has_cuda()),
        # A backend that did not start in this node's own check: no node tries it together (a failed start here also
        # numbered this node's next group apart from the others', and the group then waited for its whole timeout).
        "backends_failed": [f.name.removeprefix("backend ") for f in report.findings if f.name.startswith("backend ") and not f.ok],
    }


def has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cluster_checks(report: Report, a: ClusterArgs, stage: list[str]) -> None:
    import torch
    import torch.distributed as dist

    deadline = a.deadline or time.monotonic() + a.timeout
    report.node_rank, report.nnodes = a.node_rank, a.nnodes
    if a.node_rank > 0:
        stage[0] = "reaching the master"
        reach_master(report, a, deadline)
    stage[0] = "rendezvous"
    left = timedelta_s(max(1.0, deadline - time.monotonic()))
    try:
        if a.node_rank == 0:  # listening on the master's address alone, not on every interface
            tcp = stores.bound_server(resolve(a.master_addr) or a.master_addr, a.master_port, left)
        else:
            tcp = stores.client(a.master_addr, a.master_port, left, give_up_s=max(1.0, deadline - time.monotonic() - 1))
    except stores.NotAStore as exc:
        report.add("rendezvous", False, str(exc), f"--master-port of node 0's `check` (another program holds {a.master_port})")
        raise Failed from None
    except Exception as exc:
        if a.node_rank == 0:
            report.add(
                "rendezvous",
                False,
                f"cannot listen on {a.master_addr}:{a.master_port} ({str(exc).splitlines()[0][:120]})",
                f"--master-addr must be one of this machine's addresses, port {a.master_port} free (try --master-port {a.master_port + 1})",
            )
        else:
            report.add("rendezvous", False, f"the master's store did not answer ({str(exc).splitlines()[0][:120]})", "start node 0 first")
        raise Failed from None
    store = dist.PrefixStore("aura-check", tcp)
    joined = store.add(f"node{a.node_rank}", 1)
    if joined > 1:
        report.add(
            "node rank",
            False,
            f"another machine already joined as --node-rank {a.node_rank}",
            f"give every machine its own --node-rank 0..{a.nnodes - 1} (0 only on the master)",
        )
        raise Failed
    info = _node_info(a, report)
    store.set(f"info{a.node_rank}", json.dumps(info))
    missing = []
    for r in range(a.nnodes):
        try:
            store.wait([f"info{r}"], timedelta_s(max(0.5, deadline - time.monotonic() - 1.0)))
        except Exception:
            missing.append(r)
    if missing:
        report.add(
            "rendezvous",
            False,
            f"node rank(s) {', '.join(map(str, missing))} never joined (of --nnodes {a.nnodes})",
            f"run check on every machine with the same --nnodes/--master-addr/--master-port and --node-rank 0..{a.nnodes - 1}"
            + (
                f"; if they are running, this machine's own firewall may drop port {a.master_port}: allow it inbound here "
                f"(e.g. sudo ufw allow {a.master_port}/tcp, or nft/iptables rules), and check from another machine with "
                f"`nc -zv {a.master_addr} {a.master_port}`"
                if a.node_rank == 0
                else ""
            ),
        )
        raise Failed
    nodes = [node_from_store(report, store, r) for r in range(a.nnodes)]
    report.nodes = nodes
    # Node 0's store goes with its process: a finding every node makes from these facts (other versions, no GPU)
    # ended node 0 first and the others, still reading, said node 0 never joined.
    # (A few seconds at most: a node gone since, or one of an older release that says nothing, costs no more.)
    store.add("facts-read", 1)
    until = min(deadline, time.monotonic() + FACTS_READ_S)
    while a.node_rank == 0 and store.add("facts-read", 0) < a.nnodes and time.monotonic() < until:
        time.sleep(0.05)
    report.add("rendezvous", True, f"{a.nnodes} nodes joined: " + ", ".join(f"{n['node_rank']}={n['hostname']}/{n['ip']}" for n in nodes))
    _address_findings(report, a, nodes)
    if any("versions" in n for n in nodes):  # (a node of an older release says nothing)
        _, problem = node_versions.mismatch([n.get("versions") for n in nodes], who="node")
        if problem:
            message, _, fix = problem.partition(" (fix: ")
            report.add("versions", False, message, fix.removesuffix(")"))
            raise Failed
    # Decided, and refused, from the facts every node has read: a node that stopped later than that, before the
    # others had read what it said at the inbound stage, had them report a closed firewall instead.
    backend = a.backend
    cuda = [n.get("cuda") is True for n in nodes]
    if backend == "auto" and all("cuda" in n for n in nodes):  # NCCL where every node has a GPU, as training decides
        backend = "nccl" if all(cuda) else "gloo"
    elif backend == "auto":  # a node of an older release says nothing: each decides for itself, as that one does
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and a.backend == "nccl" and all("cuda" in n for n in nodes) and not all(cuda):
        without = ", ".join(str(r) for r, c in enumerate(cuda) if not c)
        report.add("process group", False, f"--backend nccl, and node(s) {without} have no CUDA GPU", "--backend auto (gloo then) or gloo")
        raise Failed
    said = [(n["node_rank"], n.get("backends_failed")) for n in nodes]  # from the network: a list, or not said
    if failed := [str(r) for r, names in said if isinstance(names, list) and backend in names]:
        report.add(
            "process group",
            False,
            f"{backend} did not start on node(s) {', '.join(failed)} in that node's own check, so no node tried it together",
            f"the backend finding in node {failed[0]}'s report first",
        )
        raise Failed
    stage[0] = "inbound connections"
    inbound(report, a.node_rank, a.nnodes, store, nodes, deadline)

    stage[0] = f"process group ({a.backend})"
    iface = info["interface"]
    for name, value in group_interfaces(a, iface).items():  # --ifname is in the environment already (ops/check.py)
        os.environ.setdefault(name, value)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", tcp),
            rank=a.node_rank,
            world_size=a.nnodes,
            timeout=timedelta_s(max(2.0, deadline - time.monotonic())),
            device_id=device if backend == "nccl" else None,
        )
    except Exception as exc:
        report.add(
            "process group",
            False,
            f"{backend} could not connect the nodes: {str(exc).splitlines()[0][:160]}",
            f"set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the interface on the shared network (here: {iface}); "
            "open the firewall for the nodes' other ports (gloo/NCCL use random ports)",
        )
        raise Failed from None
    collectives.set_world(device)
    try:
        stage[0] = "all_reduce"
        _all_reduce_checks(report, a, device)
        stage[0] = "clock skew"
        _clock_skew(report, a)
        stage[0] = "bandwidth"
        _bandwidth(report, a, device)
        if a.nnodes > 1:
            stage[0] = "link advice"
            _advice(report, a, device)
        if a.shared_dir:
            stage[0] = "shared directory"
            shared_dir(report, a, store, nodes)
        stage[0] = "finishing"
        collectives.barrier()
    finally:
        # gloo's worker thread frees finished work (and the Python tensors it holds) right after
        # completing it; destroying the group while it still must, with the GIL held here,
        # deadlocks torch < 2.8 (seen on 2.6: ~2 runs in 8). A short GIL-free pause lets it finish.
        time.sleep(0.1)
        dist.destroy_process_group()


FACTS_READ_S = 10.0  # node 0's wait for the others to have read the nodes' facts


def timedelta_s(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _address_findings(report: Report, a: ClusterArgs, nodes: list[dict[str, Any]]) -> None:
    hosts = {n["hostname"] for n in nodes}
    same_host = len(hosts) == 1
    for n in nodes:
        hip = n.get("hostname_ip") or ""
        if a.nnodes > 1 and not same_host and hip.startswith("127."):
            report.add(
                f"node {n['node_rank']} hostname",
                True,
                f"{n['hostname']} resolves to {hip} (a loopback address, as Debian/Ubuntu /etc/hosts do)",
                f"peers would be sent to loopback by tools using the hostname: set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={n['interface']}",
                warning=True,
            )
        if a.nnodes > 1 and not same_host and (n.get("ip") or "").startswith("127."):
            report.add(
                f"node {n['node_rank']} address",
                False,
                f"reaches the master through loopback ({n['ip']}), so other machines cannot reach it",
                "use node 0's LAN IP as --master-addr on every machine",
            )
    ifaces = {n["node_rank"]: n.get("interface") for n in nodes}
    report.add("interfaces", True, ", ".join(f"node {r}: {i or '?'}" for r, i in ifaces.items()))


def _all_reduce_checks(report: Report, a: ClusterArgs, device: Any) -> None:
    import torch

    n = a.nnodes
    t = torch.full((4096,), float(a.node_rank + 1), device=device)
    collectives.all_reduce(t)
    expected = n * (n + 1) / 2
    mine_ok = bool(torch.all(t == expected).item())
    wrong = int(collectives.reduce_values([0.0 if mine_ok else 1.0])[0])
    report.add(
        "all_reduce",
        wrong == 0,
        f"sum over {n} ranks = {expected:g} verified on every rank"
        if wrong == 0
        else f"{wrong} rank(s) got a wrong sum (this one: {t[0].item():g})",
        "" if wrong == 0 else "a broken NIC/driver or mixed torch/NCCL versions: run the same software on every node",
    )


def _clock_skew(report: Report, a: ClusterArgs) -> None:

    collectives.barrier()
    t = time.time()
    times = [float(x) for x in collectives.gather_json(t)]
    skew = max(times) - min(times)
    fix = "enable time sync on every node (timedatectl set-ntp true / chrony)"
    if skew >= RENDEZVOUS_SKEW_S:
        # torch's rendezvous stamps each node's heartbeat with that node's clock, and drops a node whose last one looks
        # older than 15 s (3 x 5 s: dynamic_rendezvous._sanitize): the run churns or stops at its start.
        detail = f"{skew:.1f} s between the nodes' clocks: torch's rendezvous (local, torchrun) takes a node this far off for dead"
        report.add("clock skew", False, detail, fix)
        return
    report.add(
        "clock skew",
        skew < 1.0,
        f"{skew * 1000:.0f} ms between the nodes' clocks (after a barrier)",
        "" if skew < 1.0 else f"{fix}; logs and checkpoint times will disagree otherwise",
        warning=skew >= 1.0,
    )


RENDEZVOUS_SKEW_S = 5.0  # a third of torch's 15 s: a heartbeat is up to 5 s old already when it is read


PROBE_MB = 0.25  # the first, small all_reduce that predicts the others' time
SIZE_BUDGET_S = 3.0  # the most one size's measurement may take


def _agreed_seconds(seconds: float, device: Any) -> float:
    """The slowest rank's time: every rank then takes the same decision about the next size (a rank
    that skipped an all_reduce its peer still ran would hang both)."""
    return collectives.reduce_values([seconds], op="max")[0]


def _bandwidth(report: Report, a: ClusterArgs, device: Any) -> None:
    import torch

    n = a.nnodes
    # A small probe first: on a slow link (Wi-Fi, a rate-limited LAN) it says which sizes fit the
    # check's time, so a 10 Mbit/s link is measured rather than timed out.
    probe = torch.ones(int(PROBE_MB * 2**20 / 4), dtype=torch.float32, device=device)
    collectives.all_reduce(probe)  # connections and buffers
    per_mb = _agreed_seconds(collectives.timed(lambda: collectives.all_reduce(probe)), device) / PROBE_MB
    budget = SIZE_BUDGET_S  # a constant, not the time left: every rank must decide alike
    for mb in a.sizes_mb:
        one = per_mb * mb
        iters = max(1, min(3, int(budget / max(one, 1e-6)) - 1))
        if report.bandwidth and one * (iters + 1) > budget:
            break  # larger sizes would only take longer on this link
        numel = int(mb * 2**20 / 4)
        t = torch.ones(numel, dtype=torch.float32, device=device)
        if one < budget / 4:
            collectives.all_reduce(t)  # warm-up at this size
        collectives.barrier()

        def repeated(t: torch.Tensor = t, iters: int = iters) -> None:
            for _ in range(iters):
                collectives.all_reduce(t)

        secs = _agreed_seconds(collectives.timed(repeated) / iters, device)
        per_mb = secs / mb
        size = numel * 4
        algbw = size / secs / 1e9
        busbw = algbw * 2 * (n - 1) / n if n > 1 else algbw  # nccl-tests' bus bandwidth for all_reduce
        report.bandwidth.append(
            {
                "size_mb": mb,  # MiB
                "time_ms": round(secs * 1000, 3),
                "algbw_gbps": round(algbw, 3),  # GB/s (1e9 bytes), as nccl-tests
                "busbw_gbps": round(busbw, 3),
                "busbw_mbit_s": round(busbw * 8000, 3),  # a Wi-Fi link's figure: 0.00 GB/s rounded
            }
        )
    best = max(b["busbw_mbit_s"] for b in report.bandwidth)
    sizes = ", ".join(f"{b['size_mb']:g} MiB: {_rate(b['busbw_mbit_s'])}" for b in report.bandwidth)
    report.add("bandwidth", True, f"all_reduce bus bandwidth up to {_rate(best)} ({sizes})")


def _rate(mbit_s: float) -> str:
    return f"{mbit_s / 8000:.2f} GB/s" if mbit_s >= 8000 else f"{mbit_s:.1f} Mbit/s"


def _advice(report: Report, a: ClusterArgs, device: Any) -> None:
    """Which strategy this link calls for, for the configured model and batch (ops/link_advice.py)."""
    from aura_hpc.config import RunConfig
    from aura_hpc.data.vocab import tokenizer_vocab
    from aura_hpc.ops import link_advice

    cfg = a.run_config or RunConfig()
    best = max(report.bandwidth, key=lambda b: b["busbw_mbit_s"])
    latency = link_advice.measure_link(a.nnodes, probe_mb=0.0).latency
    vocab = tokenizer_vocab(cfg)
    # The slowest node's step: each node's own made a fast and a slow laptop print different advice.
    compute = collectives.reduce_values([link_advice.compute_seconds(cfg, vocab, device)], op="max")[0]
    if best["busbw_mbit_s"] <= 0:
        report.add(
            "link advice", False, "the link measured no bandwidth", "run the check again; a link this slow cannot train across nodes"
        )
        return
    link = link_advice.Link(a.nnodes, best["busbw_mbit_s"] * 1e6 / 8, latency)
    opts = link_advice.options(cfg, vocab, link, compute)
    report.advice = [
        {
            "option": o.name,
            "set": o.setting,
            "compute_s": round(o.compute_s, 4),
            "comm_s": round(o.comm_s, 4),
            "speedup": round(o.speedup, 2),
        }
        for o in opts
    ]
    rows = "; ".join(f"{o.name} {o.compute_s:.2f}s compute + {o.comm_s:.2f}s network = {o.speedup:.2f}x" for o in opts)
    report.add("link advice", True, f"{link_advice.advice(opts, link)} [per step: {rows}]")
