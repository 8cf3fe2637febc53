"""train.tune_malloc: glibc must serve a freed activation-sized block from the heap, not mmap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs in a fresh interpreter: the thresholds are process-wide and history-dependent.
PROBE = r"""
import ctypes, json, sys
from aura_hpc.train.process.malloc_tuning import pin_thresholds

libc = ctypes.CDLL("libc.so.6")

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mmapped_during_alloc(size):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(size)
    during = libc.mallinfo2().hblkhd
    libc.free(p)
    return during - before

pinned = pin_thresholds() if sys.argv[1] == "pin" else None
# 48 MiB: glibc's dynamic threshold never goes above 32 MiB, so this is mmapped either way.
print(json.dumps({"pinned": pinned, "block_16m": mmapped_during_alloc(16 << 20), "block_48m": mmapped_during_alloc(48 << 20)}))
"""


def _probe(mode: str) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_pinned_thresholds_keep_activation_sized_blocks_on_the_heap() -> None:
    default, pinned = _probe("default"), _probe("pin")
    # A fresh process starts with glibc's 128 KiB threshold: a 16 MiB block is mmapped (and
    # munmapped on free, to be faulted in again next step).
    assert default["block_16m"] >= 16 << 20
    assert pinned["pinned"] is True
    assert pinned["block_16m"] == 0, "after pinning, a 16 MiB block must come from the heap"
    assert pinned["block_48m"] >= 48 << 20, "blocks above the pinned threshold still use mmap"
