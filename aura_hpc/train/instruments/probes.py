"""CPU proxies for the GPU contract: what a step would make a GPU wait for, and tensors it puts on the
wrong device, counted while the real trainer runs (tests/test_gpu_contract.py; `selftest`).

A step that does not log, evaluate, sample or checkpoint must not read anything back to the host:
on a GPU each `.item()`, `bool(t)`, `.tolist()`, `.cpu()` or `nonzero` waits for every kernel queued
so far, and the GPU idles while Python catches up. Two modes watch a step:
- `SyncCounter` sees Python-level reads of tensor values (a TorchFunctionMode over `Tensor.item`,
  `__bool__`, `tolist`, `cpu`, `numpy`, ...) and the aten operators that read device memory on the
  host or have data-dependent output shapes (a TorchDispatchMode: `_local_scalar_dense`, `nonzero`,
  `equal`, ...), each with the first stack frame outside torch that caused it;
- the placement check flags what becomes a mixed-device error only on a GPU: a tensor made from
  host data (`torch.tensor(x)`, `lift_fresh`) or a factory function called without a device, inside
  a step (on CPU both land on the right device by luck), and any operator whose tensor arguments
  already span two devices.

Enabled in a worker by AURA_PROBE_STEPS (e.g. "3-8", or "all"): the steps in that range that are not
logged, evaluated, sampled or checkpointed are watched, and RUN_DIR/probes/rank<R>.json says what
was seen where. Off, it costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "AURA_PROBE_STEPS"

_aten = torch.ops.aten
# Operators that read a device value on the host, or whose output shape depends on the data.
SYNC_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.nonzero_static.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.masked_select.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
    _aten.repeat_interleave.Tensor,
}
# Python-level reads of tensor values (each one a device sync on a GPU).
SYNC_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
# Tensors from host data (torch.tensor(x) becomes lift_fresh of a host tensor) and factories.
HOST_DATA_OPS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default, _aten.scalar_tensor.default}
# Factory functions: on a GPU, one called without a device makes a host tensor.
FACTORY_FUNCTIONS = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn, torch.randint, torch.eye}
# The one place host data enters a step by design: the batch, pinned and copied without blocking.
HOST_DATA_ENTRY = "aura_hpc/train/loop/batches.py"
_OUR_ROOT = str(Path(__file__).resolve().parents[2])  # the aura_hpc package


def site() -> str:
    """The innermost frame outside torch's own code: who asked for the operation."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if f"{os.sep}torch{os.sep}" in name and not name.startswith(_OUR_ROOT):
            continue
        if name.endswith(("instruments/probes.py", "contextlib.py", f"comm{os.sep}collectives.py", f"{os.sep}warnings.py")):
            continue
        where = name if not name.startswith(_OUR_ROOT) else "aura_hpc" + name[len(_OUR_ROOT) :]
        short = where.split("site-packages" + os.sep, 1)[-1]
        return f"{short}:{frame.lineno}"
    return "?"


class _SyncFunctions(TorchFunctionMode):
    def __init__(self, seen: Counter[str], placement: Counter[str]) -> None:
        super().__init__()
        self.seen, self.placement = seen, placement

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in FACTORY_FUNCTIONS and (kwargs or {}).get("device") is None:
            self.placement[f"{getattr(func, '__name__', func)} without a device at {site()}"] += 1
        if func in SYNC_METHODS:
            is_host = func is torch.Tensor.cpu and args and getattr(args[0], "device", None) is not None and args[0].device.type == "cpu"
            name = getattr(func, "__name__", str(func))
            if not (func in (torch.Tensor.cpu, torch.Tensor.numpy) and is_host):
                self.seen[f"{name} at {site()}"] += 1
        return func(*args, **(kwargs or {}))


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, syncs: Counter[str], placement: Counter[str]) -> None:
        super().__init__()
        self.syncs, self.placement = syncs, placement

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.syncs[f"{func.__name__} at {site()}"] += 1
        if func in HOST_DATA_OPS:
            where = site()
            if not where.startswith(HOST_DATA_ENTRY):
                self.placement[f"tensor from host data ({func.__name__}) at {where}"] += 1
        devices = {a.device for a in _tensors(args, kwargs) if a.dim() > 0 or a.device.type != "cpu"}
        if len(devices) > 1:
            self.placement[f"{func.__name__} on {sorted(map(str, devices))} at {site()}"] += 1
        return func(*args, **kwargs)


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
    return out


