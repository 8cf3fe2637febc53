"""Resource samples (psutil for CPU/RAM/disk/network, NVML for GPUs) and the background sampler
the trainer runs on one rank per node; it also feeds the GPU circuit breaker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aura_hpc.ops.gpu_health import Fault, GpuReader, HealthRules

log = logging.getLogger("aura_hpc")


class Sampler:
    def __init__(self, reader: GpuReader, disk_path: str | Path = ".") -> None:
        import psutil

        self.psutil = psutil
        self.reader = reader
        self.disk_path = str(disk_path)
        self._net = self._network()
        self._t = time.monotonic()
        psutil.cpu_percent(None)  # the first call only starts the measurement

    def _network(self) -> dict[str, tuple[int, int]]:
        """Bytes received and sent per network interface: not loopback, where one machine's ranks talk to each other
        (gloo on 127.0.0.1: a single-machine run showed hundreds of Mbit/s of "network"), nor a bond's or bridge's
        members, whose bytes their master counts again (a bond of two ports read twice its traffic)."""
        nics = self.psutil.net_io_counters(pernic=True)
        return {
            name: (c.bytes_recv, c.bytes_sent)
            for name, c in nics.items()
            if name != "lo" and not name.startswith("lo:") and not os.path.exists(f"/sys/class/net/{name}/master")
        }

    def _rates(self, now: dict[str, tuple[int, int]], dt: float) -> tuple[float, float]:
        """Mbit/s since the last sample, over the interfaces seen both times. A counter that went back (a NIC reset, a
        device gone and back) counts nothing: summed whole, an interface lost between two samples read as a negative rate."""
        rx = sum(max(0, c[0] - self._net[n][0]) for n, c in now.items() if n in self._net)
        tx = sum(max(0, c[1] - self._net[n][1]) for n, c in now.items() if n in self._net)
        return round(rx * 8 / dt / 1e6, 2), round(tx * 8 / dt / 1e6, 2)

    def sample(self, full: bool = True) -> dict[str, Any]:
        """A row of every reading; `full=False`: the GPUs' alone (what the breaker's rules read)."""
        if not full:
            return {"gpus": self.reader.read()}
        ps = self.psutil
        now = time.monotonic()
        net = self._network()
        dt = max(1e-6, now - self._t)
        mem = ps.virtual_memory()
        try:
            disk = ps.disk_usage(self.disk_path)
            disk_free_gb, disk_used_pct = round(disk.free / 2**30, 2), disk.percent
        except OSError:
            disk_free_gb, disk_used_pct = None, None
        row: dict[str, Any] = {
            "time": round(time.time(), 3),
            "host": socket.gethostname(),
            "cpu_pct": ps.cpu_percent(None),
            "ram_used_gb": round(mem.used / 2**30, 2),
            "ram_pct": mem.percent,
            "disk_free_gb": disk_free_gb,
            "disk_used_pct": disk_used_pct,
        }
        row["net_rx_mbps"], row["net_tx_mbps"] = self._rates(net, dt)
        self._net, self._t = net, now
        gpus = self.reader.read()
        if gpus:
            row["gpus"] = gpus
        return row


class BackgroundMonitor:
    """Samples in a daemon thread at the breaker's cadence and the rows' (see __init__): JSON lines to a file, and the
    breaker rules.

    The training loop only reads `self.fault` (set once); it never waits on this thread.
    """

    def __init__(
        self,
        sampler: Sampler,
        interval_s: float,
        out_path: Path | None,
        rules: HealthRules | None,
        on_sample: Callable[[dict[str, Any]], None] | None = None,
        rules_every_s: float = 0.0,
        write_every_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """One thread samples when the rules are due (every `rules_every_s`) and when the file and trackers are
        (every `write_every_s`); 0: every `interval_s`. Tied to one rate, a monitor_interval_s of 1 s made the
        breaker's throttle_samples (3 x 5 s) a 3 s blip, and one of 60 s wrote rows every 5 s."""
        self.sampler = sampler
        self.interval_s = interval_s
        self.rules_every_s, self.write_every_s, self.clock = rules_every_s, write_every_s, clock
        self.out_path = out_path
        self.rules = rules
        self.on_sample = on_sample
        self.fault: Fault | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aura-monitor", daemon=True)

    def start(self) -> BackgroundMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # The breaker's rules come first and alone decide whether this thread goes on: a full disk under the
        # samples' file, or a tracker that fails on a row, costs the samples (said once), never the breaker.
        every = {"rules": self.rules_every_s or self.interval_s, "write": self.write_every_s or self.interval_s}
        start = self.clock()
        due_at = {what: start + seconds for what, seconds in every.items()}
        f = None
        try:
            while True:
                # Rows are sampled only for a file or trackers that take them: with neither (monitor_interval_s=0, the
                # default) every breaker sample was a full one, the disk's statvfs included, and the row thrown away.
                writing = self.out_path is not None or self.on_sample is not None
                watching = [
                    w for w in due_at if (w == "write" and writing) or (w == "rules" and self.rules is not None and self.fault is None)
                ]
                if not watching:
                    self._stop.wait()
                    break
                if self._stop.wait(max(0.0, min(due_at[w] for w in watching) - self.clock())):
                    break
                now = self.clock()
                due = {w for w in watching if now >= due_at[w] - 1e-3}
                for w in due:  # the cadence kept (a late sample does not push the next), never a burst to catch up
                    due_at[w] = max(due_at[w] + every[w], now + every[w] / 2)
                if not due:
                    continue
                try:
                    # The rules alone read the GPUs alone: the disk's statvfs on a hung shared filesystem blocked the
                    # breaker for good, and every rank asked the metadata server every 5 s for nothing.
                    row = self.sampler.sample(full="write" in due)
                except Exception as exc:  # a sampling hiccup must never stop training
                    log.warning("resource sample failed: %s", exc)
                    continue
                if "rules" in due and self.rules is not None and self.fault is None:
                    try:
                        self.fault = self.rules.evaluate(row.get("gpus", []))
                    except Exception as exc:  # a reading of another shape (a replay, a new field): said, not the thread's end
                        log.warning("the GPU circuit breaker could not judge a reading (%s: %s)", type(exc).__name__, exc)
                if "write" not in due:
                    continue
                if self.out_path is not None:
                    try:
                        if f is None:
                            self.out_path.parent.mkdir(parents=True, exist_ok=True)
                            f = self.out_path.open("a", encoding="utf-8")
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                    except OSError as exc:
                        log.warning("resource samples are no longer written to %s (%s); the breaker still watches", self.out_path, exc)
                        self.out_path = None
                if self.on_sample is not None:
                    try:
                        self.on_sample(row)
                    except Exception as exc:
                        log.warning("resource samples are no longer sent to the trackers (%s); the breaker still watches", exc)
                        self.on_sample = None
        finally:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
