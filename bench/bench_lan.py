"""Training over a rate-limited LAN: one node against two (or three) `local` nodes, each in its own
network namespace on a bridge, every link shaped with `tc ... tbf` (netem is not available on this
machine kind), for each strategy: ddp, ddp + bf16, ddp + PowerSGD, DiLoCo (bf16 or int8 deltas; with
`diloco+int8+overlap` its meetings cross in the background for --overlap steps).

    sudo python bench/bench_lan.py --rates 10,100,1000 --nodes 2 --steps 150

Model and batch as the issue measured them: 4 layers x 256, batch 8 x 128 per node, one process per
node and one thread each (OMP_NUM_THREADS=1; this 2-core machine gives two nodes at most ~2x one).
The one-node baseline runs `nodes` times the steps of a multi-node run: the same tokens. A run that
has not finished after --max-seconds is stopped (Ctrl+C: a checkpoint, exit 75) and measured so far.
Reported per run, from rank 0's metrics.jsonl: tokens/s (trained tokens over the wall time of the
timed steps, the first 10 excluded), the speed-up over one node, the eval loss at equal tokens (the
multi-node run's last evaluation against the one-node run's at the same token count) and at equal
wall time (the same evaluation against the one-node run's, interpolated between the two around that
elapsed time).
With --ps, also the parameter server on PC 0 and two workers on PCs 1 and 2 (three shaped links), for
each `ps.push_every` in --push-every: tokens/s (the harmonic mean of the server's per-version rows
after the first), the versions applied, and the eval loss against one node's at equal tokens.
Needs root (namespaces, tc) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "quijote.txt"
MODEL = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=128", "train.batch_size=8", "train.lr=2e-3"]
STRATEGIES = {
    "ddp": [],
    "ddp+bf16": ["dist.compress=bf16"],
    "ddp+powersgd": ["dist.compress=powersgd", "dist.powersgd_rank=4"],
    "diloco": ["dist.strategy=diloco"],
    "diloco+int8": ["dist.strategy=diloco", "dist.diloco_wire=int8"],
    "diloco+int8+overlap": ["dist.strategy=diloco", "dist.diloco_wire=int8"],  # + dist.diloco_overlap=--overlap
}


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["nsenter", f"--net=/run/netns/{ns}", *cmd] if ns else list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True, timeout=60)


class Lan:
    """A bridge in a hub namespace and `n` PCs on it (10.79.1.1..n), each link rate-limited."""

    def __init__(self, n: int) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.hub = f"aura-lanhub-{self.tag}"
        self.pcs = [f"aura-lan{i}-{self.tag}" for i in range(n)]
        sh("ip", "netns", "add", self.hub)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
        sh("ip", "link", "set", "br0", "up", ns=self.hub)
        for i, pc in enumerate(self.pcs):
            sh("ip", "netns", "add", pc)
            sh("ip", "link", "add", f"p{i}{self.tag}", "type", "veth", "peer", "name", f"h{i}{self.tag}")
            sh("ip", "link", "set", f"p{i}{self.tag}", "netns", pc)
            sh("ip", "link", "set", f"h{i}{self.tag}", "netns", self.hub)
            sh("ip", "link", "set", f"h{i}{self.tag}", "master", "br0", "up", ns=self.hub)
            sh("ip", "addr", "add", f"10.79.1.{i + 1}/24", "dev", f"p{i}{self.tag}", ns=pc)
            sh("ip", "link", "set", f"p{i}{self.tag}", "up", ns=pc)
            sh("ip", "link", "set", "lo", "up", ns=pc)

    def rate(self, mbit: int) -> None:
        """Both ends of every PC's link shaped to `mbit` (tbf, as PLATFORM.md measured it)."""
        for i, pc in enumerate(self.pcs):
            for dev, ns in ((f"p{i}{self.tag}", pc), (f"h{i}{self.tag}", self.hub)):
                sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kbit", "latency", "400ms", ns=ns)

    def close(self) -> None:
        for ns in [self.hub, *self.pcs]:
            sh("ip", "netns", "del", ns, check=False)


RUN_SECRET = uuid.uuid4().hex  # every node of a multi-node run proves it (the user's choice, as AURA_RUN_SECRET)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "AURA_RUN_SECRET": RUN_SECRET})
    return e


def sets(pairs: list[str]) -> list[str]:
    return [x for p in pairs for x in ("--set", p)]


