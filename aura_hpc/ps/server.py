"""`python -m aura_hpc ps`: the parameter server (rank 0) of asynchronous training over a LAN.

It holds the weights and the optimizer. Each worker has its own thread here and its own pair
group (ps/wire.py): the thread receives that worker's gradient, applies it at once under one lock
(scaled by its staleness, or dropped when too old), and sends the new weights back. Nobody waits
for the slowest PC. Workers may join at any time and leave at any time; the run goes on with
whoever is connected, and re-running the server command resumes from `checkpoints/last`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.errors import EXIT_RESUMABLE, AuraError, one_line
from aura_hpc.ps import ledger, wire
from aura_hpc.ps.auth import pair_prefix
from aura_hpc.ps.join import JoinQueue, Request, decide, settings
from aura_hpc.ps.model_copy import ModelCopy, build_model_copy, check_shard_size
from aura_hpc.ps.off_lock import OffLock, Shadow
from aura_hpc.ps.pairing import Pairing
from aura_hpc.ps.stats import ProcessStats, copy_worker_stats
from aura_hpc.ps.sweep import StoreSweeper
from aura_hpc.ps.versions import VersionWork
from aura_hpc.train.loop.evaluation import sample
from aura_hpc.train.loop.metrics import MetricsWriter
from aura_hpc.train.parts.schedule import make_optimizer, make_scheduler
from aura_hpc.train.process.stop import StopRequest
from aura_hpc.train.process.worker_log import to_file_only

log = logging.getLogger("aura_hpc")

# How long a stopping server waits for each connected worker to come for its STOP.
STOP_GRACE_S = 30.0


@dataclass
class Seat:
    """A connected worker."""

    rank: int
    host: str
    addr: str
    pid: int
    nonce: str
    rejoined: bool = False  # came back after a network drop (same rank, same process)
    joined: float = field(default_factory=time.monotonic)
    updates: int = 0
    tokens: int = 0
    dropped: int = 0  # gradients too stale to apply: their batches' place in the shard is passed all the same
    link: wire.Link | None = None
    replaced: bool = False  # by the same worker rejoining after a network drop
    pending: bool = False  # a rejoin whose connection has not proved the secret yet: the old seat holds the rank

    def describe(self) -> str:
        return f"{self.host} ({self.addr}, pid {self.pid}, joined {time.monotonic() - self.joined:.0f}s ago)"


def returning_seat(seats: dict[int, Seat], req: Request) -> Seat | None:
    """The seat of the same worker process, back after a network drop before its old connection timed
    out here. It stays until the new connection has proved the run's secret (`take_seat`)."""
    old = seats.get(req.rank)
    if req.rejoin and old is not None and (old.host, old.pid) == (req.host, req.pid):
        return old
    return None


def take_seat(seats: dict[int, Seat], seat: Seat) -> None:
    """A proven connection takes its rank; a returning worker's old seat goes (its thread ends quietly
    when the old connection fails)."""
    old = seats.get(seat.rank)
    if old is not None and old is not seat and (old.host, old.pid) != (seat.host, seat.pid):
        # The old connection timed out while this one was being proven, and another worker took the rank.
        raise wire.LinkLost(f"its rank {seat.rank} went to {one_line(old.host)} meanwhile")
    if old is not None and old is not seat:
        old.replaced = True
        log.warning("worker %d (%s) reconnected before its old connection timed out; dropping the old one", old.rank, old.host)
    seats[seat.rank] = seat


