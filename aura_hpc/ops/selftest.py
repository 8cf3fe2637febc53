"""`python -m aura_hpc selftest`: prove the GPU contract on a node, and measure it, before spending a job on it.

For each strategy (ddp, fsdp, zero1, zero2, zero3, and on two GPUs or more the slow-link ones: ddp with
PowerSGD compression, DiLoCo with a replica per GPU meeting in the background) on this node's GPUs, a
short real `local` run:
- the quiet steps (those that do not log, evaluate, sample or checkpoint) run under
  torch.cuda.set_sync_debug_mode("error"): any host synchronisation in them fails the run;
- after the first step torch._dynamo's error_on_recompile is on (compiled runs): a recompilation
  fails the run, and the compiled graph count and graph breaks are read back;
- a NaN is injected into the loss of the last rank at step 7: every rank must skip that update;
- every collective of the run (start-up, evaluation, checkpoints, meetings) gets tensors on its group's
  device, and nothing reseeds every GPU's generator after the first step (AURA_PROBE_RUN);
- it stops at step 10 with a checkpoint, and a second run resumes from it to step 20.
Then a throughput run of the trainer (one GPU, gpt2-small shape, vocabulary 50,304) against the
reference loop written independently of our model (aura_hpc/ops/reference_loop.py, data already
on the GPU): tokens/s, MFU and their ratio. The report goes to the terminal and to OUT/selftest.json.

`--cpu` runs the same sequence on CPU with a tiny model (the syncs are then counted by the CPU
probes instead of CUDA; the figures mean nothing): how CI keeps this command working.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.errors import LaunchError, one_line

# Each check's settings beyond the shared ones. PowerSGD compresses from step 10, so the resumed run's
# quiet steps are compressed; DiLoCo's replicas (one per GPU: the meetings cross between them) meet
# every 4 steps in int8, each meeting landing 2 steps later.
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": ("dist.strategy=ddp",),
    "fsdp": ("dist.strategy=fsdp",),
    "zero1": ("dist.strategy=zero1",),
    "zero2": ("dist.strategy=zero2",),
    "zero3": ("dist.strategy=zero3",),
    "ddp+powersgd": ("dist.strategy=ddp", "dist.compress=powersgd"),
    "diloco": ("dist.strategy=diloco", "dist.sync_every=4", "dist.diloco_overlap=2", "dist.diloco_wire=int8"),
}
BETWEEN_RANKS = ("ddp+powersgd", "diloco")  # what they do happens between ranks: not run on one GPU

NAN_STEP, STOP_STEP, END_STEP = 7, 10, 20


def settings(strategy: str, nproc: int) -> list[str]:
    """The `--set` values of a strategy's check on `nproc` processes (tests/test_gpu_contract.py runs
    the same ones on CPU under its probes). DiLoCo on 4 GPUs or more: replicas of 2 GPUs, as a node's
    GPUs train one replica (DDP inside it, only its leader meeting the others); on 2, one per GPU."""
    replicas = nproc // 2 if nproc >= 4 else nproc
    return [*STRATEGIES[strategy], *([f"dist.diloco_replicas={replicas}"] if strategy == "diloco" else [])]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    device: str
    torch: str
    checks: list[Check] = field(default_factory=list)
    throughput: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every check passed, and something was checked (a strategy that needs 2 GPUs on a 1-GPU node is skipped)."""
        return bool(self.checks or self.throughput) and all(c.ok for c in self.checks)


