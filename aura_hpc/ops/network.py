"""Which local address and network interface reach a given host (LAN runs and `check`)."""

from __future__ import annotations

import socket


def route_to(addr: str) -> tuple[str | None, str | None]:
    """(local IP, interface name) this machine uses to reach `addr`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP connect sends nothing; it only picks the route
            ip = s.getsockname()[0]
    except OSError:
        return None, None
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return ip, name
    return ip, None