class StepProbe:
    """Watches chosen steps; `report()` says what it saw."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip()
        self.syncs: Counter[str] = Counter()
        self.placement: Counter[str] = Counter()
        self.steps: list[int] = []
        self.syncs_counted = True

    @classmethod
    def from_env(cls) -> StepProbe | None:
        spec = os.environ.get(ENV, "")
        return cls(spec) if spec else None

    def wants(self, step: int) -> bool:
        if self.spec == "all":
            return True
        lo, _, hi = self.spec.partition("-")
        return int(lo) <= step <= int(hi or lo)

    def watch(self, step: int, compiled: bool, cuda: bool = False) -> Any:
        """What watches step `step`. On a GPU, CUDA itself: torch.cuda.set_sync_debug_mode("warn")
        reports every synchronising call in the step, counted here by site as on CPU (DeepSpeed's own
        told from ours: "error" would stop ZeRO 1 and 2 at DeepSpeed's per-step read of its overflow
        flag, seen on an H100). On CPU, the modes above; torch.compile does not run under a dispatch
        mode, so a compiled CPU run's steps are only recorded (its blocks compile with fullgraph=True,
        where a read of a device value would be a graph break, and a graph break is an error)."""
        self.steps.append(step)
        if cuda:
            return _CudaSyncCount(self.syncs)
        if compiled:
            self.syncs_counted = False
            return contextlib.nullcontext()
        return _Watch(self)

    def after_first_step(self) -> None:
        """From here on a recompilation is an error, as it would be a stall on a GPU (every block
        would wait for the compiler); the first step compiled what training needs."""
        torch._dynamo.config.error_on_recompile = True

    def report(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        return {
            "steps": self.steps,
            "syncs_counted": self.syncs_counted,
            "syncs": dict(self.syncs),
            "placement": dict(self.placement),
            "compiled_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": {str(k): int(v) for k, v in counters["graph_break"].items()},
            "recompile_limit_hits": {str(k): int(v) for k, v in counters["frames"].items() if "limit" in str(k)},
        }

    def write(self, run_dir: Path, rank: int) -> Path:
        folder = run_dir / "probes"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        path.write_text(json.dumps(self.report(), indent=1, sort_keys=True))
        return path


class _Watch:
    def __init__(self, probe: StepProbe) -> None:
        self.functions = _SyncFunctions(probe.syncs, probe.placement)
        self.dispatch = _DispatchWatch(probe.syncs, probe.placement)

    def __enter__(self) -> None:
        self.functions.__enter__()
        self.dispatch.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.dispatch.__exit__(*sys.exc_info())
        self.functions.__exit__(*sys.exc_info())


CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class _CudaSyncCount:
    """CUDA's sync debug mode "warn" for one step, each warning counted by the site that asked (warnings of
    the autograd engine's threads are replayed on the caller's, at backward)."""

    def __init__(self, syncs: Counter[str]) -> None:
        self.syncs = syncs
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> None:
        self._catch.__enter__()  # the filters and showwarning are restored on exit
        warnings.filterwarnings("always", message=CUDA_SYNC_WARNING)  # each one, not once per site
        shown = warnings.showwarning

        def count(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if CUDA_SYNC_WARNING in str(message):
                self.syncs[site()] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def watching(probe: StepProbe | None, step: int, quiet: bool, compiled: bool, cuda: bool) -> Any:
    """The probe around step `step` when there is one and the step is quiet and in its range."""
    if probe is None or not quiet or not probe.wants(step):
        return contextlib.nullcontext()
    return probe.watch(step, compiled, cuda)


@contextlib.contextmanager
def reporting(
    probe: StepProbe | None, run_dir: Path, rank: int, run_probe: RunProbe | None = None, reseed_allowed: Callable[[], bool] = lambda: False
) -> Any:
    """Around the steps: writes the step probe's report however training ends; the run's probe
    watches for reseeds from here on (`reseed_allowed`: where the runtime keeps this rank's generators)."""
    if run_probe is not None:
        run_probe.arm_reseed_watch(reseed_allowed)
    try:
        yield
    finally:
        if probe is not None:
            probe.write(run_dir, rank)


# Factories that make a host tensor unless given a device, and the ways host data becomes a tensor.
HOST_MAKERS = {*FACTORY_FUNCTIONS, torch.tensor, torch.as_tensor, torch.from_numpy, torch.frombuffer, torch.zeros_like, torch.ones_like}
RUN_ENV = "AURA_PROBE_RUN"


class _HostMade(TorchFunctionMode):
    """Remembers the tensors our code makes on the host (a factory without a device, host data)."""

    def __init__(self, made: dict[int, tuple[weakref.ref[torch.Tensor], str]], ours: tuple[str, ...]) -> None:
        super().__init__()
        self.made, self.ours = made, ours

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in HOST_MAKERS and (kwargs or {}).get("device") is None and isinstance(out, torch.Tensor):
            like = args[0] if func in (torch.zeros_like, torch.ones_like) and args else None
            if like is None or like.device.type == "cpu":
                where = site()
                if any(o in where for o in self.ours):  # ours: torch and DeepSpeed keep their own rules
                    if len(self.made) > 10_000:
                        for key in [k for k, (ref, _) in self.made.items() if ref() is None]:
                            del self.made[key]
                    self.made[id(out)] = (weakref.ref(out), where)
        return out


class RunProbe:
    """Watches the whole run, not only quiet steps (AURA_PROBE_RUN=1): every collective we make
    (start-up, link measurement, evaluation, checkpoints, DiLoCo's meetings) is checked for a tensor
    our code made on the host, which NCCL refuses; library code that reseeds every GPU's generator
    after the first step is caught (each rank must keep its own stream); collectives and the bytes
    each group carried are counted. Written to RUN_DIR/probes/run_rank<R>.json."""

    def __init__(self, track_host_tensors: bool, ours: tuple[str, ...] = ("aura_hpc/",)) -> None:
        from aura_hpc.comm import collectives

        self.collectives = collectives
        self.calls: Counter[str] = Counter()
        self.host_tensors: Counter[str] = Counter()
        self.reseeds: Counter[str] = Counter()
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}  # id -> (the tensor, where it was made)
        self.tracking = track_host_tensors
        self._mode: _HostMade | None = None
        self._seeding: list[tuple[Any, str, Any]] = []
        collectives.observers.append(self._observe)
        if track_host_tensors:  # a function mode for the whole run: not under torch.compile
            self._mode = _HostMade(self.made, ours)
            self._mode.__enter__()

    @classmethod
    def from_env(cls, compiled: bool) -> RunProbe | None:
        return cls(track_host_tensors=not compiled) if os.environ.get(RUN_ENV) == "1" else None

    def _observe(self, op: str, tensors: list[torch.Tensor], group: Any) -> None:
        self.calls[f"{op}@{group.name}"] += 1
        if group.host_only:
            return
        for t in tensors:
            for candidate in (t, t._base):
                entry = self.made.get(id(candidate)) if candidate is not None else None
                if entry is not None and entry[0]() is candidate:
                    self.host_tensors[f"host tensor made at {entry[1]} handed to {op} at {site()}"] += 1
                    break

    def arm_reseed_watch(self, allowed: Callable[[], bool]) -> None:
        """From the first step on, a global reseed is an error unless `allowed()` (process/runtime.py's
        keep_device_rng guards it)."""

        def watched(original: Any) -> Any:
            def manual_seed(seed: int) -> Any:
                if not allowed():
                    self.reseeds[f"torch.manual_seed at {site()}"] += 1
                return original(seed)

            return manual_seed

        for owner, name in ((torch, "manual_seed"), (torch.random, "manual_seed")):
            original = getattr(owner, name)
            self._seeding.append((owner, name, original))
            setattr(owner, name, watched(original))

    def close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for owner, name, original in self._seeding:
            setattr(owner, name, original)
        self._seeding = []
        if self._observe in self.collectives.observers:
            self.collectives.observers.remove(self._observe)

    def write(self, run_dir: Path, rank: int) -> Path:
        self.close()
        folder = run_dir / "probes"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"run_rank{rank}.json"
        report = {
            "host_tensors_tracked": self.tracking,
            "calls": dict(self.calls),
            "bytes": dict(self.collectives.sent),
            "host_tensors": dict(self.host_tensors),
            "reseeds": dict(self.reseeds),
        }
        path.write_text(json.dumps(report, indent=1, sort_keys=True))
        return path