def _env(extra: dict[str, str], threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _local(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return run_or_interrupt([sys.executable, "-m", "aura_hpc", "local", *args], env, timeout)


def run_or_interrupt(cmd: list[str], env: dict[str, str], timeout: float, grace: float = 90) -> subprocess.CompletedProcess[str]:
    """Run a `local` launcher; past `timeout`, stop it as Ctrl+C does, so that it stops its workers (hung ones
    included) and names what hung; SIGKILL only past `grace`. Killed at once, it left its workers running
    (they are in sessions of their own; a hung one never reaches the step where it would notice)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    # A failed check with its reason, and the report still written.
    return subprocess.CompletedProcess(cmd, 124, out, f"{err}error: the run did not end within {timeout:.0f} s (a hang?)\n")


def _syncs(run: Path, rank: int) -> dict[str, int]:
    path = run / "probes" / f"rank{rank}.json"
    return json.loads(path.read_text()).get("syncs", {}) if path.exists() else {}


def _last_line(r: subprocess.CompletedProcess[str]) -> str:
    """Why a run failed: its `error:` line (the goodput line follows it), else its last line."""
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines)[-1][:300] if lines else f"exit {r.returncode}"


def contract(strategy: str, data: Path, runs: Path, nproc: int, model: list[str], cpu: bool) -> Check:
    """One strategy: NaN skipped on every rank, no sync in quiet steps, compiled once, stop and resume."""
    name = f"{strategy} on {nproc} {'process' if cpu else 'GPU'}{'es' if cpu and nproc > 1 else 's' if nproc > 1 else ''}"
    run_name = strategy.replace("+", "-")
    args = ["--nproc-per-node", str(nproc), "--output-dir", str(runs), "--run-name", run_name, "--set", f"data.path={data}", *model]
    args += [x for kv in settings(strategy, nproc) for x in ("--set", kv)]
    args += ["--set", f"train.max_steps={END_STEP}", "--set", "train.checkpoint_every=5"]
    args += [
        "--set",
        "train.log_every=5",
        "--set",
        "train.eval_every=10",
        "--set",
        "train.sample_every=10",
        "--set",
        "train.warmup_steps=2",
    ]
    if cpu:
        args += ["--set", "train.fused_optimizer=true"]  # what CUDA runs use, so the probes watch the same path
    env = _env(
        {"AURA_PROBE_STEPS": f"3-{END_STEP - 1}", "AURA_PROBE_RUN": "1", "AURA_FAULT_NAN": f"{nproc - 1}:{NAN_STEP}:1"}, 1 if cpu else 0
    )
    first = _local([*args, "--set", f"train.stop_at={STOP_STEP}"], env, 1800)
    if first.returncode != 0:
        return Check(name, False, f"first run failed: {_last_line(first)}")
    if f"at step {NAN_STEP}: update skipped" not in first.stdout:
        return Check(name, False, f"the NaN injected at step {NAN_STEP} was not skipped")
    # Skipped alone: a NaN that reached the weights shows as more bad steps and a rollback to step 5.
    if first.stdout.count("update skipped") != 1 or "rolled back" in first.stdout:
        return Check(name, False, f"the NaN injected at step {NAN_STEP} reached the weights (more bad steps, or a rollback, followed)")
    second = _local(args, _env({"AURA_PROBE_STEPS": f"{STOP_STEP + 2}-{END_STEP - 1}"}, 1 if cpu else 0), 1800)
    if second.returncode != 0:
        return Check(name, False, f"resumed run failed: {_last_line(second)}")
    if f"resumed from checkpoint step_{STOP_STEP:08d}" not in second.stdout:
        return Check(name, False, f"the second run did not resume from step {STOP_STEP}")
    problems, graphs = [], set()
    for rank in range(nproc):
        path = runs / run_name / "probes" / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {}
        ours = [k for k in [*report.get("syncs", {}), *report.get("placement", {})] if "deepspeed/" not in k]
        problems += ours[:2]
        graphs.add(report.get("compiled_graphs", 0))
        if report.get("graph_breaks"):
            problems.append(f"graph breaks: {report['graph_breaks']}")
        whole = runs / run_name / "probes" / f"run_rank{rank}.json"
        seen = json.loads(whole.read_text()) if whole.exists() else {}
        problems += [*seen.get("host_tensors", {}), *seen.get("reseeds", {})][:2]
    if problems:
        return Check(name, False, "; ".join(problems)[:300])
    compiled = f", compiled graphs {max(graphs)}, no recompilation" if max(graphs, default=0) else ""
    theirs = sum(n for rank in range(nproc) for k, n in _syncs(runs / run_name, rank).items() if "deepspeed/" in k)
    how = "no host read in quiet steps (CPU probes)" if cpu else "no sync of ours in quiet steps (CUDA's sync debug mode)"
    how += f"; DeepSpeed's own: {theirs}" if theirs else ""
    return Check(name, True, f"NaN at step {NAN_STEP} skipped on every rank, stopped at {STOP_STEP} and resumed, {how}{compiled}")


def _trainer_tokens_per_s(run: Path, warmup: int) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r.get("step", 0) > warmup and r.get("tokens_per_s") is not None]
    return statistics.median(r["tokens_per_s"] for r in timed) if timed else 0.0


def throughput(data: Path, runs: Path, cpu: bool, steps: int, warmup: int) -> dict[str, Any]:
    """The trainer against the reference loop, one device, the same shape and batch."""
    from aura_hpc.ops.reference_loop import flops_per_token, peak_for

    if cpu:
        shape = {"n_layer": 2, "n_embd": 64, "n_head": 2, "seq_len": 64, "batch": 4, "vocab": 1024}
    else:
        shape = {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq_len": 1024, "batch": 16, "vocab": 50304}
    s = shape
    sets = [
        f"model.n_layer={s['n_layer']}", f"model.n_embd={s['n_embd']}", f"model.n_head={s['n_head']}",
        f"model.n_positions={s['seq_len']}", f"data.seq_len={s['seq_len']}", f"train.batch_size={s['batch']}",
        f"model.padded_vocab_size={s['vocab']}", f"train.max_steps={steps}", f"train.log_every={warmup // 2 or 1}",
        "train.eval_every=0", "train.checkpoint_every=0", "train.sample_every=0", "train.allow_oversubscription=true",
        f"data.path={data}",
    ]  # fmt: skip
    args = ["--nproc-per-node", "1", "--output-dir", str(runs), "--run-name", "throughput"]
    for kv in sets:
        args += ["--set", kv]
    r = _local(args, _env({}, 2 if cpu else 0), 3600)
    if r.returncode != 0:
        raise LaunchError(f"the trainer's throughput run failed: {_last_line(r)} (fix: see {runs / 'throughput' / 'logs'})")
    trainer = _trainer_tokens_per_s(runs / "throughput", warmup)
    n_params = int(json.loads((runs / "throughput" / "summary.json").read_text())["n_params"])
    cmd = [sys.executable, "-m", "aura_hpc.ops.reference_loop", "--n-layer", str(s["n_layer"]), "--n-embd", str(s["n_embd"])]
    cmd += ["--n-head", str(s["n_head"]), "--seq-len", str(s["seq_len"]), "--vocab", str(s["vocab"]), "--batch-size", str(s["batch"])]
    cmd += ["--steps", str(steps), "--warmup-steps", str(warmup)] + (["--device", "cpu", "--no-compile"] if cpu else [])
    ref = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=_env({}, 2 if cpu else 0))
    if ref.returncode != 0:
        raise LaunchError(f"the reference loop failed: {_last_line(ref)} (fix: check this node's torch and GPU)")
    reference = float(json.loads(ref.stdout.strip().splitlines()[-1])["tokens_per_s"])
    out: dict[str, Any] = {
        "shape": f"{s['n_layer']} layers x {s['n_embd']}, {s['batch']}x{s['seq_len']} tokens, vocab {s['vocab']}",
        "trainer_tokens_per_s": round(trainer),
        "reference_tokens_per_s": round(reference),
        "ratio": round(trainer / reference, 3) if reference else None,
    }
    if not cpu:
        import torch

        peak = peak_for(torch.cuda.get_device_name(0))
        fpt = flops_per_token(n_params, s["n_layer"], s["n_embd"], s["seq_len"])
        if peak:
            out["mfu_trainer"] = round(trainer * fpt / (peak * 1e12), 4)
            out["mfu_reference"] = round(reference * fpt / (peak * 1e12), 4)
            out["peak_tflops"] = peak
    return out


def screen_node(out: Path, cpu: bool, gpus: int, profile: str, expected: dict[str, float], progress: Any) -> tuple[int, dict[str, Any]]:
    """`selftest --screen`: the pre-flight screen alone on this node's GPUs (a `local` run with
    health.screen=only and the profile's expected figures); (its exit status, RUN_DIR/screen/attempt-0.json)."""
    import torch

    if not cpu and not torch.cuda.is_available():
        raise LaunchError("selftest --screen needs a CUDA GPU and none is visible here (fix: run it on a GPU node, or --cpu)")
    nproc = 2 if cpu else (gpus or torch.cuda.device_count())
    # On CPU the profile's GPU figures mean nothing: the processes are judged against each other only.
    figures = [] if cpu else [x for k, v in expected.items() for x in ("--set", f"health.{k}={v}")]
    data = out / "data"
    progress(f"preparing the built-in corpus in {data}")
    from aura_hpc.data.prepare import PrepareSpec, prepare

    prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=1024, val_fraction=0.05))
    runs = out / f"screen-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    progress(f"screening {nproc} {'process' if cpu else 'GPU'}{'es' if cpu and nproc > 1 else 's' if nproc > 1 else ''}")
    args = ["--nproc-per-node", str(nproc), "--output-dir", str(runs), "--run-name", "screen", "--set", f"data.path={data}"]
    args += ["--set", "health.screen=only", "--set", f"slurm.cluster={profile}", *figures]
    done = _local(args, _env({}, 1 if cpu else 0), 600)
    result = runs / "screen" / "screen" / "attempt-0.json"  # RUN_DIR/screen/
    if not result.exists():
        raise LaunchError(f"the screen did not run: {_last_line(done)}")
    return done.returncode, json.loads(result.read_text())


