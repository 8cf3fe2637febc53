"""DeepSpeed imported so that it stays off stdout.

Before 0.17 DeepSpeed's logger writes INFO lines to stdout from its import on: its accelerator probe
("Setting ds_accelerator to cpu") landed in `generate`'s output, which users pipe, and in every
rank's log. transformers 4.x imports it from modeling_utils whenever it is installed, so even a
command that never uses it pays. Here its logger keeps only warnings and errors, as newer releases
do by default (a filter, set before the import: the import itself resets the level and logs), and
it is imported under a redirect, so that its handler is bound to stderr.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator


def _transformers_imports_it() -> bool:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0]) < 5
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


def quiet_deepspeed(needed: bool = False) -> None:
    """Call before anything that imports DeepSpeed (`needed`: this process will use it)."""
    import torch

    # Naming the accelerator skips the probe's warning where there is no CUDA.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "deepspeed" not in sys.modules and (needed or _transformers_imports_it()) and importlib.util.find_spec("deepspeed") is not None:
        logging.getLogger("DeepSpeed").addFilter(_warnings_and_up)
        with contextlib.redirect_stdout(sys.stderr):  # its logger's handler is made now, on the redirected stream
            try:
                with _hidden(*KEPT_OUT):
                    import deepspeed
            except ImportError:
                # A DeepSpeed release that needs one of them as it imports (ours are ranges, not one pin): the
                # import again with nothing kept out. What did import stays; what failed is imported anew.
                import deepspeed  # noqa: F401
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        _no_shared_memory_op()


def _no_shared_memory_op() -> None:
    """On CPUs DeepSpeed's comm backend builds a C++ op as it starts (`deepspeed_shm_comm`, JIT-compiled into
    ~/.cache/torch_extensions: 55 s and 80 CPU-s on the first run of a 2-vCPU machine, again for each DeepSpeed
    release; a compiler and ninja required; a line on stdout), for its inference all-reduce alone, which
    training never calls. It is marked unavailable, as DeepSpeed marks it on platforms without it: its
    backend then starts without it (`build_shm_op` returns None) and all-reduces through torch."""
    compatible = getattr(sys.modules.get("deepspeed.ops"), "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


# Imported by DeepSpeed only for parts we never run (see `_hidden`).
KEPT_OUT = ("mlflow", "transformers")


@contextlib.contextmanager
def _hidden(*modules: str) -> Iterator[None]:
    """`modules` unimportable for a moment, those not yet imported. DeepSpeed imports both at module level, only
    for parts we never run: MLflow for its autotuner's experiment logs (1.1 to 1.4 CPU-s of every ZeRO rank's
    start-up); transformers for its RLHF hybrid engine and OptimizedLinear's patching of AutoModelForCausalLM
    (1.5 to 1.7 CPU-s, where the rest of DeepSpeed's import takes about 2; measured on a 2-vCPU machine), and
    our workers never import transformers (the model is ours). Both imports are guarded in DeepSpeed 0.16-0.19:
    without the module those parts are off (a release that needs one is imported again with it: quiet_deepspeed).
    Our own MLflow tracker imports it later, in the trackers' thread, and `generate` imports transformers after
    this; nothing else imports while the main thread is here."""
    hidden = [m for m in modules if m not in sys.modules]
    for module in hidden:
        sys.modules[module] = None  # type: ignore[assignment]  # `import m` raises ImportError, find_spec says None
    try:
        yield
    finally:
        for module in hidden:
            if sys.modules.get(module, 0) is None:
                del sys.modules[module]


def _warnings_and_up(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING
