"""Which local address and network interface reach a given host (LAN runs and `check`)."""

from __future__ import annotations

import os
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


def resolve(addr: str, patient: bool = False) -> str | None:
    """`addr`'s IPv4 address (a name is looked up), or None when it does not resolve. `patient`: a lookup the
    resolver calls temporary (EAI_AGAIN: a DNS server that did not answer in time) is tried again, for some 5 s,
    where one rank's answer must agree with its neighbours' (the master's node under Slurm)."""
    import time

    for pause in (0.5, 1.0, 1.5, 2.0, None) if patient else (None,):
        try:
            return socket.gethostbyname(addr)
        except socket.gaierror as exc:
            if exc.errno != socket.EAI_AGAIN or pause is None:
                return None
            time.sleep(pause)
        except OSError:
            return None
    return None


def loopback_name(addr: str) -> str | None:
    """The loopback address a host *name* resolves to here, or None. Debian and Ubuntu map a machine's own name
    to 127.0.1.1 in /etc/hosts: node 0 started with `--master-addr mypc` listened where no other node reaches.
    An IP literal or `localhost` says what it means (nodes on one host use 127.0.0.1)."""
    import ipaddress

    name = addr.strip("[]")
    if name == "localhost":
        return None
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    ip = resolve(name)
    return ip if ip is not None and ipaddress.ip_address(ip).is_loopback else None


def lan_master_problem(addr: str, nnodes: int) -> str | None:
    """Why `addr` cannot be the master of a run of `nnodes` machines, in one line with the fix, or None."""
    import re

    if host_port := re.fullmatch(r"([^:\s]+):(\d+)", addr.strip()):  # torchrun's --rdzv-endpoint form, pasted
        return f"master address {addr!r} carries a port (fix: --master-addr {host_port.group(1)} --master-port {host_port.group(2)})"
    if ":" in addr.strip("[]"):  # an IPv6 literal: the rendezvous and the stores are IPv4 (it read "does not resolve")
        return f"master address {addr!r} is an IPv6 address: IPv4 only (fix: node 0's IPv4 address, e.g. 192.168.1.10)"
    if addr != addr.strip():
        return f"master address {addr!r} has spaces around it (fix: --master-addr {addr.strip()})"
    if resolve(addr) is None:
        return f"master address {addr!r} does not resolve (fix: use node 0's IP address, e.g. 192.168.1.10)"
    if nnodes > 1 and resolve(addr) in ("0.0.0.0", "::"):  # every interface: listened on by node 0, and each other node dialled itself
        return f"master address {addr!r} is no machine's address (fix: node 0's LAN IP, see `ip -4 addr`, on every node)"
    if nnodes > 1 and (loopback := loopback_name(addr)):
        return (
            f"master address {addr} resolves to {loopback} on this machine (/etc/hosts maps the name there), where the other "
            "nodes cannot reach it (fix: --master-addr <node 0's LAN IP, see `ip -4 addr`> on every node)"
        )
    return None


def _ipv4_interfaces() -> set[str]:
    import psutil

    return {n for n, addrs in psutil.net_if_addrs().items() if any(a.family == socket.AF_INET for a in addrs)}


def exported_interface_problem(variables: tuple[str, ...]) -> str | None:
    """An exported GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME naming no interface here, in one line, or None: gloo
    failed in every worker after the rendezvous ("Unable to find address for"), NCCL found no socket interface."""
    for var in variables:
        value = os.environ.get(var, "").strip()
        if not value or value.startswith("^"):  # NCCL's ^: the interfaces to avoid; any other will do
            continue
        have, names = _ipv4_interfaces(), [n.strip() for n in value.removeprefix("=").split(",") if n.strip()]
        if var.startswith("NCCL"):  # NCCL takes prefixes (eth: eth0, eth1), exact names after "=", and any one that matches
            bad = not any(h == n or (not value.startswith("=") and h.startswith(n)) for n in names for h in have)
        else:  # gloo makes a device of each name: every one must exist
            bad = not names or any(n not in have for n in names)
        if bad:
            return (
                f"{var}={value} (exported here) names no interface with an IPv4 address on this machine "
                f"(fix: unset {var}, or one of {', '.join(sorted(have))})"
            )
    return None


def interface_problem(names: str) -> str | None:
    """Why `--ifname` (one name, or gloo's comma list) names no IPv4 interface of this machine, in one line, or None."""
    have = _ipv4_interfaces()
    listed = [n.strip() for n in names.split(",")]
    if "" in listed:  # gloo would be given an empty name
        return f"--ifname {names!r} holds an empty name (fix: --ifname {','.join(n for n in listed if n) or 'NAME'})"
    missing = [n for n in listed if n not in have]
    if not missing:
        return None
    return f"--ifname {missing[0]} is no interface with an IPv4 address on this machine (fix: one of {', '.join(sorted(have))}, or omit it)"


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
