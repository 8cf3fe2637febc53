"""GPU readings through NVML (nvidia-ml-py), a replay reader for tests, and the fault rules
of the circuit breaker (uncorrectable ECC, temperature near slowdown/shutdown, hardware
throttling, the driver's recovery action)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aura_hpc.config import THROTTLE_REASONS

# NVML clocks-event (throttle) reason bits, named as in nvml.h.
THROTTLE_BITS = {
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}
# The config accepts these names without importing this module (it sits below ops).
assert set(THROTTLE_BITS) == set(THROTTLE_REASONS), "aura_hpc.config.THROTTLE_REASONS and THROTTLE_BITS disagree"
RECOVERY_ACTIONS = {0: "none", 1: "reset the GPU", 2: "reboot the node", 3: "drain peer connections", 4: "drain and reset"}


class GpuReader(Protocol):
    def read(self) -> list[dict[str, Any]]: ...


class NoGpus:
    def read(self) -> list[dict[str, Any]]:
        return []


@dataclass(frozen=True)
class GpuSelection:
    """The GPUs one job may use on this node, by NVML index and/or UUID (None: every GPU)."""

    indices: frozenset[int] | None = None
    uuids: frozenset[str] | None = None

    def keeps(self, gpu: dict[str, Any]) -> bool:
        uuid = _bare_uuid(str(gpu.get("uuid", "")))
        if self.uuids is not None and uuid:
            # CUDA_VISIBLE_DEVICES takes any unique prefix of a GPU's UUID (GPU-5ab3 for GPU-5ab3c1d9-...).
            return any(uuid.startswith(u) for u in self.uuids)
        if self.indices is not None:
            return int(gpu.get("index", -1)) in self.indices
        return self.uuids is None


def _bare_uuid(text: str) -> str:
    return text.strip().lower().removeprefix("gpu-")


def selection_from_env(env: Mapping[str, str], uuids: list[str] | None = None) -> GpuSelection:
    """The job's GPUs: the UUIDs of the CUDA devices the process sees when known, else
    CUDA_VISIBLE_DEVICES (indices or GPU-UUIDs), else Slurm's SLURM_STEP_GPUS / SLURM_JOB_GPUS."""
    if uuids:
        return GpuSelection(uuids=frozenset(_bare_uuid(u) for u in uuids))
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        raw = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    if raw is None:
        return GpuSelection()
    items = [x.strip() for x in raw.split(",") if x.strip()]
    indices = frozenset(int(x) for x in items if x.isdigit())
    ids = frozenset(_bare_uuid(x) for x in items if x.lower().startswith("gpu-"))
    return GpuSelection(indices=indices if indices or not ids else None, uuids=ids or None)


class Selected:
    """A reader that reports only the selected GPUs."""

    def __init__(self, reader: GpuReader, selection: GpuSelection) -> None:
        self.reader, self.selection = reader, selection

    def read(self) -> list[dict[str, Any]]:
        return [g for g in self.reader.read() if self.selection.keeps(g)]


