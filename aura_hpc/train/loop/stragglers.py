"""Which rank holds the others up: each rank's time before the gradient exchange, scored per logging interval.

Under DDP the all-reduce evens out every rank's step time: a slow rank's peers wait inside the
exchange, so step times alone cannot say which rank is slow. What differs is the time each rank
spends before it hands its gradients over: its data, its forward (and the backward of earlier
micro-steps), and whatever it does between steps. A rank's score is the median of the other ranks'
times divided by its own (1 is typical; NVRx flags below 0.75; the others' median, not everyone's,
so that one slow rank of two still scores under 0.75 when it takes twice as long). On CPU the host's clock measures it; on a
GPU, CUDA events on the stream, read only at logging steps (which wait for the device anyway). Under
FSDP and ZeRO-3 a rank also waits for its peers inside the forward's all-gathers, which blurs the
scores; DiLoCo's replicas do not wait for each other between meetings, so a slow one shows plainly.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aura_hpc.ops import excluded_nodes

if TYPE_CHECKING:
    import torch

    from aura_hpc.config import RunConfig
    from aura_hpc.train.process.dist_env import DistEnv

log = logging.getLogger("aura_hpc")

THRESHOLD = 0.75
INTERVALS = 3  # a rank below the threshold for this many logging intervals in a row is named


class BusyClock:
    """This rank's time from the end of one gradient exchange to the start of the next, summed."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.busy, self.steps = 0.0, 0
        self._pairs: list[tuple[Any, Any]] = []
        self._since: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch  # here: `status` reads THRESHOLD without importing torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def exchange_begins(self) -> None:
        if self._since is None:
            return
        now = self._mark()
        if self.cuda:
            self._pairs.append((self._since, now))
        else:
            self.busy += now - self._since
        self.steps += 1

    def exchange_done(self) -> None:
        self._since = self._mark()

    def pause(self) -> None:
        """Logging, evaluation, samples and checkpoints between steps are not a step's work: the next step is
        timed from here (it went untimed, and under train.log_every=1 every step did: every score 1.0)."""
        self._since = self._mark()

    def take(self) -> float:
        """Mean seconds per step since the last call (0 when no step was timed); on a GPU, after the host waited."""
        if self.cuda:
            self.busy += sum(a.elapsed_time(b) for a, b in self._pairs) / 1000
            self._pairs.clear()
        mean = self.busy / self.steps if self.steps else 0.0
        self.busy, self.steps = 0.0, 0
        return mean


def scores(busy: list[float]) -> list[float]:
    """Each rank's score: the other ranks' median busy time divided by its own (1.0 when not measured)."""
    out = []
    for r, mine in enumerate(busy):
        others = [b for i, b in enumerate(busy) if i != r and b > 0]
        out.append(round(statistics.median(others) / mine, 3) if others and mine > 0 else 1.0)
    return out


class StragglerWatch:
    """Rank 0's view: the scores of every interval, and a warning naming a rank that stays below THRESHOLD."""

    def __init__(self, hosts: list[str], on_named: Callable[[int, str], None] | None = None) -> None:
        self.hosts = hosts
        self.below = [0] * len(hosts)
        self.on_named = on_named  # health.straggler_action=exclude: the node is kept for the next requeue

    def interval(self, busy: list[float], step: int) -> dict[str, Any]:
        """The metrics row's fields for this interval; warns once a rank has been slow INTERVALS times in a row."""
        s = scores(busy)
        for r, score in enumerate(s):
            self.below[r] = self.below[r] + 1 if score < THRESHOLD else 0
            if self.below[r] == INTERVALS:
                host = self.hosts[r] if r < len(self.hosts) else "?"
                log.warning(
                    "straggler: rank %d on %s has scored below %.2f for %d logging intervals (%.2f at step %d: it takes %.1fx the "
                    "median time before each gradient exchange, and the other ranks wait for it)",
                    r,
                    host,
                    THRESHOLD,
                    INTERVALS,
                    score,
                    step,
                    1 / score if score else float("inf"),
                )
                if self.on_named is not None:
                    self.on_named(r, host)
        slowest = min(range(len(s)), key=lambda r: s[r])
        return {"straggler_scores": s, "slowest_rank": slowest, "slowest_score": s[slowest]}


def straggler_action(cfg: RunConfig, env: DistEnv) -> Callable[[int, str], None] | None:
    """health.straggler_action=exclude: a Slurm job's next requeue leaves the straggler's node out (slurm/exclude.py).
    A `local` launch cannot leave a machine out by itself: it says what to do instead."""
    if cfg.health.straggler_action != "exclude":
        return None
    if env.launcher == "slurm":

        def keep(rank: int, host: str) -> None:
            try:  # rank 0 writes it inside the training loop: a shared disk's error costs a warning, not the run
                excluded_nodes.record(cfg.run_dir, host, f"rank {rank} was a straggler")
            except OSError as exc:
                log.warning("straggler: %s could not be kept for the next requeue (%s); training goes on", host, exc)
                return
            log.warning("straggler: %s is left out at this job's next requeue (health.straggler_action=exclude)", host)

        return keep

    def say(rank: int, host: str) -> None:
        if env.nnodes == 1:
            log.warning(
                "straggler: rank %d shares %s with every other rank, so there is no machine to leave out "
                "(health.straggler_action=exclude acts on Slurm jobs) (fix: look for what else runs there: top, nvidia-smi)",
                rank,
                host,
            )
            return
        log.warning(
            "straggler: a local launch cannot leave %s out by itself (health.straggler_action=exclude acts on Slurm jobs): "
            "stop the run (Ctrl+C), then start it again without that machine (fix: --nnodes one fewer)",
            host,
        )

    return say