def run(
    lan: Lan | None,
    nodes: int,
    name: str,
    extra: list[str],
    steps: int,
    out: Path,
    data: Path,
    eval_every: int,
    max_seconds: float,
    nproc: int = 1,
) -> dict:
    common = [*MODEL, f"data.path={data}", f"train.max_steps={steps}", "train.warmup_steps=10", "train.log_every=5"]
    common += [f"train.eval_every={eval_every}", "train.eval_sequences=64", "train.checkpoint_every=0", "train.sample_every=0"]
    common += ["train.allow_oversubscription=true", *extra]
    procs = []
    for i in range(nodes):
        args = [sys.executable, "-m", "aura_hpc", "local", "--output-dir", str(out / f"{name}-node{i}"), "--run-name", "r"]
        args += ["--nproc-per-node", str(nproc), *sets(common)]
        if nodes > 1:
            args += ["--nnodes", str(nodes), "--node-rank", str(i), "--master-addr", "10.79.1.1", "--master-port", "29600"]
        cmd = ["nsenter", f"--net=/run/netns/{lan.pcs[i]}", *args] if lan else args
        procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + max_seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(1)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # stop at the next step (a checkpoint, exit 75): measured so far
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode not in (0, 75) for p in procs):
        raise RuntimeError(f"{name} failed:\n{outs[0][-3000:]}\n{outs[-1][-2000:]}")
    rows = [json.loads(line) for line in (out / f"{name}-node0" / "r" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    advice = next((line for line in outs[0].splitlines() if "DDP would spend" in line), "")
    return {"rows": rows, "advice": advice.split(" INFO ", 1)[-1]}


def run_ps(lan: Lan, push_every: int, mbit: int, out: Path, data: Path, versions: int, eval_every: int, max_seconds: float) -> dict:
    """`ps` on PC 0, a `worker` on PCs 1 and 2, stopped (Ctrl+C on the server: it saves and stops the
    workers) after max_seconds. One secret for all three through the environment, as a user would."""
    run = out / f"ps-k{push_every}-{mbit}"
    # A row per version: on a 10 Mbit/s link a run applies only a handful.
    common = [*MODEL, f"data.path={data}", f"train.max_steps={versions}", "train.warmup_steps=10", "train.log_every=1"]
    common += [f"train.eval_every={eval_every}", "train.eval_sequences=64", "train.checkpoint_every=0", f"ps.push_every={push_every}"]
    e = env()
    e["AURA_PS_SECRET"] = uuid.uuid4().hex
    args = ["--output-dir", str(out), "--run-name", run.name, *sets(common)]
    ns = [["nsenter", f"--net=/run/netns/{pc}"] for pc in lan.pcs]
    aura = [sys.executable, "-m", "aura_hpc"]
    server = subprocess.Popen(
        [*ns[0], *aura, "ps", "--port", "30005", *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    time.sleep(2)
    workers = [
        subprocess.Popen(
            [*ns[k], *aura, "worker", "--server", "10.79.1.1:30005", "--worker-rank", str(k), *args],
            env=e,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for k in (1, 2)
    ]
    deadline = time.monotonic() + max_seconds
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    text = server.communicate(timeout=900)[0]
    for w in workers:
        try:
            w.wait(timeout=120)
        except subprocess.TimeoutExpired:
            w.kill()
    if server.returncode not in (0, 75, 130):
        raise RuntimeError(f"ps k={push_every} failed:\n{text[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1:]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    # Each row is one version (the same tokens): the rate over them is the harmonic mean. The two
    # workers' versions arrive in bursts, and an arithmetic mean counts the short gaps as fast.
    rate = len(speeds) / sum(1.0 / x for x in speeds) if speeds else 0.0
    return {"rows": rows, "tokens_per_s": rate, "evals": evals}


def tokens_per_s(rows: list[dict], skip_steps: int = 10) -> float:
    """Trained tokens over wall time between the first row at or after `skip_steps` and the last row
    (a run too slow to get past it: over all its rows)."""
    logged = [r for r in rows if "elapsed_s" in r]
    after = [r for r in logged if r["step"] >= skip_steps]
    first, last = (after[0], after[-1]) if len(after) > 1 else (None, logged[-1])
    if first is None:
        return last["tokens"] / last["elapsed_s"]
    return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def eval_at(rows: list[dict], seconds: float | None = None, tokens: int | None = None) -> float | None:
    """The evaluation at wall time `seconds` (linear between the two around it: the one before alone
    would flatter a run that ends just before the next), or the last one at `tokens` trained, or the last one."""
    evals = [r for r in rows if "eval_loss" in r and "elapsed_s" in r]
    if seconds is not None:
        after = [r for r in evals if r["elapsed_s"] > seconds]
        evals = [r for r in evals if r["elapsed_s"] <= seconds]
        if evals and after:
            a, b = evals[-1], after[0]
            f = (seconds - a["elapsed_s"]) / (b["elapsed_s"] - a["elapsed_s"])
            return round(a["eval_loss"] + f * (b["eval_loss"] - a["eval_loss"]), 6)
    if tokens is not None:
        evals = [r for r in evals if r["tokens"] <= tokens]
    return evals[-1]["eval_loss"] if evals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,100,1000", help="link rates in Mbit/s")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node (2: DiLoCo with one replica per node, DDP inside it)")
    p.add_argument("--strategies", default="ddp,ddp+bf16,ddp+powersgd,diloco", help=f"of {', '.join(STRATEGIES)}")
    p.add_argument("--steps", type=int, default=150, help="steps of a multi-node run (one node runs nodes x steps)")
    p.add_argument("--sync-every", type=int, default=25, help="DiLoCo's dist.sync_every")
    p.add_argument("--overlap", type=int, default=0, help="diloco+int8+overlap's dist.diloco_overlap (0: a tenth of --sync-every)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--max-seconds", type=float, default=300, help="stop a multi-node run after this long (measured so far)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for the multi-node runs (repeatable)")
    p.add_argument("--ps", action="store_true", help="also the parameter server and two workers (--strategies '' for only them)")
    p.add_argument("--push-every", default="1,4", help="with --ps: the ps.push_every values to run")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: network namespaces and tc")
    rates = [int(x) for x in a.rates.split(",")]
    names = [s for s in a.strategies.split(",") if s]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        from aura_hpc.data.prepare import PrepareSpec, prepare

        data = out / "data"
        spec = PrepareSpec(out_dir=data, inputs=[str(SHARED_CORPUS)], vocab_size=8192) if SHARED_CORPUS.exists() else None
        prepare(spec or PrepareSpec(out_dir=data, builtin=True, vocab_size=4096, val_fraction=0.05))
        print(f"bench_lan: {a.nodes} nodes, {a.steps} steps each ({a.nodes * a.steps} for one node), model {' '.join(MODEL)}", flush=True)
        t0 = time.perf_counter()
        seed = [s for s in a.set if s.startswith("train.seed=")]  # a different seed: one node's too, or the comparison is unfair
        one = run(None, 1, "one", seed, a.nodes * a.steps, out, data, a.eval_every, 1e9)
        base = tokens_per_s(one["rows"])
        print(f"one node: {base:,.0f} tokens/s, eval loss {eval_at(one['rows']):.4f} after {a.nodes * a.steps} steps", flush=True)
        results = []
        lan = Lan(a.nodes) if names else None
        try:
            for mbit in rates if lan else []:
                lan.rate(mbit)
                for name in names:
                    extra = list(STRATEGIES[name]) + ([f"dist.sync_every={a.sync_every}"] if name.startswith("diloco") else [])
                    if name.endswith("+overlap"):
                        extra.append(f"dist.diloco_overlap={a.overlap or max(1, a.sync_every // 10)}")
                    extra += a.set
                    r = run(lan, a.nodes, f"{name}-{mbit}", extra, a.steps, out, data, a.eval_every, a.max_seconds, a.nproc_per_node)
                    evals = [row for row in r["rows"] if "eval_loss" in row]
                    last = evals[-1] if evals else {"eval_loss": None, "tokens": 0, "elapsed_s": 0.0}
                    tps = tokens_per_s(r["rows"])
                    row = {
                        "mbit": mbit,
                        "strategy": name,
                        "steps": r["rows"][-1]["step"],
                        "tokens_per_s": round(tps),
                        "speedup": round(tps / base, 2),
                        "eval": last["eval_loss"],
                        "one_node_eval_equal_tokens": eval_at(one["rows"], tokens=last["tokens"]) if evals else None,
                        "one_node_eval_equal_time": eval_at(one["rows"], seconds=last["elapsed_s"]) if evals else None,
                        "advice": r["advice"],
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            if lan:
                lan.close()
        if a.ps:
            ps_bench(a, rates, out, data, base, one["rows"])
        print(f"one node: {base:,.0f} tokens/s; total {time.perf_counter() - t0:.0f}s")
        print("| link | strategy | steps | tokens/s | vs one node | eval loss | one node, equal tokens | one node, equal time |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['mbit']} Mbit/s | {r['strategy']} | {r['steps']} | {r['tokens_per_s']:,} | {r['speedup']:.2f}x | {r['eval']} | "
                f"{r['one_node_eval_equal_tokens']} | {r['one_node_eval_equal_time']} |"
            )


def ps_bench(a: argparse.Namespace, rates: list[int], out: Path, data: Path, base: float, one_rows: list[dict]) -> None:
    lan = Lan(3)
    setting = dict(m.split("=", 1) for m in MODEL)
    tokens_per_version = int(setting["train.batch_size"]) * int(setting["data.seq_len"])  # one worker step
    print("| link | ps.push_every | versions | tokens/s | vs one node | eval loss | one node, equal tokens |")
    print("|---|---|---|---|---|---|---|")
    try:
        for mbit in rates:
            lan.rate(mbit)
            for k in [int(x) for x in a.push_every.split(",")]:
                r = run_ps(lan, k, mbit, out, data, a.nodes * a.steps // k, a.eval_every, a.max_seconds)  # one node's tokens
                version = r["rows"][-1]["version"] if r["rows"] else 0
                last = r["evals"][-1] if r["evals"] else None
                equal = eval_at(one_rows, tokens=last["version"] * tokens_per_version * k) if last else None
                loss = f"{last['eval_loss']:.3f} (version {last['version']})" if last else "none"
                speed = f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x"
                print(f"| {mbit} Mbit/s | {k} | {version} | {speed} | {loss} | {equal} |", flush=True)
    finally:
        lan.close()


if __name__ == "__main__":
    main()
