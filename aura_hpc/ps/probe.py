"""`check --server ADDR[:PORT]` from a worker PC: is the parameter server reachable, and does a
tensor make the round trip through the same path gradients take (join, then a gloo pair)?"""

from __future__ import annotations

import os
import socket
import time

import torch

from aura_hpc.errors import AuraError, LaunchError
from aura_hpc.ops.check_report import Report
from aura_hpc.ops.network import route_to
from aura_hpc.ps import auth, wire
from aura_hpc.ps.join import request_join

PROBE_FLOATS = 1 << 20  # 4 MB: the size of a small model's gradient


def check_server(report: Report, addr: str, port: int, timeout: float, secret: str | None) -> None:
    from aura_hpc.launch.local import wait_for_master

    try:
        wait_for_master(
            addr,
            port,
            timeout,
            who="the parameter server",
            peer="the server PC",
            fix=f"start `python -m aura_hpc ps` on the server PC, use the address it prints, and allow TCP port {port} in its firewall",
        )
    except LaunchError as exc:
        text = str(exc)
        detail, _, fix = text.partition(" (fix: ")
        report.add("server port", False, detail, fix.rstrip(")"))
        return
    report.add("server port", True, f"{addr}:{port} answers")
    if not secret:
        report.add(
            "join",
            False,
            "no secret for the run: the join and the round trip are not tried",
            f"set {auth.SECRET_ENV} (or --secret-file) as `ps` printed it",
        )
        return
    own, _ = route_to(addr)
    key = auth.key_of(secret)
    try:
        store = wire.connect_store(addr, port, timeout)
        request = {"probe": True, "host": socket.gethostname(), "pid": os.getpid(), "addr": own or "127.0.0.1"}
        nonce, reply = request_join(store, key, request, f"{addr}:{port}", timeout)
    except AuraError as exc:
        detail, _, fix = str(exc).partition(" (fix: ")
        report.add("join", False, detail, fix.rstrip(")"))
        return
    answer = f"version {reply['version']}, {reply['workers']} worker ranks, wire {reply['wire_dtype']}"
    report.add("join", True, f"the server answered ({answer})")
    try:
        link = wire.Link(wire.pair_group(store, auth.pair_prefix(key, nonce), 1, own or "127.0.0.1", timeout), 1, timeout)
        wire.handshake(link, key, nonce)
        sent = torch.arange(PROBE_FLOATS, dtype=torch.float32)
        started = time.perf_counter()
        link.send([wire.PROBE, PROBE_FLOATS], sent)
        back = torch.empty_like(sent)
        link.recv({wire.PROBE: back})
        seconds = time.perf_counter() - started
    except RuntimeError as exc:
        first = wire.failure(exc)
        report.add(
            "round trip",
            False,
            f"the server's port answers but the data connection failed ({first})",
            "allow python's incoming connections on both PCs (gloo opens one more port per worker), or pick the network with "
            "GLOO_SOCKET_IFNAME",
        )
        return
    ok = torch.equal(back, sent * 2)
    mb = 2 * sent.numel() * sent.element_size() / 1e6
    report.add(
        "round trip",
        ok,
        f"{mb:.1f} MB there and back in {seconds * 1000:.0f} ms ({mb / seconds:.0f} MB/s)" if ok else "the tensor came back changed",
        "" if ok else "a network device corrupts data: try another network",
    )


def echo(link: wire.Link) -> None:
    """The server's side of the round trip: the tensor sent back doubled, through the same path as gradients."""
    buf = torch.empty(PROBE_FLOATS, dtype=torch.float32)
    link.recv({wire.PROBE: buf})
    link.send([wire.PROBE, PROBE_FLOATS], buf * 2)