class NvmlReader:
    """Real readings; fields a GPU or driver does not support are left out, not faked."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        # The count is every GPU of the node; a job given some of them (Slurm's ConstrainDevices) may not open
        # the others (NO_PERMISSION), and a GPU fallen off the bus answers GPU_IS_LOST: each is skipped, the
        # others keeping the node's index. The first one refused ended the reader, and with it the breaker of
        # every healthy GPU of the node, in silence: on the node a lost GPU makes the one to watch.
        self.handles: list[tuple[int, Any]] = []
        self.uuids: dict[int, str] = {}  # kept from the start: a GPU lost later answers nothing, its UUID included
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                self.handles.append((i, pynvml.nvmlDeviceGetHandleByIndex(i)))
            except pynvml.NVMLError:
                continue
            with contextlib.suppress(Exception):
                self.uuids[i] = _text(pynvml.nvmlDeviceGetUUID(self.handles[-1][1]))

    def read(self) -> list[dict[str, Any]]:
        nv = self.nv
        out = []
        for i, h in self.handles:
            # The UUID read at the start first: a row without one is dropped by a job's selection by UUID, so a GPU
            # whose calls fail would vanish from the watch instead of being judged.
            g: dict[str, Any] = {"index": i, "uuid": self.uuids.get(i, "")}
            calls = {
                "name": lambda h=h: _text(nv.nvmlDeviceGetName(h)),
                "uuid": lambda h=h: _text(nv.nvmlDeviceGetUUID(h)),
                "util_pct": lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
                "mem_used_mb": lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20,
                "mem_total_mb": lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).total / 2**20,
                "temp_c": lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                "temp_slowdown_c": lambda h=h: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                "temp_shutdown_c": lambda h=h: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                "power_w": lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000,
                "power_limit_w": lambda h=h: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                "sm_clock_mhz": lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "mem_clock_mhz": lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                "throttle_reasons": lambda h=h: _throttle_reasons(nv, h),
                "ecc_uncorrected_volatile": lambda h=h: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                ),
                # The field's number where pynvml is older than the driver (the floor's 12.535 names no such field).
                "recovery_action": lambda h=h: _field(nv, h, getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230)),
            }
            read, unknown = 0, False
            for key, call in calls.items():
                try:
                    value = call()
                except Exception as exc:  # not supported on this GPU/driver: leave the field out
                    if getattr(exc, "value", None) in _LOST:  # fallen off the bus (Xid 79), or waiting for a reset
                        g = {"index": i, "uuid": self.uuids.get(i, ""), "lost": True}
                        break
                    unknown = unknown or getattr(exc, "value", None) == _UNKNOWN
                    continue
                if value is not None:
                    read += key not in ("name", "uuid")  # (a driver answers those two from what it kept of a GPU gone)
                    g[key] = round(value, 1) if isinstance(value, float) else value
            else:
                if not read and unknown:  # every call answered "Unknown Error": a GPU in that state answers nothing else
                    g["lost"] = True
            out.append(g)
        return out


# NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED: the GPU answers nothing until it is reset. Its row kept only
# its index, without a UUID the job's selection dropped it, and no rule saw a fault: the GPU vanished from the watch.
_LOST = (15, 16)
_UNKNOWN = 999  # NVML_ERROR_UNKNOWN
_FUNCTION_NOT_FOUND = 13  # a driver older than the pynvml that names the call


def _throttle_reasons(nv: Any, handle: Any) -> int:
    """The "event reasons" call first (pynvml marks the "throttle" one for removal in CUDA 14); a driver before R535
    lacks it, where pynvml still names it: the older call then (else throttling was never seen)."""
    newer = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if newer is not None:
        try:
            return int(newer(handle))
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != _FUNCTION_NOT_FOUND:
                raise
    return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _field(nv: Any, handle: Any, field_id: int) -> int | None:
    values = nv.nvmlDeviceGetFieldValues(handle, [field_id])
    v = values[0]
    if getattr(v, "nvmlReturn", 0) != 0:
        return None
    return int(v.value.uiVal)


class ReplayReader:
    """Replays recorded readings (JSON lines, one list of GPUs per line); the last one repeats.

    How the breaker is tested without a GPU, and how a recorded incident can be replayed.
    """

    def __init__(self, path: str | Path) -> None:
        self.samples = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        self._it: Iterator[list[dict[str, Any]]] = iter(self.samples)
        self._last: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        self._last = next(self._it, self._last)
        return self._last


def open_reader(replay: str = "", only: GpuSelection | None = None) -> GpuReader:
    """NVML's readings (or recorded ones), restricted to `only` when given."""
    reader: GpuReader
    if replay:
        reader = ReplayReader(replay)
    else:
        try:
            reader = NvmlReader()
        except Exception:  # no NVIDIA driver/library: no GPU columns, no breaker
            return NoGpus()
    return Selected(reader, only) if only is not None else reader


@dataclass
class Thresholds:
    temp_margin_c: float = 3.0  # trip this close to the slowdown threshold (or shutdown if no slowdown)
    throttle_reasons: tuple[str, ...] = ("hw_slowdown", "hw_thermal", "hw_power_brake")
    throttle_samples: int = 3  # consecutive samples throttled before tripping (a blip is not a fault)


@dataclass
class Fault:
    gpu_index: int
    reason: str
    readings: dict[str, Any]

    def describe(self) -> str:
        return f"GPU {self.gpu_index}: {self.reason}"