def run(out: Path, cpu: bool, gpus: int, strategies: list[str], bench: bool, progress: Any) -> Report:
    import torch

    if not cpu and not torch.cuda.is_available():
        raise LaunchError(
            "selftest needs a CUDA GPU and none is visible here (fix: run it on a GPU node, e.g. `srun --gpus=1 python -m "
            "aura_hpc selftest`, or --cpu for a smoke run of the sequence)"
        )
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    nproc = 2 if cpu else (gpus or torch.cuda.device_count())
    report = Report(device, torch.__version__)
    out.mkdir(parents=True, exist_ok=True)
    from aura_hpc.data.prepare import PrepareSpec, prepare

    data = out / "data"
    progress(f"preparing the built-in corpus in {data}")
    prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=1024, val_fraction=0.05))
    runs = out / f"runs-{int(time.time())}"
    model = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2", "--set", "data.seq_len=64"]
    if not cpu:
        model = ["--set", "model.n_layer=4", "--set", "model.n_embd=256", "--set", "model.n_head=4", "--set", "data.seq_len=256"]
    for strategy in strategies:
        if strategy in BETWEEN_RANKS and nproc < 2:
            progress(f"{strategy}: not run (it works between ranks: needs 2 GPUs or more)")
            continue
        progress(f"{strategy}: {END_STEP} steps with a NaN at step {NAN_STEP}, a stop at {STOP_STEP} and a resume")
        report.checks.append(contract(strategy, data, runs, nproc, model, cpu))
        c = report.checks[-1]
        progress(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    if bench:
        progress("throughput: the trainer against the reference loop on one device")
        try:
            report.throughput = throughput(data, runs, cpu, 12 if cpu else 60, 4 if cpu else 20)
        # After every contract run (up to an hour each): their results are still written, whatever the benchmark
        # raised (a reference loop past its hour, a run that left no summary.json, an empty answer).
        except Exception as exc:
            why = str(exc) if isinstance(exc, LaunchError) else f"{type(exc).__name__}: {one_line(str(exc))[:300]}"
            report.checks.append(Check("throughput", False, why))
            progress(f"FAIL throughput: {why}")
    (out / "selftest.json").write_text(json.dumps(asdict(report), indent=1))
    return report
