"""The parameter server's transport: torch.distributed's TCPStore for joining, and one gloo
process group of two (server = 0, worker = 1) per worker for the tensors.

Why not one process group for all: its size is fixed when it is made, so nobody could join
late, and one lost member breaks every collective. Why not torch RPC: it is in maintenance
(pytorch #149393) and its parameter-server example hangs beyond two workers (pytorch/examples
#780). A pair group per worker is torch's own point-to-point send/recv over gloo; a worker that
dies breaks only its own pair, and a new pair is made for each one that joins.

A message is a float64 header (HEADER_LEN numbers: kind, version, ...) and, where the kind
says so, one flat tensor of every parameter in the wire dtype.
"""

from __future__ import annotations

import errno
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.errors import LaunchError

HEADER_LEN = 8
# Header kinds. Worker -> server: GRAD (a gradient follows), BYE (leaving). Server -> worker:
# WEIGHTS (weights follow), STOP (training is over or the server is stopping: exit).
GRAD, BYE, WEIGHTS, STOP, PROBE = 1.0, 2.0, 3.0, 4.0, 5.0

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def host_store(port: int, timeout_s: float) -> dist.TCPStore:
    """The server's store on every interface of this machine, `port`; a clear error when it is taken."""
    try:
        return dist.TCPStore("0.0.0.0", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        text = str(exc)
        if "in use" in text.lower() or getattr(exc, "errno", None) == errno.EADDRINUSE:
            raise LaunchError(
                f"port {port} is already in use on this machine (another `ps` server?) "
                f"(fix: stop the program using it, or pass --port {port + 1} here and --server ADDR:{port + 1} to the workers)"
            ) from None
        raise LaunchError(f"cannot listen on port {port} ({text.splitlines()[0][:160]}) (fix: --port another free port)") from None


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise LaunchError(
            f"the parameter server at {addr}:{port} accepted a connection but its store did not answer "
            f"({str(exc).splitlines()[0][:160]}) (fix: check that `python -m aura_hpc ps` runs there on that port)"
        ) from None


def pair_group(store: dist.Store, prefix: str, rank: int, my_addr: str, timeout_s: float) -> dist.ProcessGroup:
    """The two-member gloo group of one worker and the server, on the interface of `my_addr`."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    options_type = getattr(dist.ProcessGroupGloo, "_Options", None)
    if options_type is None:  # an older or newer torch without the options object: default device
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    options = options_type()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=my_addr)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


class LinkLost(RuntimeError):
    """The other end of a pair closed or fell silent (gloo's first line), told apart from errors of the
    model or the optimizer, which are not a lost peer."""


@dataclass
class Link:
    """One end of a worker's pair group, counting what crosses it."""

    group: dist.ProcessGroup
    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    round_trip_s: float = 0.0
    _header: torch.Tensor = field(default_factory=lambda: torch.zeros(HEADER_LEN, dtype=torch.float64))

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def _p2p(self, op: Any, tensor: torch.Tensor, tag: int) -> int:
        try:
            op([tensor], self.peer, tag).wait()
        except RuntimeError as exc:
            raise LinkLost(failure(exc)) from None
        return tensor.numel() * tensor.element_size()

    def send(self, header: list[float], payload: torch.Tensor | None = None) -> None:
        h = torch.zeros(HEADER_LEN, dtype=torch.float64)
        h[: len(header)] = torch.tensor(header, dtype=torch.float64)
        self.bytes_sent += self._p2p(self.group.send, h, 0)
        if payload is not None:
            self.bytes_sent += self._p2p(self.group.send, payload, 1)

    def recv_header(self) -> list[float]:
        self.bytes_received += self._p2p(self.group.recv, self._header, 0)
        return [float(x) for x in self._header.tolist()]

    def recv_payload(self, into: torch.Tensor) -> None:
        self.bytes_received += self._p2p(self.group.recv, into, 1)

    def timed_round_trip(self, started: float) -> None:
        self.round_trips += 1
        self.round_trip_s += time.perf_counter() - started

    @property
    def mean_round_trip_ms(self) -> float:
        return 1000.0 * self.round_trip_s / self.round_trips if self.round_trips else 0.0


def failure(exc: BaseException) -> str:
    """The first line of a gloo error without its source-file prefix: '[.../pair.cc:537] Connection closed
    by peer [10.0.0.2]:4011' -> 'Connection closed by peer [10.0.0.2]:4011'."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". This is typically")[0][:160]


def timed_out(first_line: str) -> bool:
    """A silent peer (a Wi-Fi drop, a frozen PC) rather than a closed connection (a process gone)."""
    return "imed out" in first_line
