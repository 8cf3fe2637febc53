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
    if "deepspeed" in sys.modules or not (needed or _transformers_imports_it()) or importlib.util.find_spec("deepspeed") is None:
        return
    logging.getLogger("DeepSpeed").addFilter(_warnings_and_up)
    with contextlib.redirect_stdout(sys.stderr), _hidden("mlflow"):
        import deepspeed  # noqa: F401  (its logger's handler is made now, on the redirected stream)


@contextlib.contextmanager
def _hidden(module: str) -> Iterator[None]:
    """`module` unimportable for a moment, unless already imported. DeepSpeed's autotuner, which we never
    run, imports MLflow whenever it is installed, for its own experiment logs: 1.1 to 1.4 s of CPU in every
    ZeRO rank's start-up (measured on a 2-vCPU machine). Our own MLflow tracker imports it later, in the
    trackers' thread, once this is over (and nothing else imports while the main thread is here)."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError, find_spec says None
    try:
        yield
    finally:
        if sys.modules.get(module, 0) is None:
            del sys.modules[module]


def _warnings_and_up(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING
