"""Asynchronous parameter server (`ps` + 2 `worker`s) vs synchronous `local` DDP (2 ranks) on this
machine, with both PCs at full speed and with one of them slowed down.

The slow PC is simulated with AURA_FAULT_SLOW=RANK:0.5 (aura_hpc/train/instruments/faults.py): that process
idles as long as it worked, every step. Same model, data, per-process batch and token total:
the server applies N versions of one worker's batch; DDP runs N/2 steps of both ranks' batches.

Reported per configuration: tokens/s (mean of the metrics rows after the first, which holds the
warm-up), the validation loss at the end (the same fixed validation sequences for both: equal
tokens, so the loss reached compares), and for `ps` the staleness distribution and wire bytes.
Figures depend on the machine; on a 2-core machine the server, two workers and the OS share the
cores, so the absolute numbers are a floor for real separate PCs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model.n_layer=2", "model.n_embd=128", "model.n_head=4", "data.seq_len=128", "train.batch_size=8", "train.lr=2e-3"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _sets(pairs: list[str]) -> list[str]:
    return [x for p in pairs for x in ("--set", p)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _speed(rows: list[dict]) -> float:
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1:]
    return sum(speeds) / len(speeds) if speeds else 0.0


def _eval(run_dir: Path) -> float:
    return [r["eval_loss"] for r in _rows(run_dir) if "eval_loss" in r][-1]


def run_ps(out: Path, name: str, versions: int, slow: str, wire: str = "bf16") -> dict:
    port = _free_port()
    common = ["--output-dir", str(out), "--run-name", name, *_sets([*MODEL, f"train.max_steps={versions}", "train.log_every=20"])]
    common += _sets([f"ps.wire_dtype={wire}"])
    common += _sets([f"train.eval_every={versions}", "train.checkpoint_every=0", "train.eval_sequences=64"])
    server = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", "ps", "--port", str(port), *common], env=_env(), stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start") from None
            time.sleep(0.2)
    env = _env(AURA_FAULT_SLOW=slow) if slow else _env()
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "aura_hpc", "worker", "--server", f"127.0.0.1:{port}", "--worker-rank", str(k), *common],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for k in (1, 2)
    ]
    try:
        server.communicate(timeout=1800)
    finally:
        for w in workers:
            if w.wait(timeout=120) != 0:
                w.send_signal(signal.SIGKILL)
    run_dir = out / name
    rows = _rows(run_dir)
    stats = {p.name.split("_")[1]: json.loads(p.read_text()) for p in (run_dir / "stats").glob("*.json")}
    per_worker = {k: stats[k]["steps"] for k in ("worker1", "worker2") if k in stats}
    return {
        "tokens_per_s": _speed(rows),
        "eval_loss": _eval(run_dir),
        "staleness": rows[-1]["staleness_hist"],
        "gradients": per_worker,
        "mb_per_gradient": stats["worker1"]["bytes_sent"] / max(stats["worker1"]["steps"], 1) / 1e6,
        "round_trip_ms": stats["worker1"]["mean_round_trip_ms"],
    }


def run_ddp(out: Path, name: str, steps: int, slow: str) -> dict:
    cmd = [sys.executable, "-m", "aura_hpc", "local", "--nproc-per-node", "2", "--output-dir", str(out), "--run-name", name]
    cmd += _sets([*MODEL, f"train.max_steps={steps}", "train.log_every=10", f"train.eval_every={steps}", "train.checkpoint_every=0"])
    cmd += _sets(["train.eval_sequences=64", "train.sample_tokens=1"])
    # One fault spec names one rank: rank 1 plays the slow PC ("2" is the ps worker rank of the same PC).
    env = _env(AURA_FAULT_SLOW=slow.replace("2:", "1:", 1)) if slow else _env()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    return {"tokens_per_s": _speed(_rows(out / name)), "eval_loss": _eval(out / name)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--versions", type=int, default=400, help="server updates (DDP runs half as many steps of twice the batch)")
    p.add_argument("--slow-fraction", type=float, default=0.5, help="share of each step the slow PC idles")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wire", action="store_true", help="only compare ps with fp32 and bf16 on the wire")
    a = p.parse_args()
    if a.versions % 2:
        raise SystemExit("--versions must be even")
    out = Path(tempfile.mkdtemp(prefix="bench-ps-"))
    if a.wire:
        for wire in [w for _ in range(a.repeats) for w in ("fp32", "bf16")]:
            r = run_ps(out, f"wire-{wire}-{time.monotonic_ns()}", a.versions, "", wire)
            print(
                f"ps, {wire} on the wire: {r['mb_per_gradient']:.2f} MB per gradient, {r['tokens_per_s']:,.0f} tokens/s, "
                f"eval loss {r['eval_loss']:.4f}, round trip {r['round_trip_ms']:.1f} ms",
                flush=True,
            )
        return
    slow = f"2:{a.slow_fraction}"
    configs = (
        ("ddp, both fast", run_ddp, a.versions // 2, ""),
        ("ps, both fast", run_ps, a.versions, ""),
        ("ddp, one slowed", run_ddp, a.versions // 2, slow),
        ("ps, one slowed", run_ps, a.versions, slow),
    )
    results: dict[str, list[dict]] = {c[0]: [] for c in configs}
    for repeat in range(a.repeats):  # interleaved: the configurations share the machine's noise
        for label, fn, n, s in configs:
            t0 = time.perf_counter()
            r = fn(out, f"{label.replace(', ', '-').replace(' ', '_')}-{repeat}", n, s)
            r["wall_s"] = time.perf_counter() - t0
            results[label].append(r)
            print(f"{label:16s} {json.dumps(r)}", flush=True)
    print(f"\nequal tokens: {a.versions} x batch 8 x seq 128 = {a.versions * 8 * 128:,}; slow PC idles {a.slow_fraction:.0%} of each step")
    print(f"median of {a.repeats}: {'':3s} {'tokens/s':>9s} {'eval loss (min..max)':>22s}")
    speed = {}
    for label, rs in results.items():
        speed[label] = statistics.median(r["tokens_per_s"] for r in rs)
        losses = [r["eval_loss"] for r in rs]
        print(f"{label:16s} {speed[label]:12,.0f} {statistics.median(losses):9.4f} ({min(losses):.3f}..{max(losses):.3f})")
    keep = {kind: speed[f"{kind}, one slowed"] / speed[f"{kind}, both fast"] for kind in ("ddp", "ps")}
    print(f"throughput kept with one PC slowed: ddp {keep['ddp']:.0%}, ps {keep['ps']:.0%}")


if __name__ == "__main__":
    main()
