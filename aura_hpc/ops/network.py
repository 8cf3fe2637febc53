"""Which local address and network interface reach a given host (LAN runs and `check`)."""

from __future__ import annotations

import socket


def port_in_use(port: int) -> bool:
    """Something on this machine listens on TCP `port` (a bind to every interface fails)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


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


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def resolve(addr: str) -> str | None:
    """`addr`'s IPv4 address (a name is looked up), or None when it does not resolve."""
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return None


def is_own_address(addr: str) -> bool:
    """True when this machine can listen on `addr` (one of its interfaces, loopback, or the wildcard)."""
    ip = resolve(addr)
    if ip is None:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def is_trusted_range(addr: str) -> bool:
    """Loopback, or a private (RFC 1918, link-local, CGNAT/VPN) range: where LAN peers are expected."""
    import ipaddress

    ip = resolve(addr)
    if ip is None:
        return True  # not resolvable: reported elsewhere
    a = ipaddress.ip_address(ip)
    return a.is_loopback or a.is_private or a.is_link_local or a in ipaddress.ip_network("100.64.0.0/10")
