"""What a worker process runs on: threads, device, allocator, precision, and the process group."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig
from aura_hpc.errors import ConfigError
from aura_hpc.train.process import distributed, master_address
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.process.malloc_tuning import pin_thresholds

log = logging.getLogger("aura_hpc")


@dataclass
class Runtime:
    device: torch.device
    backend: str  # the process group's backend, or "none" for a single process without a launcher
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def start(cfg: RunConfig, env: DistEnv) -> Runtime:
    """Set up this process for training and join the process group; logs the per-rank start line."""
    threads = cfg.train.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    # Only when it changes something: a redundant set_num_threads still costs ~1.5 ms of
    # system time per step afterwards (measured on the 2-core CPU machine, 2 threads).
    if threads and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    if cfg.dist.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend is nccl but this machine has no CUDA GPU (fix: --backend gloo or auto)")
    # Libraries that read the launcher's variables themselves (DeepSpeed asserts LOCAL_RANK) find
    # them under Slurm too, where srun sets SLURM_* only.
    for key, value in (("LOCAL_RANK", env.local_rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(key, str(value))
    # The rank as the ranks agreed it (node by node in the user's order), not the launcher's numbering.
    os.environ["RANK"] = str(env.rank)
    device = distributed.pick_device(env, cfg.dist.backend)
    malloc = "default"
    if device.type == "cpu" and cfg.train.tune_malloc and pin_thresholds():
        malloc = "pinned"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # DeepSpeed picks its GPU from LOCAL_RANK (engine, zero.Init): with one GPU per task (Slurm's
        # --gpus-per-task) local rank 3 sees only cuda:0, and cuda:3 is "invalid device ordinal".
        os.environ["LOCAL_RANK"] = str(device.index)
        # TF32 matmuls round fp32 inputs to 10-bit mantissas: fine under mixed precision, not
        # when the config asks for full fp32 (or fp64) arithmetic.
        tf32 = cfg.train.precision in ("auto", "bf16", "fp16")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    backend = "none"
    if env.launcher != "none" or env.world_size > 1:
        backend = distributed.init_process_group(env, cfg.dist.backend, device, cfg.dist.init_timeout_s, cfg.dist.timeout_s)
    log.info(
        "start rank=%d local_rank=%d world_size=%d node_rank=%d host=%s backend=%s device=%s restart=%d malloc=%s master=%s:%d",
        env.rank,
        env.local_rank,
        env.world_size,
        env.node_rank,
        env.hostname,
        backend,
        device_name(device),
        env.restart_count,
        malloc,
        master_address.dialled(env),  # where rank 0's store was looked for: the first thing to check when a rendezvous times out
        env.master_port,
    )
    dtypes = precision_dtypes(cfg.train.precision, device)
    if cfg.train.precision == "auto" and backend != "none":
        # Each rank's own GPU decides "auto"; FSDP and ZeRO gather in one dtype on every rank (an
        # RTX 2080 beside a 3090, or a rank fallen back to the CPU, would hang them): the ranks agree.
        dtypes = agreed_precision(dtypes, collectives.flags(dtypes[1] is not None), env.is_main)
    return Runtime(device, backend, *dtypes)


Dtypes = tuple[torch.dtype, torch.dtype | None]  # (parameters, autocast or None)


def agreed_precision(mine: Dtypes, bf16_everywhere: list[bool], say: bool) -> Dtypes:
    """train.precision=auto as every rank can run it: bf16 only where all have it natively."""
    if all(bf16_everywhere) or not any(bf16_everywhere):
        return mine
    if say:
        without = ", ".join(str(r) for r, ok in enumerate(bf16_everywhere) if not ok)
        log.warning(
            "train.precision=auto: rank(s) %s have no native bf16, so every rank trains in fp32 "
            "(fix: --set train.precision=bf16 to emulate it there, or leave those machines out)",
            without,
        )
    return torch.float32, None


def precision_dtypes(precision: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) for train.precision on this device."""
    cuda = device.type == "cuda"
    if precision == "fp64":
        return torch.float64, None
    if precision == "fp32":
        return torch.float32, None
    if precision == "bf16" or (precision == "auto" and cuda and native_bf16(device)):
        return torch.float32, torch.bfloat16
    if precision == "fp16":
        if not cuda:
            raise ConfigError("train.precision fp16 needs a CUDA GPU (fix: --set train.precision=auto)")
        return torch.float32, torch.float16
    return torch.float32, None


def native_bf16(device: torch.device) -> bool:
    """bf16 in hardware: compute capability 8.0 and up (A100, H100, RTX 30xx+). torch's
    is_bf16_supported() also says yes where bf16 is only emulated (T4, V100, RTX 20xx), and slow."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG streams: CPU, Python, and the one GPU it trains on (not every visible GPU)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is None or device.type != "cuda":
        return
    if isinstance(cuda, list):  # older checkpoints held the state of every visible GPU
        cuda = cuda[device.index] if device.index is not None and device.index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


_kept = threading.local()


@contextlib.contextmanager
def keep_device_rng(device: torch.device) -> Iterator[None]:
    """Around library code that reseeds torch globally (torch.manual_seed seeds every GPU): this rank's
    generators, the CPU's and its GPU's, are as they were afterwards."""
    _kept.depth = getattr(_kept, "depth", 0) + 1
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        _kept.depth -= 1


def rng_kept() -> bool:
    """Inside keep_device_rng on this thread (the probes let a reseed there pass)."""
    return getattr(_kept, "depth", 0) > 0


def host_memory_peak() -> int:
    """The process's peak resident set, in bytes (Linux reports kilobytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory(device: Any, host_base: float) -> float:
    """Bytes this rank's training needed at most: the GPU allocator's peak, or the growth of the
    process's resident set on CPU over `host_base` (what the memory plan estimates)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(host_memory_peak() - host_base)
