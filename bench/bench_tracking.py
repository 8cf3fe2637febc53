"""What the trackers cost, and which way a SQLite store is kept (tracking.sqlite_local).

- per row: trackio's Run.log + its flush, and MLflow's log_batch into a SQLite store, with the store's
  journal in WAL mode (trackio's default) and DELETE mode (what a network filesystem needs), on the
  directory given (local disk by default; point --dir at an NFS mount to measure one);
- the copy: SQLite's backup API from a node-local store into the run directory, as trainers.py does
  every tracking.copy_every_s, for the stores a run of --rows rows leaves.

    python bench/bench_tracking.py [--rows 2000] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACKIO = """
import os, sys, time
import trackio
run = trackio.init(project="bench", name="r", embed=False, auto_log_gpu=False, auto_log_cpu=False)
rows = int(sys.argv[1])
t0 = time.perf_counter()
for s in range(1, rows + 1):
    run.log({"loss": 1.0 / s, "lr": 1e-3, "tokens_per_s": 1e5, "grad_norm": 1.0}, step=s)
run.finish()
print("took", time.perf_counter() - t0)
"""

MLFLOW = """
import sys, time
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri="sqlite:///" + sys.argv[2])
e = c.create_experiment("bench")
r = c.create_run(e).info.run_id
rows = int(sys.argv[1])
t0 = time.perf_counter()
for s in range(1, rows + 1):
    now = int(time.time() * 1000)
    c.log_batch(r, metrics=[Metric(k, 1.0 / s, now, s) for k in ("loss", "lr", "tokens_per_s", "grad_norm")])
print("took", time.perf_counter() - t0)
"""


def _run(code: str, env: dict[str, str], *args: str) -> float:
    out = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return float(next(x for x in out.stdout.splitlines() if x.startswith("took ")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    from aura_hpc.train.loop.trackers import _backup

    base = Path(tempfile.mkdtemp(prefix="bench-tracking-", dir=a.dir))
    for mode in ("wal", "delete"):
        where = base / f"trackio-{mode}"
        took = _run(TRACKIO, {"TRACKIO_DIR": str(where), "TRACKIO_SQLITE_JOURNAL_MODE": mode, "HF_HUB_OFFLINE": "1"}, str(a.rows))
        print(f"trackio {mode:6s}: {a.rows} rows in {took:.2f} s ({took / a.rows * 1e3:.2f} ms a row, on the trackers' thread)")
    took = _run(MLFLOW, {}, str(a.rows), str(base / "mlflow.db"))
    print(f"mlflow  sqlite: {a.rows} rows in {took:.2f} s ({took / a.rows * 1e3:.2f} ms a row)")
    for db in [base / "trackio-wal" / "bench.db", base / "mlflow.db"]:
        size = db.stat().st_size
        t0 = time.perf_counter()
        _backup(db, base / f"copy-{db.parent.name}-{db.name}")
        took = time.perf_counter() - t0
        print(f"copy {db.parent.name}/{db.name} ({size / 2**20:.1f} MiB): {took * 1e3:.0f} ms")
    with sqlite3.connect(base / "mlflow.db") as c:
        print("sqlite", sqlite3.sqlite_version, "journal of mlflow.db:", c.execute("PRAGMA journal_mode").fetchone()[0])


if __name__ == "__main__":
    main()
