"""Pre-flight screening (ops/screen.py, train/loop/screening.py): the judgement on figures, and a real
screen of two processes, one of them made slow (AURA_FAULT_SCREEN_SLOW). A Slurm job that leaves out
the node its screen named: tests/test_slurm.py."""

from __future__ import annotations

import json
from pathlib import Path

from aura_hpc.errors import EXIT_SCREEN
from aura_hpc.ops.screen import Expected, judge
from tests.conftest import free_port, run_cli


def _rows(gemm: list[float], node_gbps: list[float] | None = None, job: float | None = None) -> list[dict]:
    rows: list[dict] = [{"rank": r, "gemm_tflops": g} for r, g in enumerate(gemm)]
    for r, v in enumerate(node_gbps or []):
        rows[r]["node_gbps"] = v
    if job is not None:
        for row in rows:
            row["job_gbps"] = job
    return rows


def test_a_device_or_node_below_the_profile_or_its_peers_is_named_and_a_slow_fabric_only_said() -> None:
    h100 = Expected(gemm_tflops=790, allreduce_gbps=440, inter_gbps=370)
    hosts = ["gpu01", "gpu01", "gpu02", "gpu02"]
    # Healthy figures: nothing to say.
    findings, fabric, warning = judge(_rows([780, 790, 770, 785], [450, 451, 460, 458], job=380), hosts, h100, "h100-ib")
    assert findings == [] and fabric == "all-reduce across the 2 nodes 380 GB/s bus bandwidth" and warning == ""
    # One GPU at 600 (under 0.8 x 790 = 632, though not under 0.75 of its peers): its node is named, with why.
    findings, _, _ = judge(_rows([780, 790, 600, 785]), hosts, h100, "h100-ib")
    assert [f.node for f in findings] == ["gpu02"]
    assert findings[0].line == "rank 2 on gpu02: matmul 600 TFLOP/s, under 0.8 x the 790 that profile h100-ib expects"
    # No figures (the generic profile, CPU): only against the peers; a slow NVLink names its node.
    findings, _, warning = judge(_rows([1.0, 1.0, 0.4, 1.0], [400, 400, 150, 150], job=200), hosts, Expected(), "generic")
    assert [f.node for f in findings] == ["gpu02", "gpu02"] and warning == ""
    assert "under 0.75 x the other devices' median 1" in findings[0].line
    assert findings[1].line == "gpu02: all-reduce within the node 150 GB/s bus bandwidth, under 0.75 x the other nodes' median 400"
    # A fabric under its figure names no one node: it is said, with the fix.
    findings, _, warning = judge(_rows([780, 790, 770, 785], job=120), hosts, h100, "h100-ib")
    assert findings == [] and warning.startswith("the fabric is slow: 120 GB/s is under 0.8 x the 370 that profile h100-ib expects")


def test_a_device_is_named_only_when_slow_in_both_measurements() -> None:
    """Before a node is named the screen measures again, each figure the better of the two: a clean device
    that met interference once (seen on the loaded CI machine: 0.0707 against a median of 0.0999) is not
    named; a slow one is slow in both."""
    from aura_hpc.ops.screen import better

    hosts = ["n3", "n4"]
    first, second = _rows([0.0999, 0.0707], job=0.48), _rows([0.0950, 0.0990], job=0.52)
    assert [f.node for f in judge(first, hosts, Expected(), "generic")[0]] == ["n4"]
    merged = [better(a, b) for a, b in zip(first, second, strict=True)]
    assert merged == [{"rank": 0, "gemm_tflops": 0.0999, "job_gbps": 0.52}, {"rank": 1, "gemm_tflops": 0.099, "job_gbps": 0.52}]
    assert judge(merged, hosts, Expected(), "generic")[0] == []
    slow = [better(a, b) for a, b in zip(first, _rows([0.0950, 0.0400], job=0.5), strict=True)]
    assert [f.node for f in judge(slow, hosts, Expected(), "generic")[0]] == ["n4"]


