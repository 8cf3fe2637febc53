"""Training over slow links (issue 21): DiLoCo (replicas that meet every dist.sync_every steps) and
compressed DDP (dist.compress: bf16, PowerSGD), on 2 CPU ranks with gloo. Their extra state (the
anchor, the outer momentum, each replica's weights and AdamW moments, PowerSGD's error feedback)
is checkpointed: a killed DiLoCo, bf16 or PowerSGD run resumes to the same bits, DiLoCo between
meetings as well as at one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_MODEL, cli_env, final_weights, free_port, max_diff, run_cli

pytestmark = pytest.mark.slow

BASE = [*SMALL_MODEL, "--set", "train.warmup_steps=2", "--set", "train.max_steps=20", "--set", "model.dropout=0.1"]


def _args(out: Path, name: str, prepared: Path, *extra: str) -> list[str]:
    return ["local", "--nproc-per-node", "2", "--output-dir", str(out), "--run-name", name, "--set", f"data.path={prepared}", *BASE, *extra]


def _together(runs: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Several CLI runs at once, each with its own environment (a fault for one run only)."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (args, env) in runs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        out[name] = subprocess.CompletedProcess(runs[name][0], p.returncode, stdout, stderr)
    return out


DILOCO = (
    "--set",
    "dist.strategy=diloco",
    "--set",
    "dist.diloco_replicas=2",
    "--set",
    "dist.sync_every=4",
    "--set",
    "train.checkpoint_every=6",
    # Written before the next step: a kill two steps after a checkpoint must find it complete (in the
    # background a slow write loses the race and the run rightly resumes from the one before).
    "--set",
    "train.async_checkpoint=false",
)


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_overlapped_meetings_resume_bit_identical_with_a_meeting_in_flight(tmp_path: Path, prepared: Path, wire: str) -> None:
    """dist.diloco_overlap=3: the meetings begun at steps 4, 8, 12, 16 cross in 3 portions and land at
    7, 11, 15, 19 (the last, 20, is a plain meeting). The checkpoints at 6, 12 and 18 each hold a
    meeting in flight (2, 0 and 2 portions arrived). Killed after step 9 the run resumes from 6, after
    step 14 from 12: each rank sends its portion in flight again, and the weights end bit-identical.
    (bf16, the default wire, is resumed with portions in flight; int8's gathered codes at both points.)"""
    overlap = (*DILOCO, "--set", "dist.diloco_overlap=3", "--set", f"dist.diloco_wire={wire}")
    runs = {
        f"ov-{wire}": (_args(tmp_path, f"ov-{wire}", prepared, *overlap, "--set", "train.keep_last=5"), {}),
        f"ov-{wire}-mid": (_args(tmp_path, f"ov-{wire}-mid", prepared, *overlap, "--max-restarts", "1"), {"AURA_FAULT_KILL": "1:9"}),
    }
    if wire == "int8":
        runs[f"ov-{wire}-meeting"] = (
            _args(tmp_path, f"ov-{wire}-meeting", prepared, *overlap, "--max-restarts", "1"),
            {"AURA_FAULT_KILL": "0:14"},
        )
        runs[f"blocking-{wire}"] = (_args(tmp_path, f"blocking-{wire}", prepared, *DILOCO, "--set", f"dist.diloco_wire={wire}"), {})
    done = _together(runs)
    for name, r in done.items():
        assert r.returncode == 0, (name, r.stdout[-3000:], r.stderr[-3000:])
    assert "each meeting crossing during 3 steps" in done[f"ov-{wire}"].stdout
    assert "resumed from checkpoint step_00000006 at step 6" in done[f"ov-{wire}-mid"].stdout
    straight = final_weights(tmp_path / f"ov-{wire}")
    assert max_diff(final_weights(tmp_path / f"ov-{wire}-mid"), straight) == 0.0
    if wire == "int8":
        assert "resumed from checkpoint step_00000012 at step 12" in done[f"ov-{wire}-meeting"].stdout
        assert max_diff(final_weights(tmp_path / f"ov-{wire}-meeting"), straight) == 0.0
        # The overlap changes the training (the outer steps land 3 steps late), not whether it trains.
        assert max_diff(final_weights(tmp_path / f"blocking-{wire}"), straight) > 0.0
    from aura_hpc.train.checkpoint.diloco_files import read_replica

    root = tmp_path / f"ov-{wire}" / "checkpoints"
    for step, arrived in ((6, 2), (12, 0), (18, 2)):
        meta = json.loads((root / f"step_{step:08d}" / "meta.json").read_text())
        states = [read_replica(root, meta["replica_files"][str(rank)]) for rank in (0, 1)]
        meetings = [s["meeting"] for s in states if s is not None]
        assert len(meetings) == 2 and all(m["done"] == arrived and m["since"] == step - step % 4 for m in meetings), step
        # What each rank sent differs (its own delta); what arrived of it is the same on both.
        assert not torch.equal(meetings[0]["mine"], meetings[1]["mine"])
        assert all(torch.equal(a, b) for a, b in zip(meetings[0]["arrived"], meetings[1]["arrived"], strict=True))
    meta = json.loads((root / "step_00000020" / "meta.json").read_text())
    final = [read_replica(root, meta["replica_files"][str(rank)]) for rank in (0, 1)]
    assert all(s is not None and "meeting" not in s for s in final)
    w0, w1 = (s["model"] for s in final if s is not None)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "the run ends on the replicas' common weights"


def test_diloco_skips_a_nan_or_one_replicas_inf_gradient_on_every_rank_and_its_replicas_differ_between_meetings(
    tmp_path: Path, prepared: Path
) -> None:
    """A NaN loss on rank 1 at step 3, and at step 5, a logged step, an inf in rank 1's gradients alone:
    each replica has a gradient norm of its own, and only rank 1's is not finite. Every rank skips both
    updates and logs alike (before: rank 0 logged step 5, a collective rank 1 skipped, and the run hung)."""
    args = _args(tmp_path, "nan", prepared, *DILOCO, "--set", "train.stop_at=6", "--set", "train.log_every=5")
    r = run_cli(args, timeout=600, AURA_FAULT_NAN="1:3:1", AURA_FAULT_GRADINF="1:5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "non-finite loss or gradient on rank(s) [1] at step 3: update skipped" in r.stdout
    assert "non-finite loss or gradient on rank(s) [1] at step 5: update skipped (1 in a row)" in r.stdout, r.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert 5 not in [row["step"] for row in rows], rows
    from aura_hpc.train.checkpoint.diloco_files import read_replica

    meta = json.loads((tmp_path / "nan" / "checkpoints" / "step_00000006" / "meta.json").read_text())
    root = tmp_path / "nan" / "checkpoints"
    states = [read_replica(root, meta["replica_files"][str(rank)]) for rank in (0, 1)]
    assert all(s is not None for s in states)
    w0, w1 = (s["model"]["transformer.wte.weight"] for s in states if s is not None)
    assert not torch.equal(w0, w1)  # step 6 lies between the meetings at 4 and 8: each replica went its own way


def test_int8_codes_decode_within_half_a_step_of_their_block() -> None:
    from aura_hpc.train.strategies.diloco import INT8_BLOCK, dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(0)
    n = 3 * INT8_BLOCK + 17  # a partial last block
    x = torch.randn(n, generator=g) * torch.logspace(-4, 1, n)  # blocks of very different magnitudes
    x[:INT8_BLOCK] = 0.0  # an all-zero block decodes to zeros
    buf = quantize_int8(x)
    assert buf.dtype == torch.uint8 and buf.numel() == 4 * INT8_BLOCK + 4 * 4  # one byte a value, a scale a block
    y = dequantize_int8(buf, n)
    assert torch.equal(y[:INT8_BLOCK], torch.zeros(INT8_BLOCK))
    for b in range(1, 4):
        block = slice(b * INT8_BLOCK, min(n, (b + 1) * INT8_BLOCK))
        step = x[block].abs().max() / 127
        assert (y[block] - x[block]).abs().max() <= step / 2 * 1.0001
    assert torch.equal(quantize_int8(x.clone()), buf), "the same values give the same bytes on every replica"


def _meet_in_slices(rank: int, port: int, result_path: str) -> None:
    """One of two gloo ranks: a meeting of 3 portions, int8 (all_gather) and fp32 (all_reduce)."""
    import torch.distributed as dist

    from aura_hpc.train.process import distributed
    from aura_hpc.train.strategies.diloco import Meeting

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank)
    slices: list[int] = []
    report: dict[str, object] = {"slices": slices}
    codes, floats = torch.randint(0, 256, (200_001,), generator=g, dtype=torch.uint8), torch.randn(50_001, generator=g)
    for int8, mine in ((True, codes), (False, floats)):
        m = Meeting(0, 3, mine, [], None, 2, int8)
        while m.done < m.portions:
            m.send_next()
            slices.append(len(m.work or []))
            m.arrived()
        report["int8" if int8 else "fp32"] = [o.tolist()[:3] + o.tolist()[-3:] for o in m.out]
        report[f"{'int8' if int8 else 'fp32'}_sum"] = [float(o.double().sum()) for o in m.out]
    torch.save(report, result_path)
    dist.barrier()  # torch 2.6's gloo could hang in destroy_process_group when a peer had already left
    distributed.shutdown()  # and when its worker thread was still freeing a finished work


def test_a_meeting_crosses_in_slices_that_keep_a_slow_queue_short(tmp_path: Path) -> None:
    """Each portion goes as collectives of at most SLICE_BYTES, issued together; what arrives is every
    replica's whole payload (int8's all_gather) or their exact sum (fp32's all_reduce)."""
    import torch.multiprocessing as mp

    from aura_hpc.train.strategies.diloco import SLICE_BYTES, blocking_portions

    port = free_port()
    procs = [mp.get_context("spawn").Process(target=_meet_in_slices, args=(r, port, str(tmp_path / f"r{r}.pt"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for r, p in enumerate(procs):
        p.join(120)
        if p.is_alive():  # stuck in gloo's teardown after writing its report (seen with torch 2.6): not what is tested here
            p.kill()
            assert (tmp_path / f"r{r}.pt").exists(), f"rank {r} hung before its meeting ended"
        else:
            assert p.exitcode == 0
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    # int8: 200,001 bytes in 3 portions of 66,667: 3 slices each; fp32: 50,001 values (200,004 bytes), the same.
    assert r0["slices"] == [3, 3, 3, 3, 3, 3] == r1["slices"]
    g = [torch.Generator().manual_seed(r) for r in (0, 1)]
    payload = [torch.randint(0, 256, (200_001,), generator=gen, dtype=torch.uint8) for gen in g]
    floats = [torch.randn(50_001, generator=gen) for gen in g]
    for r in (r0, r1):
        assert r["int8"] == [p.tolist()[:3] + p.tolist()[-3:] for p in payload]
        assert r["int8_sum"] == [float(p.double().sum()) for p in payload]
        total = floats[0] + floats[1]
        assert r["fp32"] == [total.tolist()[:3] + total.tolist()[-3:]]
        assert r["fp32_sum"] == [float(total.double().sum())]
    assert SLICE_BYTES == 32 * 1024
    assert blocking_portions(torch.empty(3_500_000, dtype=torch.uint8)) == 107  # bench_lan's int8 meeting: 32 KiB each
    assert blocking_portions(torch.empty(10, dtype=torch.uint8)) == 1
    assert blocking_portions(torch.empty(1 << 30, dtype=torch.uint8)) == 1024  # beyond 32 MB the portions grow
    # On NCCL no slicing (no TCP queue to keep short; each collective costs a launch): one portion, one collective.
    assert blocking_portions(torch.empty(3_500_000, dtype=torch.uint8), sliced=False) == 1


@pytest.mark.parametrize("compress", ["bf16", "powersgd"])
def test_compressed_ddp_trains_and_resumes_bit_identical(tmp_path: Path, prepared: Path, compress: str) -> None:
    """PowerSGD compresses from step 10 (before: plain all-reduce); killed after step 14, the run resumes
    from step 10 with each rank's error feedback and warm-start factors, to the same bits: PowerSGD keeps
    that state per DDP bucket, and without DdpWrapped.warm_up a resumed process's first step was grouped
    in one bucket (DDP's first backward) where the run it continues had regrouped them."""
    extra = ("--set", f"dist.compress={compress}", "--set", "train.checkpoint_every=10", "--set", "train.eval_every=10")
    # 128 wide: DDP's gradients in two buckets (its first is 1 MB), and PowerSGD's collectives for each. On gloo a
    # bucket's later collectives are issued from the completion thread: the ranks issued them in another order
    # than each other, and gloo stopped the run at its first compressed step (the one-bucket 64-wide model passed).
    extra += ("--set", "model.n_embd=128", "--set", "model.n_head=4")
    # PowerSGD: one NaN once compression runs (it went into every rank's error feedback and factors), in both runs; the
    # killed one's restart meets it again after its resume from step 10 (a fault fires once per process).
    nan = {"AURA_FAULT_NAN": "1:12:1"} if compress == "powersgd" else {}
    runs = {
        "straight": (_args(tmp_path, "straight", prepared, *extra), nan),
        "killed": (_args(tmp_path, "killed", prepared, *extra, "--max-restarts", "1"), {**nan, "AURA_FAULT_KILL": "1:14"}),
    }
    done = _together(runs)
    straight, killed = done["straight"], done["killed"]
    for r in (straight, killed):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if nan:  # skipped once, then training goes on (every later step was NaN: rollbacks, exit 3)
        assert "update skipped (1 in a row)" in straight.stdout and "2 in a row" not in straight.stdout, straight.stdout[-3000:]
    assert f"gradients compressed: {compress}" in straight.stdout
    assert "resumed from checkpoint step_00000010 at step 10" in killed.stdout
    diff = max_diff(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight"))
    assert diff == 0.0, diff
    evals = [json.loads(line).get("eval_loss") for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e is not None]
    assert len(evals) == 2 and evals[-1] < evals[0]
    if compress == "powersgd":
        # Resumed under DiLoCo (a replica per rank): each rank's file holds PowerSGD's error feedback, not a replica's
        # weights and moments. Loading it failed on a missing key; the replicas now start from the checkpoint's weights.
        r = run_cli(_args(tmp_path, "straight", prepared, *extra, *DILOCO, "--set", "dist.compress=none", "--set", "train.max_steps=24"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "the per-rank state of rank(s) [0, 1] is missing or does not match" in r.stdout, r.stdout[-3000:]
        assert "all 2 ranks finished at step 24" in r.stdout


def test_slow_link_settings_that_cannot_work_are_refused_before_launch(tmp_path: Path) -> None:
    cases = [
        (["--set", "dist.strategy=fsdp", "--set", "dist.compress=powersgd"], "compresses DDP's gradient all-reduce"),
        (["--set", "dist.strategy=diloco", "--set", "dist.outer_momentum=1.5"], "dist.outer_momentum in [0, 1)"),
        (["--set", "dist.strategy=diloco", "--set", "dist.sync_every=0"], "dist.sync_every must be at least 1"),
        (["--set", "dist.compress=powersgd", "--set", "dist.powersgd_rank=0"], "dist.powersgd_rank must be between 1 and 1024"),
        (
            ["--set", "dist.strategy=diloco", "--set", "dist.sync_every=40", "--set", "dist.diloco_overlap=40"],
            "a meeting must land before the next begins (fix: --set dist.diloco_overlap=4)",
        ),
    ]
    for extra, needle in cases:
        r = run_cli(["local", "--output-dir", str(tmp_path / "runs"), *extra], timeout=60)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "fix" in lines[0], r.stderr


def test_link_advice_hides_a_slow_meeting_behind_a_tenth_of_the_interval() -> None:
    """At 10 Mbit/s a 3.5M-parameter meeting (int8) takes ~3 s, ~11 steps of 0.26 s: the advice
    overlaps it for a tenth of sync_every=80 (8 steps), expects fewer exposed seconds than a waited
    meeting, and names the setting; a configured overlap is what the diloco row then assumes."""
    from aura_hpc.config import RunConfig
    from aura_hpc.ops import link_advice

    def config(**dist: object) -> RunConfig:
        cfg = RunConfig()
        cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 4, 256, 4
        cfg.data.seq_len, cfg.train.batch_size = 128, 8
        cfg.dist.strategy, cfg.dist.sync_every, cfg.dist.diloco_wire = "diloco", 80, "int8"
        for k, v in dist.items():
            setattr(cfg.dist, k, v)
        return cfg

    link = link_advice.Link(nodes=2, bandwidth=10e6 / 8, latency=3e-4)
    opts = link_advice.options(config(), 8192, link, compute_s=0.26)
    waited, overlapped = opts[3], opts[4]
    assert "dist.diloco_overlap" not in waited.setting and overlapped.setting.endswith("--set dist.diloco_overlap=8")
    assert overlapped.comm_s < waited.comm_s and link_advice.recommend(opts) is overlapped
    mine = link_advice.options(config(diloco_overlap=8), 8192, link, compute_s=0.26)
    assert len(mine) == 4 and mine[3].setting.endswith("--set dist.diloco_overlap=8")
    assert mine[3].comm_s == overlapped.comm_s
    # Timings that disagree are said to (the advice of one busy moment contradicted `check`'s).
    busy = link_advice.Link(nodes=2, bandwidth=10e6 / 8, latency=3e-4, spread=2.4)
    assert "(uncertain: three timings differed 2.4x" in link_advice.advice(opts, busy)
    assert "uncertain" not in link_advice.advice(opts, link)


MEETING_WAITS = """
import json, sys, time, torch, torch.distributed as dist
from aura_hpc.comm import collectives
from aura_hpc.train.process import distributed, progress
from aura_hpc.train.strategies.diloco import Meeting

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
collectives.set_world(torch.device("cpu"))
seen = []
progress.current().on_enter.append(lambda section, step: seen.append(section))
# What a GPU's host wait would be: when it comes, and in which section (on CPU it does nothing).
collectives.synchronize = lambda device: seen.append("host wait in " + progress.SECTIONS[progress.current().section_index])
events = {}
m = Meeting(4, 2, torch.full((1000,), float(rank + 1)), [], collectives.world(), 2, False)
if rank == 1:
    time.sleep(2.0)  # rank 1's portion comes late: rank 0 waits for it
m.send_next()
events["late"] = (m.landed(False, torch.device("cpu")), seen[:])
seen.clear()
m.send_next()
deadline = time.monotonic() + 60
while rank == 0 and not m.in_time() and time.monotonic() < deadline:
    time.sleep(0.05)  # here by now, as a portion that crossed during its step
events["in time"] = (m.landed(False, torch.device("cpu")), seen[:], m.out[0][0].item())
seen.clear()
m = Meeting(8, 3, torch.ones(1000), [], collectives.world(), 2, False)
m.send_next()
events["last"] = (m.landed(True, torch.device("cpu")), seen[:], m.done)
print(json.dumps(events))
distributed.shutdown()  # not destroy_process_group alone: torch < 2.8's gloo could deadlock there (CI's floor, once)
"""


def test_a_late_portion_of_a_meeting_is_waited_for_in_the_meeting_on_the_host() -> None:
    """An overlapped meeting's portion not yet here when its step comes (a slow link) is waited for in the
    "meeting" section (the watchdog allows a meeting longer than a step) and on the host (on a GPU, a
    collective's wait() only makes the stream wait: the host went on and blocked in the next step, where
    a 30 s step floor declared a hang). A portion already here costs no section and no host wait; the
    last step's meeting is waited for whole, in the section. Two gloo ranks, real portions."""
    port = free_port()
    procs = []
    for r in (0, 1):
        cmd = [sys.executable, "-c", MEETING_WAITS, str(r), str(port)]
        procs.append(subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    events = json.loads(outs[0][0].strip().splitlines()[-1])
    assert events["late"] == [False, ["meeting", "host wait in meeting", "step"]], events
    assert events["in time"] == [True, [], 3.0], events
    assert events["last"] == [True, ["meeting", "host wait in meeting", "step"], 3], events


def test_diloco_resumed_from_a_checkpoint_without_an_outer_state_meets_from_its_weights(tmp_path: Path) -> None:
    """A DDP checkpoint resumed under DiLoCo (a warm start, as the paper's): the anchor stayed the weights the model
    was built with, and the first meeting moved every replica by the whole training so far again."""
    from aura_hpc.config.tree import DistConfig
    from aura_hpc.train.checkpoint.diloco_files import load_all
    from aura_hpc.train.model.gpt import GPT, GPTConfig
    from aura_hpc.train.strategies.diloco import DilocoWrapped

    model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    wrapped = DilocoWrapped(model, model, DistConfig(strategy="diloco"), [[0]], 0, None, None)
    wrapped.outer.state[wrapped.anchor[0]]["momentum_buffer"] = torch.ones_like(wrapped.anchor[0])
    with torch.no_grad():  # the checkpoint's weights, as Checkpointer.load copies them in
        for p in model.parameters():
            p.add_(1.0)
    load_all(wrapped, None, tmp_path, "step_00000010", {"world_size": 1}, {"scheduler": {}}, 0, 1)
    assert all(torch.equal(a, p.detach().float()) for a, p in zip(wrapped.anchor, model.parameters(), strict=True))
    assert not wrapped.outer.state
