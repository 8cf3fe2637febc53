"""A TCPStore bound to one address, and a client of one: the sockets of comm/stores.py's stores.

torch's TCPStore listens on every interface (IPv4 and IPv6) whatever host it is given; ours listens on
a socket we bind (handed over as `master_listen_fd`). A name is taken as its IPv4 address on both sides,
as the route and every node's checks take it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from datetime import timedelta
from typing import Any


class StoreAddressInUse(OSError):
    pass


class NotAStore(Exception):
    """The port accepted the connection but never answered as a torch store."""


def bound_server(addr: str, port: int, timeout: timedelta, multi_tenant: bool = False, wait_for_workers: bool = False) -> Any:
    """A TCPStore server listening on `addr` alone (port 0: a free one; `.port` says which)."""
    import torch.distributed as dist

    try:  # IPv4, as the route, `check` and every node's checks take a name (a router's DNS may answer IPv6 first)
        infos = socket.getaddrinfo(addr, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror:  # an IPv6 literal, or a name with no IPv4 address
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StoreAddressInUse(exc.errno, f"{addr}:{port} is already in use") from None
        raise
    real_port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the descriptor from here on (and closes it when it goes)
    libuv = _libuv_takes_a_listen_fd() and os.environ.get("TORCH_DISTRIBUTED_USE_LIBUV", "1") != "0"
    try:
        return dist.TCPStore(
            sockaddr[0],  # its own client: the address it listens on, not the name looked up again
            real_port,
            None,
            True,
            timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            master_listen_fd=fd,
            use_libuv=libuv,
        )
    except Exception:
        if libuv:  # the libuv backend leaves the descriptor open when it fails; the legacy one took it
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _libuv_takes_a_listen_fd() -> bool:
    """torch's libuv store takes a bound socket from 2.8 on (pytorch #150215); before, only the
    legacy backend does (the libuv one raises NotImplementedError)."""
    import torch

    from aura_hpc.config.device import release

    return release(torch.__version__) >= (2, 8)


def _ipv4(addr: str) -> str:
    """A name's IPv4 address (an address, or a name without one, as it is)."""
    try:
        return str(socket.getaddrinfo(addr, None, family=socket.AF_INET, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError, OSError):
        return addr


def client(addr: str, port: int, timeout: timedelta, give_up_s: float | None = None) -> Any:
    """A client of the store at addr:port. With `give_up_s`, one that is not connected by then raises
    TimeoutError: a port where another program answers (a web server) holds torch's client in its
    handshake far past the store's own timeout (77 s with --rdzv-timeout 25; forever, tried here): NotAStore."""
    import torch.distributed as dist

    def make() -> Any:
        host = _ipv4(addr)  # where bound_server listens: torch's client tried a name's IPv6 address first, until its timeout
        return dist.TCPStore(host, port, None, False, timeout, use_libuv=os.environ.get("TORCH_DISTRIBUTED_USE_LIBUV", "1") != "0")

    if give_up_s is None:
        return make()
    import threading

    made: list[Any] = []
    failed: list[BaseException] = []

    def attempt() -> None:
        try:
            made.append(make())
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    t = threading.Thread(target=attempt, name="aura-store-connect", daemon=True)  # left behind if it never returns
    t.start()
    t.join(give_up_s)
    if failed:
        raise failed[0]
    if not made:
        raise NotAStore(
            f"{addr}:{port} accepted the connection but did not answer as a torch store within {give_up_s:.0f} s: another "
            "program listens on that port"
        )
    return made[0]
