"""`check` on one machine: Python, torch, CUDA/NCCL, GPUs, working backends, free disk."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from aura_hpc.ops.check_report import Report


def local_checks(report: Report, output_dir: str | None, stage: list[str] | None = None) -> None:
    """`stage`: what is being checked, for the watchdog's line if it never returns."""
    report.add(
        "python",
        sys.version_info >= (3, 11),
        f"{platform.python_version()} ({sys.executable})",
        "" if sys.version_info >= (3, 11) else "use Python 3.11 or newer",
    )
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    report.add(
        "torch", True, f"{torch.__version__}, CUDA {'available' if cuda else 'not available'} (build CUDA {torch.version.cuda or 'none'})"
    )
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            report.add(f"gpu {i}", True, f"{p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
        driver = _nvml_driver()
        if driver:
            report.add("nvidia driver", True, driver)
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version()) if dist.is_nccl_available() else "not built in"
        report.add("nccl", dist.is_nccl_available(), nccl, "" if dist.is_nccl_available() else "install a CUDA build of torch")
    elif (nodes := gpu_device_nodes()) == "denied":
        # A Slurm shell without --gpus (ConstrainDevices), a container or a user the devices are closed to: the torch
        # install is fine, and the fix was to reinstall it.
        report.add(
            "gpus", True, "this machine has NVIDIA GPUs, none of them open to this process: CPU training with gloo", warning=True,
            fix="to train on them, ask for them (Slurm: --gpus), or join the group that owns /dev/nvidia*",
        )  # fmt: skip
    elif nodes and os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() not in ("", "-1"):  # hidden on purpose: CPU
        # NVIDIA's device nodes are here, and torch sees no GPU: a CPU-only wheel, or a driver older than its CUDA.
        # It passed as "CPU training", and `local` trained on the CPUs of a GPU machine.
        driver = _nvml_driver()
        why = (
            f"this torch is a CPU-only build ({torch.__version__})"
            if not torch.version.cuda
            else (f"this torch's CUDA {torch.version.cuda} does not start" + (f" with driver {driver}" if driver else ""))
        )
        report.add(
            "gpus", False, f"this machine has NVIDIA GPUs, and torch sees none: {why}",
            "install a torch build for this driver's CUDA (pip install torch --index-url https://download.pytorch.org/whl/cu124, "
            "or the cu version `nvidia-smi` names); check `nvidia-smi` works",
        )  # fmt: skip
    else:
        report.add("gpus", True, "none seen: CPU training with gloo", warning=True)
    for backend in ("gloo", "nccl"):
        if backend == "nccl" and not cuda:
            continue
        ok, why = _try_backend(backend)
        report.add(
            f"backend {backend}", ok, "works" if ok else why, "" if ok else f"use --backend {'gloo' if backend == 'nccl' else 'nccl'}"
        )
    if platform.system() == "Windows":
        report.add(
            "libuv",
            os.environ.get("TORCH_DISTRIBUTED_USE_LIBUV") == "0",
            "Windows builds of torch have no libuv TCPStore",
            "set TORCH_DISTRIBUTED_USE_LIBUV=0 (aura_hpc local sets it for you)",
        )
    if stage is not None:  # a stat on an NFS or Lustre mount whose server is gone never returns
        stage[0] = f"{DISK_STAGE} {output_dir or 'runs'}"
    out = Path(output_dir or "runs").expanduser().resolve()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    report.add(
        "disk",
        free >= 5,
        f"{free:.1f} GiB free at {out}",
        "" if free >= 5 else "free space or choose another --output-dir (a GPT-2 124M checkpoint is ~1.5 GB)",
    )


DISK_STAGE = "the disk at"


def _nvml_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None


def _try_backend(backend: str) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    from aura_hpc.comm import collectives

    try:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        t = torch.ones(4, device=device)
        collectives.all_reduce(t, collectives.Group("backend-check", device))
        ok = bool(t.sum().item() == 4)
        dist.destroy_process_group()
        return ok, "" if ok else "all_reduce gave a wrong result"
    except Exception as exc:  # any failure to start is the finding itself
        if dist.is_initialized():
            dist.destroy_process_group()
        return False, str(exc).splitlines()[0][:200]


def gpu_device_nodes() -> str:
    """NVIDIA's GPU device nodes (/dev/nvidia0, ...), which its driver makes for each GPU: "" where there are none (a
    container given none), "denied" where this process may open none of them (a cgroup that denies them: Slurm's
    ConstrainDevices outside an allocation of GPUs; a user outside their group), else "here"."""
    import glob

    nodes = glob.glob("/dev/nvidia[0-9]*")
    for node in nodes:
        try:
            os.close(os.open(node, os.O_RDWR | os.O_NONBLOCK))  # as CUDA opens it
        except PermissionError:
            continue
        except OSError:
            return "here"  # not a refusal (busy, gone meanwhile)
        return "here"
    return "denied" if nodes else ""