@contextlib.contextmanager
def whole_run(compile_setting: str, device: torch.device, run_dir: Path, rank: int) -> Iterator[RunProbe | None]:
    """The run's probe (AURA_PROBE_RUN), its report written however the run ends. Host tensors are
    tracked by a function mode for the whole run, which a compiled model would run under: not then."""
    probe = RunProbe.from_env(compiled=compile_setting == "true" or (compile_setting == "auto" and device.type == "cuda"))
    try:
        yield probe
    finally:
        if probe is not None:
            probe.write(run_dir, rank)


class HeapSampler:
    """The peak of glibc's in-use heap (mallinfo2: what torch's CPU tensors and Python hold, not
    freed-but-kept pages) over a run, sampled every ~0.5 ms by a thread, above the level at start.
    Enabled with AURA_PROBE_HEAP=1 on Linux; the memory plan's CPU figures are checked against it."""

    def __init__(self) -> None:
        import ctypes
        import threading

        names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

        class Mallinfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in names]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = Mallinfo2
        self.base = self.in_use()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aura-heap-sampler", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> HeapSampler | None:
        return cls() if os.environ.get("AURA_PROBE_HEAP") == "1" and sys.platform.startswith("linux") else None

    def in_use(self) -> int:
        m = self._libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, self.in_use())

    def stop(self) -> int:
        """Bytes above the starting level at the peak."""
        self._stop.set()
        self._thread.join()
        return max(0, self.peak - self.base)


def heap_summary(heap: HeapSampler | None) -> dict[str, float]:
    return {"peak_heap_gib": round(heap.stop() / 2**30, 4)} if heap is not None else {}
