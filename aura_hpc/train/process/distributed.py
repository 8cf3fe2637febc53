"""Joining the process group: the store every rank meets in, the run secret, the nodes' layout,
NCCL or gloo; agreement through the store; leaving. The collectives themselves: comm/collectives.py.

`join` runs first, in the worker, before anything is logged: it proves the run's secret, learns
which ranks share a node (launchers may start different numbers of processes per node) and numbers
the ranks node by node, in the order the user numbered the nodes (so node 0, the master, holds rank 0
and the checkpoints). `init_process_group` then makes the group over the same store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.comm import collectives, node_versions, stores
from aura_hpc.errors import EXIT_TRAIN_FAILED, LaunchError
from aura_hpc.errors import first_line as _first_line
from aura_hpc.ops.network import resolve
from aura_hpc.train.process import flight_dump, master_address
from aura_hpc.train.process.dist_env import DistEnv

log = logging.getLogger("aura_hpc")


def pick_device(env: DistEnv, backend: str) -> torch.device:
    if (backend == "nccl" or (backend == "auto" and torch.cuda.is_available())) and torch.cuda.is_available():
        seen = torch.cuda.device_count()
        if 1 < seen < env.local_world_size:
            # Each rank sees some of the node's GPUs (srun --gpu-bind=closest, a CUDA_VISIBLE_DEVICES per rank):
            # local_rank % seen put two ranks on one GPU, and NCCL stopped at "Duplicate GPU detected".
            raise LaunchError(
                f"rank {env.rank} sees {seen} GPUs for the {env.local_world_size} ranks of its node, so two would share one "
                "(fix: one rank per GPU: --nproc-per-node or --gpus no more than the node's GPUs; and every rank sees all the "
                "node's GPUs, or exactly one: no --gpu-bind=closest or SLURM_GPU_BIND, no CUDA_VISIBLE_DEVICES set per rank)"
            )
        return torch.device("cuda", env.local_rank % seen)
    return torch.device("cpu")


@dataclasses.dataclass
class _Rendezvous:
    store: Any
    prefix: str  # per attempt: a restarted attempt never reads the previous one's keys
    env: DistEnv
    key: bytes | None = None  # of the run's secret: what the ranks say in the store is signed with it


_RDZV: _Rendezvous | None = None


def _store(env: DistEnv, timeout: timedelta) -> Any:
    """The agent's store under torchrun (its rendezvous binds it), else one that rank 0 hosts."""
    if env.uses_agent_store or env.launcher_rank != 0:
        client = stores.client(master_address.dialled(env), env.master_port, timeout)
        if env.uses_agent_store and env.launcher_rank == 0:  # the agent's store outlives an attempt: NCCL's signals of the last
            stores.forget_nccl_signals(client, env.rank)
        return client
    addr = master_address.reached_at(env)
    try:
        return stores.bound_server(addr, env.master_port, timeout)
    except stores.StoreAddressInUse:
        fix = (
            "submit the same command again: the port comes from the job id, and a new job gets another"
            if env.launcher == "slurm"
            else "another MASTER_PORT, or stop the program using it"
        )
        raise LaunchError(f"port {env.master_port} on {addr} is already in use (fix: {fix})") from None
    except OSError as exc:  # after StoreAddressInUse, one of them
        if exc.errno != errno.EADDRNOTAVAIL or env.launcher != "slurm":
            raise
        raise LaunchError(
            f"rank 0 runs on {env.hostname}, and the master address {addr} is none of its addresses: srun ran on another "
            "node than task 0 (fix: submit without `#SBATCH --batch`, a front-end node or an arbitrary task layout)"
        ) from None


