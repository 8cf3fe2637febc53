"""train.process.startup_gc: the collector is off while a process imports torch, then those objects are frozen."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from tests.conftest import REPO, cli_env

# A fresh interpreter: what is frozen, and how often the collector ran, is process-wide.
IMPORT_PROBE = r"""
import gc, json
from aura_hpc.train.process.startup_gc import imports_unscanned

full_before = gc.get_stats()[2]["collections"]
with imports_unscanned():
    on_inside = gc.isenabled()
    import torch
full_during = gc.get_stats()[2]["collections"] - full_before
a = []; a.append(a); del a  # a cycle made after: still collected
print(json.dumps({"on_inside": on_inside, "on_after": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "full_during": full_during, "collected_after": gc.collect()}))
"""

# The worker entry point itself (as every launcher starts it), stopped by --help once its imports are done.
WORKER_PROBE = r"""
import atexit, gc, json, runpy, sys
atexit.register(lambda: print(json.dumps({"frozen": gc.get_freeze_count(), "on": gc.isenabled(),
                                          "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules})))
sys.argv = ["aura_hpc.train", "--help"]
runpy.run_module("aura_hpc.train", run_name="__main__")
"""


def _run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_torch_is_imported_with_no_full_collection_and_frozen_and_the_collector_is_back_on() -> None:
    got = _run(IMPORT_PROBE)
    assert got["on_inside"] is False and got["on_after"] is True
    assert got["full_during"] == 0, got  # with the collector on, importing torch runs several
    assert got["frozen"] > 100_000, got
    assert got["collected_after"] >= 1, got


def test_the_worker_entry_point_imports_torch_and_dynamo_unscanned() -> None:
    got = _run(WORKER_PROBE)
    assert got["torch"] and got["dynamo"], got
    assert got["frozen"] > 100_000 and got["on"], got


def test_a_collector_that_was_off_stays_off() -> None:
    from aura_hpc.train.process.startup_gc import imports_unscanned

    was = gc.isenabled()
    gc.disable()
    try:
        with imports_unscanned():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        if was:
            gc.enable()
