"""`python -m aura_hpc worker`: one worker PC of a parameter-server run.

It joins the server (which checks that both run the same model, data and train settings), reads
its own shard of the prepared data, and loops: gradient of one batch on the weights it has ->
send (with the weights' version) -> receive the newest weights. Ctrl+C tells the server it leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.errors import EXIT_TRAIN_FAILED, AuraError, LaunchError, TrainingFailed
from aura_hpc.ops.network import route_to
from aura_hpc.ps import auth, wire
from aura_hpc.ps.join import StoppedWaiting, request_join, settings
from aura_hpc.ps.model_copy import ModelCopy, build_model_copy
from aura_hpc.ps.stats import ProcessStats, publish, write_stats
from aura_hpc.train.instruments import faults
from aura_hpc.train.loop.step import micro_step_loss
from aura_hpc.train.process.stop import StopRequest

log = logging.getLogger("aura_hpc")

STATS_EVERY = 20  # gradients between two stats updates (local file and the server's copy)


def parse_server(text: str, default_port: int) -> tuple[str, int]:
    """'ADDR' or 'ADDR:PORT'."""
    addr, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not addr or (port and not port.isdigit()):
        raise LaunchError(f"--server {text!r} is not ADDR or ADDR:PORT (fix: --server 192.168.1.10:{default_port})")
    return addr, int(port) if port else default_port


def connect(cfg: RunConfig, addr: str, port: int, progress: Any, stopping: Callable[[], bool] | None = None) -> tuple[Any, str]:
    """The server's store, once its port answers; (store, this PC's address towards it)."""
    from aura_hpc.launch.local import wait_for_master

    wait_for_master(
        addr,
        port,
        cfg.ps.join_timeout_s,
        progress,
        who="the parameter server",
        peer="the server PC",
        fix=f"start `python -m aura_hpc ps` on the server PC first, use the address it prints in --server, and allow TCP port "
        f"{port} (and python's other ports) in its firewall",
        stopping=stopping,
    )
    if stopping is not None and stopping():
        raise StoppedWaiting(f"{addr}:{port}")
    own, _ = route_to(addr)
    return wire.connect_store(addr, port, cfg.ps.join_timeout_s), own or "127.0.0.1"


class PsWorker:
    def __init__(self, cfg: RunConfig, addr: str, port: int, wanted_rank: int, key: bytes) -> None:
        self.cfg, self.addr, self.port, self.wanted_rank = cfg, addr, port, wanted_rank
        self.key = key  # the HMAC key of the run's secret (ps/auth.py)
        # Built before joining: the server starts counting a worker's time (and its pair group's
        # timeout) from the join, and a worker that joins ready trains at once.
        gpu = torch.cuda.is_available() and cfg.dist.backend != "gloo"
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        # Said in the join line: a PC's first visible GPU (CUDA_VISIBLE_DEVICES picks another), or its CPUs.
        self.device_said = f"{device} ({torch.cuda.get_device_name(device)})" if gpu else "the CPU"
        self.model_copy: ModelCopy = build_model_copy(cfg, device)
        self.rank = 0  # given by the server at the first join, kept when rejoining after a drop
        self.dropped_links: list[wire.Link] = []  # kept alive: destroying a gloo pair mid-wait can abort
        self.server_gone = False  # then the store is not written to any more
        self.slowest_gradient_s = 0.0  # weights in to gradient out: what the server's ps.worker_timeout_s must cover
        self.slowest_later_s = 0.0  # the same but the first, which holds torch.compile's and the device's set-up
        self.gradients_timed = 0
        self.first_excused = False  # a drop the first gradient alone explained was answered with a rejoin

    def run(self, progress: Any, on_rank: Any = None) -> int:
        try:
            link, position = self._join(progress)
        except RuntimeError as exc:  # the pair group (a firewall on gloo's port, the wrong network) or its handshake
            raise LaunchError(
                f"joined the parameter server at {self.addr}:{self.port} but the data connection failed ({wire.failure(exc)}) "
                "(fix: allow python's incoming connections on both PCs (gloo opens one more port per worker), or pick the "
                "network with GLOO_SOCKET_IFNAME)"
            ) from None
        if on_rank is not None:
            on_rank(self.rank)
        stop = StopRequest()
        stop.install()
        try:
            while True:
                link.stopping = lambda: stop.requested
                try:
                    return self._train(link, position, stop)
                except wire.StopOutlasted as exc:
                    self.server_gone = True  # its store may not answer either: the stats go to the local file
                    log.info(
                        "%s: %s; left the run after %d gradients, without a goodbye (the server lets this worker's seat go "
                        "when it sees the connection close, or after ps.worker_timeout_s where the network is down)",
                        stop.signal_name,
                        exc,
                        self.stats.steps,
                    )
                    return 0
                except wire.LinkLost as exc:
                    first = str(exc)
                    pace = "" if stop.requested else self._pace()
                    if pace == "slow":
                        # The server dropped this worker for being silent while it computed (it said "lost the server,
                        # re-run when it runs again" of a server that ran on); a rejoin would compute as slowly.
                        raise self._too_slow() from None
                    if not pace and (not wire.timed_out(first) or stop.requested):
                        raise self._lost(first) from None
                if pace == "first":
                    log.warning(
                        "lost the parameter server after the first gradient (%.0f s, torch.compile's and the device's set-up "
                        "included, over 0.8 x ps.worker_timeout_s = %ss, after which the server drops a silent worker): "
                        "rejoining once as worker %d; if the next gradient is as slow, this PC is too slow for it",
                        self.slowest_gradient_s,
                        self.cfg.ps.worker_timeout_s,
                        self.rank,
                    )
                else:
                    # A silent server is a network that dropped (Wi-Fi) more often than a server that
                    # died (that closes the connection): come back as the same worker when it answers.
                    log.warning(
                        "no answer from the parameter server for ps.worker_timeout_s (%ss): the network may have dropped; "
                        "rejoining as worker %d when %s:%d answers again (up to ps.join_timeout_s, %ss)",
                        self.cfg.ps.worker_timeout_s,
                        self.rank,
                        self.addr,
                        self.port,
                        self.cfg.ps.join_timeout_s,
                    )
                self.dropped_links.append(link)
                try:
                    link, position = self._join(progress, lambda: stop.requested)
                except StoppedWaiting:
                    # Ctrl+C while the server is away: nothing to say goodbye on; the server lets the seat go
                    # after ps.worker_timeout_s, as it did the dropped link's.
                    self.server_gone = True  # its store may not answer: the stats go to the local file
                    log.info("%s while rejoining: left the run after %d gradients", stop.signal_name, self.stats.steps)
                    return 0
                except AuraError as again:
                    raise self._lost(first, str(again)) from None
                except RuntimeError as again:  # the new pair group could not be set up
                    raise self._lost(first, wire.failure(again)) from None
        finally:
            if self.stats.end_time is None:
                self._publish_stats(link, final=True)

    def _join(self, progress: Any, stopping: Callable[[], bool] | None = None) -> tuple[wire.Link, int]:
        """Join (or, after a drop, rejoin as the same rank): the pair link and the shard position. A stop
        asked for while waiting for the server (`stopping()`) is raised as StoppedWaiting."""
        cfg, rejoin = self.cfg, self.rank > 0
        store, own = connect(cfg, self.addr, self.port, progress, stopping)
        request = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "addr": own,
            "rank": self.rank if rejoin else self.wanted_rank,
            "rejoin": rejoin,
            "settings": settings(cfg, cfg.data.path),
        }
        nonce, reply = request_join(store, self.key, request, f"{self.addr}:{self.port}", cfg.ps.join_timeout_s, stopping)
        if not rejoin:
            self.rank, self.shards = int(reply["rank"]), int(reply["workers"])
            self.wire_dtype = wire.WIRE_DTYPES[str(reply["wire_dtype"])]
            self.stats = ProcessStats("worker", self.rank)
        self.store, self.nonce, self.server_gone = store, nonce, False
        prefix = auth.pair_prefix(self.key, nonce)
        link = wire.Link(wire.pair_group(store, prefix, 1, own, cfg.ps.worker_timeout_s), 1, cfg.ps.worker_timeout_s)
        wire.handshake(link, self.key, nonce)
        log.info(
            "%s the parameter server at %s:%d as worker %d of %d (version %d); reading shard %d of the data from sequence %d; "
            "training on %s",
            "rejoined" if rejoin else "joined",
            self.addr,
            self.port,
            self.rank,
            self.shards,
            int(reply["version"]),
            self.rank,
            int(reply["position"]),
            self.device_said,
        )
        return link, int(reply["position"])

    def _pace(self) -> str:
        """Why the server may have dropped this worker, by its own pace: "slow" (a gradient over 0.8 x
        ps.worker_timeout_s: a rejoin would compute as slowly), "first" (only the first gradient was that slow:
        torch.compile's and the device's set-up, which a rejoin does not repeat; answered once with a rejoin,
        as the next gradient tells), or "" (not the pace: the network, or the server)."""
        limit = 0.8 * self.cfg.ps.worker_timeout_s
        if self.slowest_later_s > limit:
            return "slow"
        if self.gradients_timed == 1 and self.slowest_gradient_s > limit and not self.first_excused:
            self.first_excused = True
            return "first"
        return ""  # after the rejoin, a drop before the next gradient was timed is not that gradient's

    def _too_slow(self) -> TrainingFailed:
        self.server_gone = True
        timeout, took = self.cfg.ps.worker_timeout_s, self.slowest_later_s or self.slowest_gradient_s
        return TrainingFailed(
            f"a gradient took {took:.0f} s on this PC, and the parameter server drops a worker silent for "
            f"ps.worker_timeout_s ({timeout} s) (fix: re-run the server and every worker with --set "
            f"ps.worker_timeout_s={max(2 * timeout, int(3 * took))}, or a smaller train.batch_size or ps.push_every)"
        )

    def _lost(self, first: str, rejoin_error: str = "") -> TrainingFailed:
        self.server_gone = True
        lost = f"lost the parameter server at {self.addr}:{self.port} after {self.stats.steps} gradient(s) ({first})"
        if rejoin_error:  # its own message names the fix
            return TrainingFailed(f"{lost}, and could not rejoin: {rejoin_error}")
        return TrainingFailed(
            f"{lost} (fix: re-run this worker command once the server runs again; the server resumes from its last checkpoint)"
        )

    def _train(self, link: wire.Link, position: int, stop: StopRequest) -> int:
        weights = torch.empty(self.model_copy.numel, dtype=self.wire_dtype)
        header, got = link.recv({wire.WEIGHTS: weights})
        if got is None:
            raise wire.LinkLost(f"the server's first message was not weights (kind {header[0]:g})")
        self.model_copy.load_flat_weights(weights)
        version = int(header[1])
        t = self.cfg.train
        lr = float(header[2])
        per_gradient = t.batch_size * t.grad_accum * self.cfg.ps.push_every
        window_start, window_tokens = time.perf_counter(), 0
        while True:
            if stop.requested:
                self._publish_stats(link, final=True)
                link.send([wire.BYE, version])
                log.info("%s: left the run after %d gradients; the server goes on with the others", stop.signal_name, self.stats.steps)
                return 0
            started = time.perf_counter()
            loss, flat = self._gradient(position, lr)
            position += per_gradient
            tokens = per_gradient * self.cfg.data.seq_len
            faults.slow_down(self.rank)
            sent = time.perf_counter()
            self._timed_gradient(sent - started)
            link.send([wire.GRAD, version, wire.loss_on_wire(loss), position, tokens], flat)
            header, got = link.recv({wire.WEIGHTS: weights})
            if header[0] == wire.STOP:
                link.timed_round_trip(sent)
                self.stats.steps += 1
                self.stats.tokens += tokens
                self._publish_stats(link, final=True)
                how = {1: "ended training", 2: "stopped on an error (see its terminal)"}.get(
                    int(header[2]), "is stopping (Ctrl+C there; it saved a checkpoint)"
                )
                log.info("the server %s at version %d; this worker sent %d gradients", how, int(header[1]), self.stats.steps)
                return EXIT_TRAIN_FAILED if int(header[2]) == 2 else 0  # a script over the workers tells a failed run apart
            if got is None:
                raise wire.LinkLost(f"an unexpected message kind {header[0]:g} from the server")
            link.timed_round_trip(sent)
            self.model_copy.load_flat_weights(weights)
            stale_by = int(header[1]) - version - 1
            version, lr = int(header[1]), float(header[2])
            self.stats.steps += 1
            self.stats.tokens += tokens
            window_tokens += tokens
            if t.log_every and self.stats.steps % t.log_every == 0:
                now = time.perf_counter()
                log.info(
                    "gradient %d: loss %.4f on version %d (%d other updates meanwhile) | %.0f tokens/s | round trip %.1f ms",
                    self.stats.steps,
                    loss,
                    version,
                    stale_by,
                    window_tokens / max(now - window_start, 1e-9),
                    link.mean_round_trip_ms,
                )
                window_start, window_tokens = now, 0
            if self.stats.steps % STATS_EVERY == 0:
                self._publish_stats(link)

    def _timed_gradient(self, took: float) -> None:
        if took > 0.5 * self.cfg.ps.worker_timeout_s and took > self.slowest_gradient_s:
            log.warning(
                "a gradient took %.0f s here, over half of ps.worker_timeout_s (%s s), after which the server drops a silent "
                "worker (fix: --set ps.worker_timeout_s=%d on the server and every worker)",
                took,
                self.cfg.ps.worker_timeout_s,
                max(2 * self.cfg.ps.worker_timeout_s, int(3 * took)),
            )
        self.slowest_gradient_s = max(self.slowest_gradient_s, took)
        self.gradients_timed += 1
        if self.gradients_timed > 1:
            self.slowest_later_s = max(self.slowest_later_s, took)

    def _gradient(self, position: int, lr: float) -> tuple[float, torch.Tensor]:
        """(loss, the flat gradient to push) of ps.push_every local steps from `position`. With
        push_every K > 1, the worker takes K-1 plain SGD steps at the server's learning rate between
        its K gradients and pushes their mean: K batches of learning for one message (K = 1 is one
        gradient on the server's weights, as before)."""
        r, t, k = self.model_copy, self.cfg.train, self.cfg.ps.push_every
        total, pushed = 0.0, None
        for local in range(k):
            r.model.zero_grad(set_to_none=True)
            for micro in range(t.grad_accum):
                start = position + (local * t.grad_accum + micro) * t.batch_size
                batch = r.shard_batch(self.rank - 1, self.shards, start, t.batch_size)
                loss = micro_step_loss(r.loss_model, batch, r.rt, t.grad_accum)
                loss.backward()
                total += float(loss.detach())
            grads = r.flat_grads(torch.float32)
            pushed = grads if pushed is None else pushed.add_(grads)
            if local < k - 1:
                with torch.no_grad():
                    for p in r.params:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-lr)
        assert pushed is not None
        return total / k, pushed.div_(k).to(self.wire_dtype)

    def _publish_stats(self, link: wire.Link, final: bool = False) -> None:
        s = self.stats
        s.bytes_sent, s.bytes_received = link.bytes_sent, link.bytes_received
        s.round_trips, s.mean_round_trip_ms = link.round_trips, link.mean_round_trip_ms
        s.extra = {"server": f"{self.addr}:{self.port}", "wire_dtype": str(self.wire_dtype).removeprefix("torch.")}
        if final:
            s.end_time = time.time()
        text = s.to_json()
        write_stats(self.cfg.run_dir, text, s.file_name)
        if self.server_gone:
            return
        with contextlib.suppress(RuntimeError, OSError):  # the server is gone: the local file is all there is
            publish(self.store, self.key, self.nonce, text, final)