class HealthRules:
    """Turns successive readings into at most one fault per call."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self.ecc_seen: dict[int, int] = {}
        self.throttled: dict[int, int] = {}
        self.hot: dict[int, int] = {}

    def evaluate(self, gpus: list[dict[str, Any]]) -> Fault | None:
        for g in gpus:
            i = int(g.get("index", 0))
            if g.get("lost"):
                return Fault(i, "the GPU answers nothing (NVML: lost, fallen off the bus, or waiting for a reset)", g)
            ecc = g.get("ecc_uncorrected_volatile")
            if ecc is not None:
                # The volatile counter restarts at a GPU reset: any count is an uncorrectable error since the last one,
                # and NVIDIA's answer to it is a reset (its memory rows are remapped then). A count already there when
                # the job started was taken as the baseline, and a damaged GPU was trained on.
                seen = self.ecc_seen.get(i)
                self.ecc_seen[i] = int(ecc)
                if int(ecc) > (seen or 0):
                    what = (
                        f"{int(ecc) - seen} new uncorrectable ECC error(s)"
                        if seen is not None
                        else (f"{ecc} uncorrectable ECC error(s) since the GPU was last reset")
                    )
                    return Fault(i, f"{what} (volatile counter {ecc})", g)
            action = g.get("recovery_action")
            if action:
                return Fault(i, f"the driver asks to {RECOVERY_ACTIONS.get(int(action), f'recover (action {action})')}", g)
            slowdown = g.get("temp_slowdown_c")
            temp, limit = g.get("temp_c"), slowdown or g.get("temp_shutdown_c")
            if temp is not None and limit and float(temp) >= float(limit) - self.t.temp_margin_c:
                # As throttling: a sensor's one spike is not a node to drain (exit 76).
                self.hot[i] = self.hot.get(i, 0) + 1
                if self.hot[i] >= self.t.throttle_samples:
                    which = "slowdown" if slowdown else "shutdown"
                    return Fault(
                        i,
                        f"temperature {temp} C within {self.t.temp_margin_c:g} C of the {limit} C {which} threshold "
                        f"for {self.hot[i]} samples in a row",
                        g,
                    )
            else:
                self.hot[i] = 0
            reasons = int(g.get("throttle_reasons") or 0)
            active = [name for name in self.t.throttle_reasons if reasons & THROTTLE_BITS.get(name, 0)]
            if active:
                self.throttled[i] = self.throttled.get(i, 0) + 1
                if self.throttled[i] >= self.t.throttle_samples:
                    return Fault(i, f"clocks throttled ({', '.join(active)}) for {self.throttled[i]} samples in a row", g)
            else:
                self.throttled[i] = 0
        return None


# Sticky CUDA errors: the process's GPU context is gone (no checkpoint, no collective can follow).
CUDA_FAULT_MARKERS = (
    "uncorrectable ecc",
    "an illegal memory access",
    "unspecified launch failure",
    "xid",
    "cuda error: unknown error",
    "gpu has fallen off the bus",
    "cudaerrorlaunchfailure",
)
# Of those, the ones only the hardware raises. An illegal access or a launch failure (NVIDIA's Xid 13, 31, 43)
# is most often a kernel reading out of bounds: the GPU itself is asked before the node is called faulty.
HARDWARE_MARKERS = ("uncorrectable ecc", "xid", "cuda error: unknown error", "gpu has fallen off the bus")


def is_gpu_error(exc: BaseException) -> bool:
    """A CUDA/driver error raised in the training loop after which this process's GPU is unusable."""
    text = str(exc).lower()
    return "cuda" in text and any(m in text for m in CUDA_FAULT_MARKERS)


def blames_the_gpu(exc: BaseException, reading: dict[str, Any] | None) -> bool | None:
    """Whether a sticky CUDA error is the GPU's: True, False (NVML reads it healthy: most likely the code), or
    None (NVML cannot be read here: either)."""
    text = str(exc).lower()
    if any(m in text for m in HARDWARE_MARKERS):
        return True
    if reading is None:
        return None
    return bool(reading.get("lost")) or int(reading.get("ecc_uncorrected_volatile") or 0) > 0 or bool(reading.get("recovery_action"))
