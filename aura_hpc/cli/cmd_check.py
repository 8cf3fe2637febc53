"""`check` (one machine, or several at once) and `monitor` (resource readings)."""

from __future__ import annotations

import argparse


def cmd_check(a: argparse.Namespace) -> int:
    import math

    from aura_hpc.config import load_config

    # Read first, on one machine too: a typo in --config or --set was ignored there and the report said all was well.
    run_config = load_config(a.config, a.overrides)
    from aura_hpc.ops import check

    if not (math.isfinite(a.timeout) and a.timeout > 0):  # nan passed every comparison: "within nans"
        from aura_hpc.errors import ConfigError

        raise ConfigError(f"--timeout must be a number of seconds above 0, got {a.timeout} (fix: --timeout 10)")

    if a.server:
        return _check_ps_server(a)
    from aura_hpc.cli.common import flags_from_env

    flags_from_env(a, {"nnodes": 1, "node_rank": 0, "master_port": 29500})
    if a.shared_dir and a.nnodes <= 1:  # skipped in silence, and the report said all was well
        from aura_hpc.errors import ConfigError

        raise ConfigError(
            "--shared-dir is tested between nodes: each writes, the others read (fix: run it on every node with --nnodes N "
            "--node-rank R --master-addr <node 0's IP>)"
        )

    cluster = check.cluster_args(
        a.nnodes, a.node_rank, a.master_addr, a.master_port, a.backend, a.shared_dir, a.timeout, a.sizes_mb, a.ifname
    )
    if cluster is not None and cluster.nnodes > 1:
        cluster.run_config = run_config  # the model and batch the link advice is for: what the user will train
    if cluster is not None and cluster.nnodes > 1:
        from aura_hpc import console
        from aura_hpc.ops.network import is_trusted_range

        if not is_trusted_range(cluster.master_addr):
            console.warn(
                f"master address {cluster.master_addr} is neither private nor loopback: the rendezvous port and the process "
                "group trust every peer that connects (fix: run on a private network or VPN, and firewall the port to your nodes)"
            )
    return check.run_and_show(a.output_dir, cluster, a.json, a.timeout)


def _check_ps_server(a: argparse.Namespace) -> int:
    """From a worker PC: this machine, then the parameter server's port, a join and a tensor round trip."""
    from aura_hpc.ops.check import run_and_show
    from aura_hpc.ops.check_report import Report
    from aura_hpc.ps.auth import given_secret
    from aura_hpc.ps.probe import check_server
    from aura_hpc.ps.worker import parse_server

    addr, port = parse_server(a.server, 30005)
    secret = given_secret(a.secret_file)

    def probe(report: Report) -> None:
        check_server(report, addr, port, a.timeout, secret)

    # Under the same watchdog as a plain check: a GPU that stopped answering hung this one for ever.
    return run_and_show(a.output_dir, None, a.json, a.timeout, probe)


def cmd_monitor(a: argparse.Namespace) -> int:
    import json
    import sys
    import time

    from aura_hpc import console
    from aura_hpc.errors import ConfigError
    from aura_hpc.ops.gpu_health import open_reader
    from aura_hpc.ops.resources import Sampler

    if not 0 < a.interval < 86400:  # NaN too
        raise ConfigError(f"--interval must be positive, got {a.interval} (fix: --interval 5)")
    if a.count < 0:  # sampled nothing and exited 0
        raise ConfigError(f"--count must be 0 (until Ctrl+C) or more, got {a.count} (fix: --count 10)")
    sampler = Sampler(open_reader(a.replay or ""), a.disk or ".")
    out = None
    if a.json:
        try:
            out = sys.stdout if a.json == "-" else open(a.json, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--json {a.json}: {exc.strerror} (fix: a file in a folder that exists and you may write)") from None
    live = None if out is not None or not sys.stdout.isatty() else console.live_table()
    n = 0
    try:
        while a.count == 0 or n < a.count:
            time.sleep(a.interval)
            row = sampler.sample()
            n += 1
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            elif live is not None:
                live.update(console.resources_table(row))
            else:
                console.plain(json.dumps(row))
    finally:
        if live is not None:
            live.stop()
        if out is not None and out is not sys.stdout:
            out.close()
    return 0


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "check",
        help="check this machine, or the network/storage between machines (all_reduce, bandwidth, NFS)",
        description="Alone: Python, torch, CUDA/NCCL, GPUs, backends, disk. With --nnodes N on every machine: "
        "reachability, rendezvous, a verified all_reduce, bus bandwidth, clock skew, addresses and --shared-dir.",
    )
    p.add_argument("--nnodes", type=int, help="number of machines taking part (default 1)")
    p.add_argument("--node-rank", type=int, help="this machine's index, 0 on the master")
    p.add_argument("--master-addr", help="IP address of node 0")
    p.add_argument("--master-port", type=int, help="TCP port on node 0 (default 29500)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="process-group backend to test")
    p.add_argument("--config", help="between nodes: the config the link advice is for (default: the defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value")
    p.add_argument("--secret-file", help="with --server: a file holding the run's secret (default: the AURA_PS_SECRET variable)")
    p.add_argument("--server", help="from a worker PC: check the parameter server at ADDR[:PORT] (`ps`), with a tensor round trip")
    p.add_argument("--shared-dir", help="a directory that should be the same (NFS) on every node: write-then-read test")
    p.add_argument("--ifname", help="network interface for gloo/NCCL (default: the one that routes to the master)")
    p.add_argument("--sizes-mb", default="1,8,32", help="all_reduce sizes for the bandwidth test (default 1,8,32)")
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds the across-machines part may take (default 10); the local checks: the larger of 60 and this",
    )
    p.add_argument("--output-dir", help="where runs will go (free disk is checked there)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "monitor",
        help="CPU, RAM, disk, network and per-GPU readings at an interval",
        description="A live table of CPU, RAM, disk, network and per-GPU utilisation, memory, temperature, power and clocks "
        "(NVML); --json FILE writes JSON lines instead.",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--json", metavar="FILE", help="append JSON lines to FILE ('-' for stdout) instead of the live table")
    p.add_argument("--count", type=int, default=0, help="stop after this many samples (default: until Ctrl+C)")
    p.add_argument("--disk", help="the path whose filesystem is reported (default: .)")
    p.add_argument("--replay", help=argparse.SUPPRESS)  # recorded GPU readings instead of NVML (tests)
    p.set_defaults(func=cmd_monitor)