class ParameterServer(VersionWork):
    def __init__(self, cfg: RunConfig, key: bytes) -> None:
        self.cfg, self.t, self.p = cfg, cfg.train, cfg.ps
        self.key = key  # the HMAC key of the run's secret (ps/auth.py)
        self.model_copy: ModelCopy = build_model_copy(cfg, torch.device("cpu"))
        check_shard_size(self.model_copy.data, self.p.workers, self.t.batch_size * self.t.grad_accum * self.p.push_every)
        self.settings = settings(cfg, cfg.data.path)
        self.wire_dtype = wire.WIRE_DTYPES[self.p.wire_dtype]
        self.optimizer = make_optimizer(self.model_copy.model, self.t)
        self.scheduler = make_scheduler(self.optimizer, self.t, self.t.max_steps)
        self.trained_lr = float(self.optimizer.param_groups[0]["lr"])  # the last update's, as `local` logs it (not the next's)
        self.lock = threading.Lock()
        self.version, self.tokens = 0, 0
        self.positions: dict[int, int] = {}
        self.best_eval: float | None = None
        self.hist: Counter[str] = Counter()
        self.seats: dict[int, Seat] = {}
        self.threads: list[threading.Thread] = []
        self.stopping = False  # no more updates: training is over, or Ctrl+C
        self.finished = threading.Event()
        self.interval = ledger.Interval()
        self.interval_start = time.perf_counter()
        self.saved_version, self.saved_at = -1, time.monotonic()
        self.stats = ProcessStats("ps", 0)
        self.left: list[dict[str, Any]] = []
        self.closed = wire.Traffic()  # the links gone
        self.fatal: AuraError | None = None  # what stopped the server from inside a worker's thread (a full disk)
        self.pending_eval: tuple[int, float] | None = None  # an off-lock evaluation for the next metrics row
        self.final_row: dict[str, Any] | None = None  # the last version's figures, written with its evaluation

    # ---- start -----------------------------------------------------------------------------
    def resume(self) -> None:
        r = ledger.resume(self.cfg, self.model_copy, self.optimizer, self.scheduler)
        if r is None:
            return
        self.version, self.tokens, self.positions, self.best_eval = r.version, r.tokens, r.positions, r.best_eval
        self.hist.update(r.staleness)
        self.saved_version = r.version
        best = f"{r.best_eval:.4f}" if isinstance(r.best_eval, float) else "none yet"
        log.info("resumed from %s: version %d, %d tokens applied, best eval loss %s", r.path.name, r.version, r.tokens, best)

    def serve(self, port: int) -> int:
        """Accept workers until training is over or a stop signal; returns the exit status.
        Whatever ends it, the updates applied since the last checkpoint are saved first."""
        self.port = port
        self.store = wire.host_store(port, self.p.join_timeout_s)
        self.joins = JoinQueue(wire.quick_client(self.store, port), self.key)
        self.stats_store = wire.quick_client(self.store, port)  # read by the links' threads as workers leave
        self.joins.publish_epoch()
        self.pairing = Pairing(self.store, port, self.key, self.p.worker_timeout_s)
        self.sweeper = StoreSweeper(self.store, self.p.worker_timeout_s + 30)
        self.metrics = MetricsWriter(self.cfg.run_dir, self.version)
        self.shadow, self.off_lock = Shadow(self.model_copy), OffLock(self._evaluate_and_save)  # before any worker joins
        try:
            return self._serve()
        except BaseException:
            self._save_on_the_way_out()
            raise

    def _save_on_the_way_out(self) -> None:
        with self.lock:  # first: no update after it submits a save that would write beside this one
            self.stopping = True
        self.shadow.cancel.set()
        self.off_lock.drain(drop_waiting=True)
        with self.lock:
            if self.version != self.saved_version and self.fatal is None:
                try:
                    self._save(None)
                except Exception as exc:  # the original error is what the user sees; this is a note
                    log.error("could not save a checkpoint while stopping on an error: %s", str(exc)[:200])

    def _serve(self) -> int:
        stop = StopRequest()
        stop.install()
        if self.version >= self.t.max_steps:
            log.info("nothing to do: the run is already at version %d of %d", self.version, self.t.max_steps)
            self.stopping = True
        last_note = time.monotonic()
        while not self.stopping:
            requests = self.joins.poll()
            for req in requests:
                self._admit(req)
            if requests:
                continue
            if stop.requested:
                log.info("%s received: saving a checkpoint and telling the workers to stop", stop.signal_name)
                with self.lock:
                    self.stopping = True
                break
            if not self.seats and time.monotonic() - last_note > 30:
                log.info("no worker connected; waiting for workers (Ctrl+C saves and stops)")
                last_note = time.monotonic()
            self.sweeper.sweep({seat.nonce for seat in list(self.seats.values())})  # threads change seats
            time.sleep(0.05)
        if self.fatal is not None:
            self.shadow.cancel.set()
            self.off_lock.drain(drop_waiting=True)
            join_threads(self.threads, self.pairing.setting_up)
            self.metrics.close()
            raise self.fatal
        return self._finish(interrupted=stop.requested and self.version < self.t.max_steps)

    # ---- joining ---------------------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        with self.lock:
            returning = returning_seat(self.seats, req)
            taken = {rank: seat.describe() for rank, seat in self.seats.items() if seat is not returning}
        reply = decide(req, self.settings, self.p.workers, taken, self.stopping)
        if not reply["ok"]:
            log.warning("refused a worker from %s: %s", one_line(req.host), reply["error"])
            self.joins.reply(req.nonce, reply)
            return
        # Both ends derive the pair's store prefix from the secret: it is never written in the store.
        prefix = pair_prefix(self.key, req.nonce)
        reply.update(workers=self.p.workers, wire_dtype=self.p.wire_dtype, version=self.version)
        if req.probe:
            self.joins.reply(req.nonce, reply)
            self._start_thread(self.pairing.echo, prefix, req.addr, req.nonce)
            return
        rank = int(reply["rank"])
        seat = Seat(rank, req.host, req.addr, req.pid, req.nonce, req.rejoin, pending=returning is not None)
        reply["position"] = self.positions.get(rank, 0)
        with self.lock:
            if not self.seats:  # throughput counts from when someone trains, not from an idle wait
                self.interval_start = time.perf_counter()
            if returning is None:
                self.seats[rank] = seat  # held for this join while its pair is made
        self.joins.reply(req.nonce, reply)
        self._start_thread(self._serve_worker, seat, prefix)

    def _start_thread(self, target: Any, *args: Any) -> None:
        th = threading.Thread(target=target, args=args, daemon=True)
        th.start()
        self.threads.append(th)

    # ---- one worker ------------------------------------------------------------------------
    def _serve_worker(self, seat: Seat, prefix: str) -> None:
        reason = "left"
        try:
            try:
                link = seat.link = self.pairing.link(prefix, seat.addr, seat.nonce)
            except wire.LinkLost:
                raise
            except RuntimeError as exc:  # the peer never completed its pair group (DistStoreError, a gloo timeout)
                raise wire.LinkLost(f"its data connection was never set up: {wire.failure(exc)}") from None
            with self.lock:
                take_seat(self.seats, seat)
                seat.pending = False
            how = "rejoined" if seat.rejoined else "joined"
            log.info("worker %d %s from %s (%s); %d connected", seat.rank, how, one_line(seat.host), seat.addr, len(self.seats))
            self._send_weights(link)
            grads = torch.empty(self.model_copy.numel, dtype=self.wire_dtype)
            while True:
                header, _ = link.recv({wire.GRAD: grads})
                if header[0] == wire.BYE:
                    reason = "left (stopped by its user)"
                    break
                if header[0] != wire.GRAD:
                    raise wire.LinkLost(f"an unexpected message kind {header[0]:g}")
                started = time.perf_counter()
                try:
                    stop = self._apply(seat, header, grads)
                except AuraError as exc:  # e.g. a checkpoint that cannot be written: the server stops
                    self.fatal, self.stopping, stop = exc, True, True
                if stop:
                    link.send([wire.STOP, self.version, stop_code(self.version, self.t.max_steps, self.fatal)])
                    reason = "stopped by the server"
                    break
                self._send_weights(link)
                link.timed_round_trip(started)
        except wire.LinkLost as exc:
            first = str(exc)
            reason = "timed out (no message for ps.worker_timeout_s)" if wire.timed_out(first) else f"lost ({first})"
        except Exception as exc:  # a bug or a bad message must end this worker's seat, not the server
            reason = f"dropped after an error in its thread ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
            to_file_only(f"worker {seat.rank}'s thread failed")
        finally:
            self._leave(seat, reason)

    def _send_weights(self, link: wire.Link) -> None:
        with self.lock:
            flat = self.model_copy.flat_weights(self.wire_dtype)
            version, lr = self.version, self.optimizer.param_groups[0]["lr"]
        link.send([wire.WEIGHTS, version, lr], flat)

    def _leave(self, seat: Seat, reason: str) -> None:
        with self.lock:  # the totals only: dropping the pair waits on REGISTRY_LOCK, which a pair being made holds 15 s
            if not seat.pending and self.seats.get(seat.rank) is seat:
                del self.seats[seat.rank]
            left = len(self.seats)
            if seat.link is not None:  # a rejoin's pair that lost its rank meanwhile is kept (it may hold a transfer)
                self.closed.add(seat.link, release=not seat.pending and reason.startswith(("left", "stopped by")), drop=False)
        if seat.link is not None:
            wire.drop_group(seat.link)
        if seat.pending:  # a rejoin that never proved itself (or lost its rank): the worker's seat was never given up
            log.warning("a reconnection of worker %d from %s did not complete (%s); its seat is kept", seat.rank, seat.addr, reason)
            return
        if seat.replaced:
            log.info("the old connection of worker %d closed (%s)", seat.rank, reason)
            return
        self._copy_worker_stats(seat, final_within_s=3.0 if reason == "stopped by the server" else 0.0)
        self.left.append({"rank": seat.rank, "host": seat.host, "reason": reason, "version": self.version})
        if reason != "stopped by the server":
            log.warning("worker %d (%s) %s at version %d; %d still connected", seat.rank, one_line(seat.host), reason, self.version, left)

    def _copy_worker_stats(self, seat: Seat, final_within_s: float = 0.0) -> None:
        started = time.time() - (time.monotonic() - seat.joined)
        problem = copy_worker_stats(self.stats_store, self.key, seat.nonce, seat.host, seat.rank, started, self.cfg.run_dir, final_within_s)
        if problem:
            log.warning("could not copy the stats of worker %d: %s", seat.rank, problem)

    # ---- updates ---------------------------------------------------------------------------
    def _apply(self, seat: Seat, header: list[float], grads: torch.Tensor) -> bool:
        """Apply one gradient; True when the worker must stop (training over, or the server stopping)."""
        based_on, loss, position, tokens = wire.grad_header(header, self.version)
        with self.lock:
            if self.stopping:
                return True
            self.positions[seat.rank] = position
            staleness = self.version - based_on
            if not torch.isfinite(grads).all() or not math.isfinite(loss):
                log.warning("worker %d sent a non-finite gradient (loss %s): dropped", seat.rank, loss)
                self.hist["nonfinite"] += 1
                return False
            if staleness > self.p.max_staleness:
                _dropped_as_stale(seat, self.hist, self.interval, self.p.max_staleness)
                return False
            weight = 1.0 / (1 + staleness) if self.p.staleness_weight == "inverse" else 1.0
            self.trained_lr = self.model_copy.apply(grads, weight, self.optimizer, self.scheduler, self.t.grad_clip)
            self.version += 1
            self.tokens += tokens
            seat.updates += 1
            seat.tokens += tokens
            self.interval.count(self.hist, seat.rank, staleness, loss, tokens)
            try:
                self._after_update()
            finally:  # an error in the last version's evaluation or save still ends the run (workers pushed on past it)
                if self.version >= self.t.max_steps:
                    self.stopping = True
                    self.finished.set()
            return self.stopping

    # ---- the end ---------------------------------------------------------------------------

    def _finish(self, interrupted: bool) -> int:
        with self.lock:
            self.stopping = True
        # An evaluation in progress is cut short (a stop waited for all of it: minutes for a large model on a CPU); a
        # checkpoint in progress is finished, one waiting is written anew below.
        self.shadow.cancel.set()
        self.off_lock.drain(drop_waiting=True)
        self.off_lock.close()
        if self.fatal is not None:  # the last checkpoint off the lock failed
            raise self.fatal
        # The workers get their stop first: the last evaluation (minutes on a CPU server) must not outlast their timeout.
        join_threads(self.threads, self.pairing.setting_up)
        with self.lock:  # the sample too: a worker's pair may still be being set up (wire.py, REGISTRY_LOCK)
            if self.version != self.saved_version:
                loss = None if interrupted else self._evaluate()
                if not interrupted:
                    self._log_row(loss, self.final_row if self.final_row and self.final_row["version"] == self.version else None)
                self._save(loss)
            text = sample(self._parts(), self.t, self.version, self.model_copy.rt) if not interrupted else ""
        for seat in list(self.seats.values()):
            self._copy_worker_stats(seat)
        self.stats.end_time = time.time()
        self._write_own_stats()
        self.metrics.close()
        ledger.summary(self.cfg.run_dir, self.version, self.t.max_steps, self.tokens, self.best_eval, self.hist, text)
        if interrupted:
            said = "stopped at version %d of %d; checkpoint saved (checkpoints/last). Re-run the same command to resume."
            log.info(said, self.version, self.t.max_steps)
            return EXIT_RESUMABLE
        best = f"{self.best_eval:.4f}" if isinstance(self.best_eval, float) else "none (no evaluation ran)"
        log.info("training finished at version %d; best eval loss %s", self.version, best)
        return 0


