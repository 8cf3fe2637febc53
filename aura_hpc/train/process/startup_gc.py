"""Python's cycle collector while a process imports torch.

Importing torch, and `torch._dynamo` (which every optimizer's first parameter group imports:
torch/_compile.py), makes about 500,000 objects that live as long as the process. While they are
being made the collector runs again and again over all of them: on a 2-vCPU box, a worker's
imports took 4.8 s of CPU with it and 4.1 s without. Off during the imports, then those objects
are frozen (`gc.freeze`: never scanned again; left unfrozen, the next young collections scan them all,
measured to cost more than the saving) and the collector is back on for everything made after.
The imports' own unreachable objects (about 9,000, no tensors) stay frozen with them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_unscanned() -> Iterator[None]:
    """Around a process's heavy imports only: nothing made here that should be freed is ever collected."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
