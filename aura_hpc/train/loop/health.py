"""The trainer's side of the resource monitor and GPU circuit breaker (the readings: aura_hpc.ops)."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from aura_hpc.config import RunConfig
from aura_hpc.errors import EXIT_GPU_FAULT, EXIT_TRAIN_FAILED
from aura_hpc.ops.gpu_health import Fault, HealthRules, NoGpus, Thresholds, blames_the_gpu, open_reader, selection_from_env
from aura_hpc.ops.resources import BackgroundMonitor, Sampler
from aura_hpc.train.process.dist_env import DistEnv

log = logging.getLogger("aura_hpc")


def _visible_uuids() -> list[str] | None:
    """UUIDs of the CUDA devices this process sees (CUDA_VISIBLE_DEVICES and Slurm's binding applied)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except (AttributeError, RuntimeError):  # a torch without device UUIDs: fall back to the environment
        return None


def _bound_per_task(local_world: int) -> bool:
    """Whether this process sees fewer GPUs than its node runs ranks (Slurm's --gpus-per-task or
    --gpu-bind): local rank 0 then sees its own GPU only, so every rank watches its own."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() < local_world


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def physical_index(device: Any) -> int:
    """The node's number of a CUDA device, as nvidia-smi and NVML count (CUDA_VISIBLE_DEVICES renumbers from 0)."""
    index = device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(visible[index]) if index < len(visible) and visible[index].isdigit() else index


class HealthWatch:
    """Samples resources and watches the GPUs in a background thread on local rank 0 of each node
    (on every rank where each sees only its own GPU)."""

    def __init__(self, cfg: RunConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.monitor: BackgroundMonitor | None = None
        self.uuids: list[str] | None = None  # this process's CUDA devices', read at start (no CUDA call after an error)

    @property
    def fault(self) -> Fault | None:
        return self.monitor.fault if self.monitor is not None else None

    def fault_seen(self) -> bool:
        return self.fault is not None

    def start(self, on_sample: Callable[[dict[str, Any]], None] | None) -> None:
        h = self.cfg.health
        self.uuids = _visible_uuids()
        bound = self.env.local_rank != 0 and _bound_per_task(self.env.local_world_size)
        if self.env.local_rank != 0 and not bound:
            return
        # Only this job's GPUs: another job's faulty GPU on a shared node is not ours to stop for. Of those a process
        # sees, only the ones the node's ranks train on (rank r on cuda:r % count): on an 8-GPU workstation with no
        # CUDA_VISIBLE_DEVICES, a 2-process run stopped (exit 76, "drain this node") for another user's GPU 5.
        watched = self.uuids[: self.env.local_world_size] if self.uuids and not bound else self.uuids
        reader = open_reader(h.nvml_replay, selection_from_env(os.environ, watched))
        breaker = h.breaker and not isinstance(reader, NoGpus)
        if h.breaker and _cuda() and (not breaker or not reader.read()):
            log.warning(
                "health.breaker: NVML reads none of this job's GPUs (no NVIDIA management library here, no permission "
                "on them, or MIG instances, which it does not read): the GPU circuit breaker and the GPU columns of the "
                "resource monitor are off for this run"
            )
            breaker = False
        elif h.breaker and _cuda() and h.nvml_replay:  # the probe took the replay's first reading: from its start again
            reader = open_reader(h.nvml_replay, selection_from_env(os.environ, watched))
        if h.monitor_interval_s <= 0 and not breaker:
            return
        interval = h.monitor_interval_s if h.monitor_interval_s > 0 else h.breaker_interval_s
        if breaker and h.monitor_interval_s > 0:
            interval = min(interval, h.breaker_interval_s)
        run_dir = self.cfg.run_dir
        name = f"node{self.env.node_rank}" + (f"-local{self.env.local_rank}" if bound else "")  # one writer per file
        out = run_dir / "resources" / f"{name}.jsonl" if h.monitor_interval_s > 0 else None
        rules = None
        if breaker:
            reasons = tuple(r.strip() for r in h.throttle_reasons.split(",") if r.strip())
            rules = HealthRules(Thresholds(h.temp_margin_c, reasons, h.throttle_samples))
        sink = on_sample if h.monitor_interval_s > 0 else None
        rules_every = h.breaker_interval_s if breaker else 0.0
        write_every = h.monitor_interval_s if h.monitor_interval_s > 0 else 0.0
        self.monitor = BackgroundMonitor(Sampler(reader, run_dir), interval, out, rules, sink, rules_every, write_every).start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def report(self, fault: Fault, step: int) -> None:
        """The `gpu.fault` event to health.webhook_url, if one is set (the URL is never logged)."""
        h = self.cfg.health
        from aura_hpc.ops import webhook

        url = webhook.resolve_url(h.webhook_url, h.webhook_url_env, h.webhook_url_file)
        if not url:
            return

        event = {
            "event": "gpu.fault",
            "host": socket.gethostname(),
            "gpu_index": fault.gpu_index,
            "reason": fault.reason,
            "readings": fault.readings,
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "node_rank": self.env.node_rank,
            "run_dir": str(self.cfg.run_dir),
            "step": step,
        }
        webhook.deliver(url, h.webhook_type, event, h.webhook_timeout_s, h.webhook_retries)

    def gpu_error(self, exc: RuntimeError, device: Any, step: int) -> int:
        """A sticky CUDA error in the loop: the GPU state is unusable, so no checkpoint and no collective. The
        node is called faulty unless NVML reads its GPU healthy (then the code is the likelier cause)."""
        index, said = physical_index(device), str(exc).splitlines()[0][:200]
        # By UUID where known: under Slurm's ConstrainDevices, CUDA_VISIBLE_DEVICES counts from 0 while NVML counts
        # the node's GPUs, and a healthy GPU 4's illegal access read GPU 0 (blamed on the node, the wrong GPU named).
        mine = (self.uuids or [])[device.index or 0 :][:1]
        reading = None if blames_the_gpu(exc, None) else self._reading(index, mine[0] if mine else "")  # the hardware's own words suffice
        if reading is not None and str(reading.get("index", "")).isdigit():
            index = int(reading["index"])
        blame = blames_the_gpu(exc, reading)
        if blame is False:
            log.error(
                "CUDA error in the training loop at step %d: %s; NVML reads GPU %d healthy (no uncorrectable ECC error, no "
                "recovery action asked): most often a kernel that read out of bounds (a token id at or above model.vocab_size, "
                "a custom kernel), not the hardware: rerun with CUDA_LAUNCH_BLOCKING=1 to find it; drain this node only if it "
                "recurs there alone; exiting with status %d",
                step,
                said,
                index,
                EXIT_TRAIN_FAILED,
            )
            return EXIT_TRAIN_FAILED
        either = "" if blame else " (NVML cannot be read here to tell a faulty GPU from a kernel that read out of bounds)"
        fault = Fault(index, f"CUDA error in the training loop: {said}{either}", reading or {})
        self.report(fault, step)
        log.error("%s; exiting with status %d (drain this node)", fault.describe(), EXIT_GPU_FAULT)
        return EXIT_GPU_FAULT

    def _reading(self, index: int, uuid: str = "") -> dict[str, Any] | None:
        """NVML's reading of the node's GPU `uuid` (else `index`) now, or None where it cannot be read (no CUDA
        call: after a sticky error each one may fail)."""
        try:
            readings = open_reader(self.cfg.health.nvml_replay).read()
            if uuid and any(g.get("uuid") for g in readings):
                # Not found (a MIG instance's UUID is no GPU's; a GPU NVML skips): another GPU's reading would
                # clear or blame the wrong hardware, so it cannot tell.
                return next((g for g in readings if selection_from_env({}, [uuid]).keeps(g)), None)
            return next((g for g in readings if int(g.get("index", -1)) == index), None)
        except Exception:  # no NVML, no permission, a driver that no longer answers: it cannot tell
            return None

    def open_circuit(self, ckpt: Any, step: int) -> int:
        """All ranks agreed that a GPU is faulty: checkpoint if it still answers, alert, exit EXIT_GPU_FAULT."""
        fault = self.fault
        if fault is not None:
            log.error("GPU circuit breaker OPEN on %s: %s", socket.gethostname(), fault.describe())
        try:
            path = ckpt.save()
            ckpt.wait()
            saved = f"checkpoint {path.name} written" if path else "checkpoint not written"
        except Exception as exc:  # the GPU may no longer answer: nothing more to save
            saved = f"checkpoint failed ({str(exc).splitlines()[0][:120]})"
        if fault is not None:  # after the save: a slow endpoint's retries would hold it while the GPU degrades
            self.report(fault, step)
        if self.env.is_main:
            log.error(
                "stopped at step %d by the GPU circuit breaker: %s; exiting with status %d so the node can be drained "
                "(Slurm: scontrol update nodename=<node> state=drain reason=gpu-fault); resume elsewhere with the same command",
                step,
                saved,
                EXIT_GPU_FAULT,
            )
        self.stop()
        return EXIT_GPU_FAULT