def _dropped_as_stale(seat: Seat, hist: dict[str, int], interval: Any, max_staleness: int) -> None:
    hist["dropped"] += 1
    interval.dropped += 1
    seat.dropped += 1
    if seat.dropped == 20 and seat.dropped > seat.updates:  # said once: its data was skipped unsaid before
        log.warning(
            "worker %d's gradients arrive too stale to apply (%d of %d dropped, staleness above %d): its shard's batches are "
            "passed without training (fix: --set ps.max_staleness=%d on the server and every worker, or fewer workers)",
            seat.rank, seat.dropped, seat.dropped + seat.updates, max_staleness, 2 * max_staleness + 2,
        )  # fmt: skip


def stop_code(version: int, max_steps: int, fatal: object) -> float:
    """What a STOP tells the worker: 1 training is over, 2 the server failed, 0 it was stopped (Ctrl+C)."""
    return 1.0 if version >= max_steps else 2.0 if fatal is not None else 0.0


def join_threads(threads: list[threading.Thread], setting_up: set[threading.Thread]) -> None:
    """Each connected worker gets its STOP at its next message; wait for them a while (not for threads
    still making a pair with a peer that may never come)."""
    deadline = time.monotonic() + STOP_GRACE_S
    waited = [th for th in threads if th not in setting_up]
    for th in waited:
        th.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(th.is_alive() for th in waited):
        log.warning("some workers did not come for their stop message within %.0fs; they will see the server go away", STOP_GRACE_S)
