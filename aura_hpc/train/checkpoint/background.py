"""The one thread per process that writes checkpoints behind the training loop.

Everything our code writes in the background goes through it, one job at a time in the order the
saves queued them: rank 0's commit (the full checkpoint's files and its marker, writer.py) and a
library's shard files captured in host memory (DeepSpeed's, background_shards.py). On rank 0 a
sharded save's commit therefore always runs after that rank's own shards.

FSDP's shards are the exception: DCP's `async_save` stages DTensor shards and plans their files
across the ranks itself, on its own executor and process group; writing them here would mean
redoing its planner. Its future joins the commit like ours (the commit waits for it), and on the
other ranks a job here waits for it, so that an error exit's close() lets DCP's last agreement finish
before the process groups go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def submit(job: Callable[[], T]) -> Future[T]:
    """Queue `job` on this process's checkpoint thread (started at the first background save)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aura-checkpoint-writer")
    return _executor.submit(job)


def run_here(job: Callable[[], T]) -> Future[T]:
    """`job` run now, in this thread, as a finished future: a save without train.async_checkpoint."""
    done: Future[T] = Future()
    try:
        done.set_result(job())
    except BaseException as exc:
        done.set_exception(exc)
    return done


def close() -> None:
    """Wait for the queued writes and end the thread (as a normal exit would, which joins it)."""
    global _executor
    with _lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=True)