def run_secret(run_dir: Path) -> str | None:
    """The secret the ranks prove: handed down by the launcher, or kept in the run directory (Slurm)."""
    given = os.environ.get(stores.SECRET_ENV, "").strip()
    if given:
        return stores.strong_enough(given)  # torchrun started by hand with a secret of the user's
    try:
        return (run_dir / stores.SECRET_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def unproven(env: DistEnv, secret: str | None) -> str | None:
    """What rank 0 says when ranks met without a secret (torchrun started by hand; `local` and Slurm
    always hand one down) at an address other machines reach; None otherwise."""
    import ipaddress

    if secret or env.world_size == 1:
        return None
    ip = resolve(env.master_addr)
    if ip is None or ipaddress.ip_address(ip).is_loopback:
        return None
    return (
        f"this run has no secret ({stores.SECRET_ENV} unset, no {stores.SECRET_FILE} in the run directory): any machine "
        f"that reaches {env.master_addr}:{env.master_port} can take a rank's place (fix: start every node with "
        f"`python -m aura_hpc local`, which makes one, or export the same {stores.SECRET_ENV} on every node)"
    )


def join(env: DistEnv, run_dir: Path, timeout_s: float) -> DistEnv:
    """Meet the other ranks in the store, prove the run's secret, and take this rank's place in the
    nodes' layout. Returns the environment with the final rank and the ranks per node."""
    global _RDZV
    if env.launcher == "slurm" and (gloo := master_address.gloo_interface(env)):  # `local` set it from the route already
        os.environ["GLOO_SOCKET_IFNAME"] = gloo[0]
        if env.local_rank == 0:  # one line a node
            print(f"[rank{env.rank}] GLOO_SOCKET_IFNAME={gloo[0]}: {gloo[1]}", flush=True)
    if env.world_size == 1:  # a group of one: nothing to meet, nothing on the network
        _RDZV = _Rendezvous(dist.HashStore(), f"aura/attempt{env.restart_count}", env)
        return env
    try:
        store = _store(env, timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError, OSError) as exc:
        if isinstance(exc, LaunchError):
            raise
        where = master_address.dialled(env)
        raise LaunchError(
            # torch's elastic rendezvous puts this store on whichever node it ranks first (the address that sorts first
            # as text), not always node 0: on a LAN the machine named here is the one whose firewall to look at.
            f"cannot reach the workers' store on the machine at {where}:{env.master_port} ({_first_line(exc)}) (fix: "
            f"check that {where} still runs its launcher, and allow TCP between the nodes in both directions, "
            "in each machine's firewall; `python -m aura_hpc check`)"
        ) from None
    prefix = f"aura/attempt{env.restart_count}"
    secret = run_secret(run_dir)
    claims = None
    if secret:  # each rank's place is part of what it proves: a stranger cannot renumber the ranks
        try:
            claim = f"{env.node_rank},{env.local_rank}"
            claims = stores.prove(store, f"{prefix}/auth", env.launcher_rank, env.world_size, secret, timeout_s, claim=claim)
        except stores.NotProven as exc:
            raise LaunchError(str(exc)) from None
    env = _layout(store, prefix, env, timeout_s, claims)
    _RDZV = _Rendezvous(store, prefix, env, stores.key_of(secret) if secret else None)
    return env


def _layout(store: Any, prefix: str, env: DistEnv, timeout_s: float, claims: list[str] | None = None) -> DistEnv:
    """Ranks numbered node by node in the user's node order, and how many each node has. Every rank
    says (node, local rank) under its launcher rank: in its proof of the secret (`claims`), else in
    the store; all read all (nothing collective yet)."""
    if claims is None:
        store.set(f"{prefix}/layout/{env.launcher_rank}", f"{env.node_rank},{env.local_rank}")
        keys = [f"{prefix}/layout/{r}" for r in range(env.world_size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise LaunchError(f"not every rank reported within {timeout_s:.0f} s (fix: start every node; see the other nodes' logs)")
            time.sleep(0.02)
        try:
            claims = [store.get(k)[:64].decode("ascii", "replace") for k in keys]
        except RuntimeError:  # deleted between check and get
            raise LaunchError("the ranks' layout was deleted from the rendezvous store as it was read (fix: firewall its port)") from None
    seen: dict[tuple[int, int], int] = {}
    for r, said in enumerate(claims):
        if not re.fullmatch(r"\d{1,5},\d{1,5}", said):
            raise LaunchError("the rendezvous store holds a rank layout this aura_hpc did not write (fix: the same version on every node)")
        node, _, local = said.partition(",")
        where = (int(node), int(local))
        if where in seen:
            raise LaunchError(
                f"two processes say they are local rank {where[1]} of node {where[0]}: two machines were started with "
                f"--node-rank {where[0]} (fix: give every machine its own --node-rank, 0 only on the master)"
            )
        seen[where] = r
    order = sorted(seen)
    nodes = sorted({n for n, _ in order})
    sizes = tuple(sum(1 for n, _ in order if n == node) for node in nodes)
    rank = order.index((env.node_rank, env.local_rank))
    node_index = nodes.index(env.node_rank)
    return dataclasses.replace(env, rank=rank, node_sizes=sizes, node_rank=node_index, local_world_size=sizes[node_index])


# ---- the process group -------------------------------------------------------------------


def _nccl_problem(device: torch.device, env: DistEnv) -> str:
    """What keeps NCCL from starting on this rank, from local facts alone (nothing collective)."""
    from aura_hpc.train.instruments import faults

    injected = faults.backend_fails(env.rank)
    if injected:
        return injected
    if device.type != "cuda":
        return "no CUDA device"
    if not dist.is_nccl_available():
        return "this torch was built without NCCL"
    try:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    except Exception as exc:
        if "no kernel image" in str(exc).lower():  # no NCCL problem: a torch built without this GPU's kernels (a cu128 wheel, Pascal)
            return f"{NO_KERNELS}({_first_line(exc)})"
        return _first_line(exc)  # out of memory, a busy GPU, a fault: the training loop's GPU checks name them
    return ""


# What a rank whose GPU cannot run this torch's kernels says: every rank fell back to gloo, and that rank's first kernel
# then failed anyway (the others' GPUs idle behind gloo).
NO_KERNELS = "its GPU cannot run this torch's kernels "


def init_process_group(env: DistEnv, backend: str, device: torch.device, init_timeout_s: int, timeout_s: int) -> str:
    """Initialise the default group; returns the backend in use.

    With dist.backend=auto on GPUs, NCCL that cannot start on some rank makes every rank fall
    back to gloo together (logged as fallback=gloo); with dist.backend=nccl it is an error, never
    a silent switch. The ranks decide before any of them enters NCCL's set-up, which is collective
    (with device_id it connects every rank at once): one rank that cannot start it would otherwise
    leave the others waiting in it. Every group uses the one store `join` met in (a second TCPStore
    on the master port would fail with EADDRINUSE, seen under Slurm).
    """
    from aura_hpc.train.instruments import faults

    rdzv = _RDZV if _RDZV is not None and _RDZV.env.rank == env.rank else None
    if rdzv is None:
        join(env, Path("."), init_timeout_s)
        rdzv = _RDZV
    assert rdzv is not None
    global _AGREE
    _AGREE = (rdzv.store, f"{rdzv.prefix}/agree", env.rank, env.world_size, rdzv.key)
    simulated = faults.primary_backend()  # gloo plays NCCL's part (tests on CPU)
    timeout = timedelta(seconds=timeout_s)
    group_store = dist.PrefixStore(f"{rdzv.prefix}/pg", rdzv.store)
    if env.world_size > 1:
        nccl = backend != "gloo" and device.type == "cuda"
        said = node_versions.of_this_process(env.node_rank, socket.gethostname(), nccl, faults.torch_version(env.rank))
        answers = _answers("versions", json.dumps(said), init_timeout_s, "waiting for every rank to say what it runs")
        if isinstance(answers, str):  # a rank that never said: one gone, or one that runs another aura_hpc
            raise LaunchError(f"{answers} (fix: the same aura_hpc on every node; a node's log says why a rank stopped)")
        differs, versions_differ = node_versions.mismatch(answers)
        if versions_differ and not (differs == "nccl" and backend == "auto"):
            raise LaunchError(versions_differ)  # (NCCL alone under auto: every rank says it cannot start it, below)
    else:
        versions_differ = ""
    if backend == "gloo" and not simulated:
        return _gloo(group_store, env, device, timeout)
    # Every rank says whether it can start NCCL here, from local facts (a CPU-only node among GPU
    # ones included): all decide alike before any enters anything collective.
    if simulated:
        problem = faults.backend_fails(env.rank) or (f"{NO_KERNELS}(fault injection)" if faults.backend_fails(env.rank, "device") else "")
    else:
        problem = _nccl_problem(device, env)
    problem = problem or versions_differ
    failed = agree("backend-ready", problem, init_timeout_s, waiting="waiting for every rank to say whether NCCL can start")
    if broken := [f for f in failed if NO_KERNELS in f]:
        raise LaunchError(
            f"{broken[0]} (fix: on that machine, a torch build with kernels for its GPU: torch's warning in its log names one; "
            "or --backend gloo on every node, which trains on the CPUs)"
        )
    if not simulated and backend == "auto" and len(failed) == env.world_size and all(f.endswith(": no CUDA device") for f in failed):
        return _gloo(group_store, env, device, timeout)  # no GPU anywhere: gloo, nothing to say
    wanted = simulated or "nccl"
    if not failed:
        error = _connect(wanted, group_store, env, device, init_timeout_s, timeout)
        failed = agree("backend-connected", error, init_timeout_s)
        if failed and len(failed) < env.world_size:
            # Some ranks connected and others did not: NCCL's set-up is not something to fall back from.
            raise LaunchError(
                f"NCCL did not connect every rank ({failed[0]}) (fix: `python -m aura_hpc check` between the nodes; "
                "NCCL_SOCKET_IFNAME / InfiniBand settings in the cluster profile; or --backend gloo, which trains on the CPUs)"
            )
    if not failed:
        collectives.set_world(device, timeout)
        if wanted == "gloo":
            flight_dump.serve(env.rank)
        return wanted
    first = failed[0]
    if backend == "nccl":
        raise LaunchError(
            f"NCCL could not start ({first}) and dist.backend=nccl does not fall back to gloo (fix: `python -m aura_hpc check` on "
            "these nodes; NCCL_SOCKET_IFNAME / InfiniBand settings in the cluster profile; or --set dist.backend=auto to allow a "
            "gloo fallback)"
        )
    if env.is_main:
        log.warning("%s could not start (%s); fallback=gloo", wanted.upper() if wanted == "nccl" else wanted, first)
    if dist.is_initialized():
        dist.destroy_process_group()
    return _gloo(dist.PrefixStore(f"{rdzv.prefix}/gloo-fallback", rdzv.store), env, device, timeout)


def _gloo(store: Any, env: DistEnv, device: torch.device, timeout: timedelta) -> str:
    """gloo, on this rank's device: gloo carries CUDA tensors too (through host memory)."""
    dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    collectives.set_world(device, timeout)
    flight_dump.serve(env.rank)
    return "gloo"


def _connect(backend: str, store: Any, env: DistEnv, device: torch.device, init_timeout_s: int, timeout: timedelta) -> str:
    """The group on `backend` and one collective through it; "" or the first line of what failed.
    Every rank said it can start, so what is left is the network between them. NCCL's own set-up has
    no timeout (blocking mode waits for every rank forever): a watchdog ends this process when a
    peer reports its set-up failed, or after dist.init_timeout_s, with the reason."""
    from aura_hpc.train.instruments import faults

    done = threading.Event()
    assert _AGREE is not None
    prefix, secret_key = _AGREE[1], _AGREE[4]
    # The watchdog's own connection, made here: a store client serves one call at a time, and a pybind
    # object made in another thread while torch constructs the group races its registration.
    agreed: Any = _AGREE[0]
    if env.world_size > 1:
        try:
            agreed = stores.client(master_address.dialled(env), env.master_port, timedelta(seconds=10))
        except (RuntimeError, TimeoutError, OSError):
            agreed = None  # then only the timeout ends a stuck set-up
    keys = [f"{prefix}/backend-connected/{r}" for r in range(env.world_size)]
    failures = f"{prefix}/backend-connected/{FAILED}"
    name = backend.upper() if backend == "nccl" else backend

    # Two GPUs of one desktop (consumer cards, an IOMMU) often hang in NCCL's direct GPU-to-GPU path: its switch named.
    one_machine = backend == "nccl" and 1 < env.local_world_size == env.world_size  # on a multi-node job the network is likelier
    p2p = "; GPUs of one machine that never connect: NCCL_P2P_DISABLE=1" if one_machine else ""

    def give_up(why: str) -> None:
        log.error(
            "%s (fix: `python -m aura_hpc check` between the nodes; NCCL_SOCKET_IFNAME / InfiniBand settings%s; "
            "or --backend gloo, which trains on the CPUs)",
            why,
            p2p,
        )
        logging.shutdown()
        os._exit(EXIT_TRAIN_FAILED)

    def watch() -> None:
        deadline = time.monotonic() + init_timeout_s + 5
        read = 0  # failures counted when the answers were last read
        while not done.wait(1.0):
            # One request a second: every rank asking for every rank's answer was W² a second at rank 0's store
            # (65,000 at 32 nodes of 8 GPUs), beside NCCL's own set-up there. Its answers are read once one failed.
            with contextlib.suppress(Exception):
                if agreed is not None and (count := int(agreed.add(failures, 0))) > read:
                    for r, name_r in enumerate(keys):
                        if r != env.rank and agreed.check([name_r]):
                            said = _opened(secret_key, name_r, agreed.get(name_r))[:300]
                            if said != "ok" and not done.is_set():  # a stranger's count alone ends nothing
                                give_up(f"{name} could not connect the ranks: rank {r} failed in its set-up ({said})")
                    read = count
            if time.monotonic() > deadline and not done.is_set():
                give_up(f"{name} did not connect the ranks within dist.init_timeout_s={init_timeout_s} s (waiting inside its set-up)")

    threading.Thread(target=watch, name="aura-backend-watchdog", daemon=True).start()
    try:
        # The same set-up on every torch (2.6 turned on NCCL's nonblocking set-up with device_id, later ones do not).
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "0")
        kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        if fault := faults.backend_fails(env.rank, "connect"):
            raise RuntimeError(fault)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **kw)
        probe_device = device if backend == "nccl" else torch.device("cpu")
        collectives.set_world(probe_device, timeout)
        # NCCL connects lazily on some releases; one collective, read back, makes a broken fabric show up here.
        probe = torch.ones(1, device=probe_device)
        collectives.all_reduce(probe)
        probe.item()
        return ""
    except Exception as exc:
        return _first_line(exc)
    finally:
        done.set()


FAILED = "failed"  # beside the ranks' answers on a topic, how many of them said a problem
_AGREE: tuple[Any, str, int, int, bytes | None] | None = None  # the store, a per-attempt prefix, rank, world size, key


def agree(topic: str, problem: str, patience_s: float, waiting: str = "") -> list[str]:
    """Every rank's problem with `topic` ("" = none), once all ranks have said: the ranks decide
    together without a collective, so a rank that takes long (fetching data) never runs another
    into the collective timeout. Waits at most `patience_s` for the others (logging `waiting`)."""
    if _AGREE is None:
        return [problem] if problem else []
    answers = _answers(topic, problem or "ok", patience_s, waiting, failed=bool(problem))
    if isinstance(answers, str):
        return [answers]
    return [f"rank {r}: {a}" for r, a in enumerate(answers) if a != "ok"]


def _answers(topic: str, text: str, patience_s: float, waiting: str, failed: bool = False) -> list[str] | str:
    """What every rank said on `topic`, in rank order, or why they could not be read."""
    assert _AGREE is not None
    store, prefix, rank, world, key = _AGREE
    said = "".join(c if c.isprintable() else " " for c in text)[:1000]
    store.set(f"{prefix}/{topic}/{rank}", _signed(key, f"{prefix}/{topic}/{rank}", said))
    if failed:
        store.add(f"{prefix}/{topic}/{FAILED}", 1)  # after the answer: a watcher that sees the count finds it (_connect's)
    keys = [f"{prefix}/{topic}/{r}" for r in range(world)]
    start = last_note = time.monotonic()
    while not store.check(keys):
        now = time.monotonic()
        if now - start > patience_s:
            return f"ranks did not all report on {topic} within {patience_s:.0f} s"
        if waiting and now - last_note > 30:
            log.info("%s (%.0f s so far)", waiting, now - start)
            last_note = now
        time.sleep(0.05)
    try:
        return [_opened(key, k, store.get(k)) for k in keys]
    except RuntimeError:  # deleted between check and get: anyone who reaches the store can
        return f"the ranks' answers on {topic} were deleted from the store as they were read (fix: firewall its port)"


def _signed(key: bytes | None, name: str, text: str) -> str:
    """A rank's answer as it goes into the store: under the run's secret, with its HMAC (anyone who
    reaches the store could otherwise make the ranks decide apart: one falls back to gloo, one not)."""
    return text if key is None else hmac.new(key, f"agree|{name}|{text}".encode(), hashlib.sha256).hexdigest() + "|" + text


def _opened(key: bytes | None, name: str, raw: bytes) -> str:
    text = raw[:1200].decode("utf-8", "replace")
    if key is not None:
        mac, _, text = text.partition("|")
        if not hmac.compare_digest(mac.encode(), _signed(key, name, text).partition("|")[0].encode()):
            return "an answer no rank of this run signed (fix: something else on the network writes to the rendezvous port: firewall it)"
    return "".join(c if c.isprintable() else " " for c in text)[:1000]


def active() -> bool:
    return collectives.active()


def shutdown() -> None:
    if active():
        # gloo's worker thread frees finished work (and the Python tensors it holds) right after
        # completing it; destroying the group while it still must, with the GIL held here,
        # deadlocks torch < 2.8 (seen on 2.6: ~2 runs in 8). A short GIL-free pause lets it finish.
        time.sleep(0.1)
        dist.destroy_process_group()
