"""DiLoCo against one node at equal wall time, over several seeds: the loss half of bench_lan.py's
"equal wall time" column, without a shaped link.

    python bench/bench_equal_time.py --steps 1200 --speedup 1.94 --seeds 1234,7,11,23

The loss a DiLoCo run reaches does not depend on the link (the link only sets how long it takes), so
the two replicas run on this machine (`local --nproc-per-node 2 --set dist.diloco_replicas=2`: two
independent replicas meeting over gloo, the same computation as two PCs). The wall time comes from a
speed-up measured on the link by bench_lan.py (--speedup): in the time two PCs make --steps steps
each, one PC makes 2 x steps / speedup. One node then runs a schedule that ends at that step (what a
user with one PC and the same time would run) and, with --read, also a schedule of 2 x steps read at
that step (bench_lan.py's comparison). Model, batch and DiLoCo settings are bench_lan.py's Quijote
row: 4 x 256, batch 8 x 128, lr 2e-3, int8 deltas, sync_every 80, overlap 20, plain averaging.
Each run uses one thread per process; every run of a seed starts at once (they do not time anything).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lan import MODEL, SHARED_CORPUS, env, sets

DILOCO = [
    "dist.strategy=diloco",
    "dist.diloco_wire=int8",
    "dist.sync_every=80",
    "dist.diloco_overlap=20",
    "dist.outer_lr=1.0",
    "dist.outer_momentum=0",
    "dist.diloco_replicas=2",
]


def launch(out: Path, name: str, nproc: int, settings: list[str], port: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "aura_hpc", "local", "--output-dir", str(out), "--run-name", name, "--nproc-per-node", str(nproc)]
    args += ["--master-port", str(port), *sets(settings)]
    return subprocess.Popen(args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def final_eval(out: Path, name: str) -> float:
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval_loss" in r][-1]["eval_loss"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1200, help="steps of each DiLoCo replica")
    p.add_argument("--speedup", type=float, default=1.94, help="two PCs' tokens/s over one PC's, measured by bench_lan.py")
    p.add_argument("--seeds", default="1234,7,11,23")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--read", action="store_true", help="also one node on a schedule of 2 x steps, read at the equal-time step")
    a = p.parse_args()
    if not SHARED_CORPUS.exists():
        sys.exit(f"needs {SHARED_CORPUS}")
    equal = round(2 * a.steps / a.speedup)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        from aura_hpc.data.prepare import PrepareSpec, prepare

        data = out / "data"
        prepare(PrepareSpec(out_dir=data, inputs=[str(SHARED_CORPUS)], vocab_size=8192))
        common = [*MODEL, f"data.path={data}", "train.warmup_steps=10", "train.log_every=20", f"train.eval_every={a.eval_every}"]
        common += ["train.eval_sequences=64", "train.checkpoint_every=0", "train.sample_every=0", "train.allow_oversubscription=true"]
        print(f"bench_equal_time: DiLoCo {a.steps} steps per replica; one node's equal-time step {equal} at {a.speedup}x", flush=True)
        for i, seed in enumerate(int(s) for s in a.seeds.split(",")):
            mine = [*common, f"train.seed={seed}"]
            runs = {
                "diloco": launch(out, f"diloco-{seed}", 2, [*mine, f"train.max_steps={a.steps}", *DILOCO], 29610 + 3 * i),
                "one": launch(out, f"one-{seed}", 1, [*mine, f"train.max_steps={equal}"], 29611 + 3 * i),
            }
            if a.read:
                longer = [*mine, f"train.max_steps={2 * a.steps}", f"train.stop_at={equal}"]
                runs["read"] = launch(out, f"read-{seed}", 1, longer, 29612 + 3 * i)
            for name, proc in runs.items():
                text = proc.communicate()[0]
                if proc.returncode not in (0, 75):  # 75: stopped at train.stop_at
                    sys.exit(f"{name} (seed {seed}) failed:\n{text[-3000:]}")
            row = {"seed": seed, **{name: final_eval(out, f"{name}-{seed}") for name in runs}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [n for n in ("diloco", "one", "read") if n in rows[0]]
    print("| seed | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        print(f"| {r['seed']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |")
    print("| mean | " + " | ".join(f"{statistics.mean(r[n] for r in rows):.3f}" for n in names) + " |")
    wins = sum(r["diloco"] < r["one"] for r in rows)
    print(f"DiLoCo lower than one node (schedule ending at equal time) in {wins} of {len(rows)} seeds")


if __name__ == "__main__":
    main()