def test_nodes_that_share_their_cpus_are_judged_against_their_peers_at_the_share_asked() -> None:
    """health.screen_peer_fraction: a Slurm test node on the loaded CI machine measured 0.0191 against its
    peer's 0.0342 in both measurements (2026-11-29), under the default 0.75; at 0.3 only a device idle most
    of its time is named."""
    hosts = ["n3", "n4"]
    shared = _rows([0.0191, 0.0342], job=1.2)
    assert [f.node for f in judge(shared, hosts, Expected(), "generic")[0]] == ["n3"]
    lenient = Expected(peer_fraction=0.3)
    assert judge(shared, hosts, lenient, "generic")[0] == []
    [finding] = judge(_rows([0.0342, 0.0034], job=1.2), hosts, lenient, "generic")[0]
    assert finding.line == "rank 1 on n4: matmul 0.0034 TFLOP/s, under 0.3 x the other devices' median 0.0342"


def _time_my_matmuls(rank: int, port: int, node_ranks: list[list[int]], result_path: str) -> None:
    """One of two gloo ranks: the screen's measurement, its matmuls replaced by a 0.4 s wait that notes when it ran."""
    import time

    import torch
    import torch.distributed as dist

    from aura_hpc.comm import collectives
    from aura_hpc.ops import screen

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collectives.set_world(torch.device("cpu"))
    when: list[float] = []

    def matmuls(device: torch.device, min_s: float, slow_fraction: float = 0.0) -> float:
        when.append(time.time())
        time.sleep(0.4)
        when.append(time.time())
        return 1.0

    screen.gemm_tflops = matmuls
    row = screen.measure(torch.device("cpu"), node_ranks, rank)
    Path(result_path).write_text(json.dumps({"when": when, "row": row}))
    dist.barrier()
    dist.destroy_process_group()


def test_the_ranks_of_one_cpu_node_time_their_matmuls_in_turn(tmp_path: Path) -> None:
    """Two clean ranks of one busy 2-core machine, timed together, measured 0.70 x of each other (the
    scheduler's split of the cores, not a device) and the clean screen named one. A CPU node's ranks
    take turns; what follows (the node's all-reduce) still has both."""
    import multiprocessing as mp

    port = free_port()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_time_my_matmuls, args=(r, port, [[0, 1]], str(tmp_path / f"r{r}.json"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert r0["when"][1] <= r1["when"][0], (r0, r1)  # rank 0's turn ended before rank 1's began
    assert r0["row"]["gemm_tflops"] == r1["row"]["gemm_tflops"] == 1.0 and "node_gbps" in r0["row"] and "node_gbps" in r1["row"]


def test_selftest_screen_names_the_slow_process_and_a_clean_screen_names_none(tmp_path: Path) -> None:
    out = tmp_path / "st"  # one folder: the second screen finds the corpus prepared
    # On 2 cores shared with the suite's other worker, a clean screen measured rank 1 at 0.6 x rank 0 twice (its own
    # second look included) once in CI: a clean machine passes one of three screens; the slow one fails each of them.
    screens, clean = 1, run_cli(["selftest", "--screen", "--cpu", "--out", str(out)], timeout=300)
    while clean.returncode != 0 and screens < 3:
        screens, clean = screens + 1, run_cli(["selftest", "--screen", "--cpu", "--out", str(out)], timeout=300)
    assert clean.returncode == 0 and "FINDING" not in clean.stdout, clean.stdout[-3000:] + clean.stderr[-3000:]
    slow = run_cli(["selftest", "--screen", "--cpu", "--out", str(out)], timeout=300, AURA_FAULT_SCREEN_SLOW="1:0.6")
    assert slow.returncode == EXIT_SCREEN, slow.stdout[-3000:] + slow.stderr[-3000:]
    kept = sorted(out.glob("screen-*/screen/screen/attempt-0.json"), key=lambda p: p.stat().st_mtime)
    assert len(kept) == screens + 1, kept
    found = json.loads(kept[-1].read_text())
    assert [d["rank"] for d in found["devices"]] == [0, 1] and all("node_gbps" in d for d in found["devices"]), found
    assert len(found["findings"]) == 1 and found["findings"][0]["line"].startswith("rank 1 on "), found
    assert "FINDING" in slow.stdout and "under 0.75 x the other devices' median" in slow.stdout
