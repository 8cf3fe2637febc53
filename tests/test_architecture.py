"""The layout ARCHITECTURE.md describes, checked: wings, one-way imports, no circle, small modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "aura_hpc"

# Imports flow from a wing to wings below it (or within itself), never upwards.
LAYERS = [
    {"__main__", "cli"},
    {"ps"},
    {"slurm"},
    {"launch"},
    {"train"},
    {"ops"},
    {"comm"},
    {"data"},
    {"config"},
    {"errors", "console", "processes", "__init__"},
]
RANK = {wing: i for i, wings in enumerate(LAYERS) for wing in wings}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every aura_hpc module `name` imports, at the top or inside functions."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("aura_hpc"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("aura_hpc"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_wing_is_placed_in_a_layer() -> None:
    assert {_wing(m) for m in MODULES} <= set(RANK), {_wing(m) for m in MODULES} - set(RANK)


def test_imports_flow_one_way() -> None:
    upward = [f"{src} -> {dst}" for src, targets in GRAPH.items() for dst in targets if RANK[_wing(src)] > RANK[_wing(dst)]]
    assert not upward, "imports against the layering (see LAYERS):\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import circle: " + " -> ".join(cycle))


def test_the_slurm_job_starts_the_worker_not_the_command_line() -> None:
    job = GRAPH["aura_hpc.slurm.job"]
    assert "aura_hpc.train.worker" in job and "aura_hpc.ops.check" in job
    assert not any(m == "aura_hpc.cli" or m.startswith("aura_hpc.cli.") for m in job)


def test_config_imports_nothing_above_it() -> None:
    for name in MODULES:
        if _wing(name) == "config":
            assert GRAPH[name] <= {m for m in MODULES if _wing(m) in ("config", "errors")}, (name, GRAPH[name])


def test_modules_and_classes_stay_small() -> None:
    big_modules, big_classes = [], []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 450:
            big_modules.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno and node.end_lineno - node.lineno + 1 > 300:
                big_classes.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big_modules and not big_classes, big_modules + big_classes


# Collectives (and the groups they run on) anywhere but comm/collectives.py: there a tensor is checked
# against its group's device before NCCL sees it, and the probes see every call.
COLLECTIVE = re.compile(
    r"\b(?:dist|torch\.distributed)\.(?:all_reduce|all_gather\w*|broadcast\w*|barrier|monitored_barrier|reduce\w*|gather\w*|"
    r"scatter\w*|send|recv|isend|irecv|all_to_all\w*|new_group|new_subgroups\w*|batch_isend_irecv)\("
)
RAW_P2P = re.compile(r"\b(?:group|pg)\.(?:send|recv)\(")


def test_every_collective_goes_through_one_module() -> None:
    offenders = []
    for name, path in MODULES.items():
        if name == "aura_hpc.comm.collectives":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if COLLECTIVE.search(line) or RAW_P2P.search(line):
                offenders.append(f"{name}:{i}: {line.strip()}")
    assert not offenders, "collectives outside aura_hpc/comm/collectives.py:\n" + "\n".join(offenders)


def test_nothing_received_from_a_peer_is_unpickled() -> None:
    """Object collectives unpickle what a peer sends: objects cross as JSON (comm/collectives.py)."""
    pickling = re.compile(
        r"\b(?:all_gather_object|broadcast_object_list|gather_object|scatter_object_list|send_object_list|recv_object_list)\b"
    )
    offenders = [name for name, path in MODULES.items() if pickling.search(path.read_text(encoding="utf-8"))]
    assert not offenders, offenders


def test_the_top_level_holds_few_modules() -> None:
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 10, top


def test_architecture_md_names_every_wing_and_stays_short() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert text.count("\n") <= 90
    for wing in ("cli", "ps", "slurm", "launch", "train", "ops", "comm", "data", "config"):
        assert re.search(rf"`aura_hpc/{wing}", text), wing


# train/ in rooms (ARCHITECTURE.md): beside its entry points, each room imports only the rooms named
# here. The loop is the top room and the instruments the bottom one; the model knows nothing of
# distribution, the process runtime nothing of models, loops or checkpoints.
TRAIN_ENTRY_POINTS = {"aura_hpc.train", "aura_hpc.train.__main__", "aura_hpc.train.worker", "aura_hpc.train.generate"}
TRAIN_ROOMS: dict[str, set[str]] = {
    "loop": {"parts", "checkpoint", "strategies", "model", "process", "instruments"},
    "checkpoint": {"parts", "strategies", "model", "process", "instruments"},
    "parts": {"strategies", "model", "process", "instruments"},
    # ZeRO writes its shards through checkpoint/background_shards.py, and the Checkpointer drives the
    # strategies: the one pair of rooms that meet both ways.
    "strategies": {"checkpoint", "model", "process", "instruments"},
    "model": {"process"},
    "process": {"instruments"},
    "instruments": set(),
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    in_room = len(parts) > 3 or (len(parts) == 3 and MODULES[module].name == "__init__.py")
    return parts[2] if in_room and parts[1] == "train" else None


def test_train_holds_its_entry_points_and_rooms_only() -> None:
    loose = [m for m in MODULES if _wing(m) == "train" and _room(m) is None and m not in TRAIN_ENTRY_POINTS]
    assert not loose and {_room(m) for m in MODULES if _room(m)} == set(TRAIN_ROOMS), (loose, {_room(m) for m in MODULES})


def test_each_room_of_train_imports_only_the_rooms_below_it() -> None:
    crossing = [
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        if (room := _room(src))
        for dst in targets
        if _room(dst) not in (None, room) and _room(dst) not in TRAIN_ROOMS[room]
    ]
    entry = [f"{src} -> {dst}" for src, targets in GRAPH.items() if _room(src) for dst in targets if dst in TRAIN_ENTRY_POINTS]
    assert not crossing and not entry, "imports between train/'s rooms against TRAIN_ROOMS:\n" + "\n".join(crossing + entry)


def test_the_loop_reaches_its_instruments_through_one_seam() -> None:
    """Fault injection and probes: the loop holds one `Instruments` (train/instruments/seam.py); only the
    code a fault must break inside (a checkpoint writer's stages, the backend's start, a `ps` worker's
    pace, the `ps` server's evaluation) calls faults.py itself."""
    seam = "aura_hpc.train.instruments.seam"
    users = {src for src, targets in GRAPH.items() for dst in targets if _room(dst) == "instruments" and _room(src) != "instruments"}
    assert {u for u in users if _room(u) == "loop"} == {"aura_hpc.train.loop.trainer"}
    assert GRAPH["aura_hpc.train.loop.trainer"] & {m for m in MODULES if _room(m) == "instruments"} == {seam}
    assert users - {"aura_hpc.train.loop.trainer"} == {
        "aura_hpc.train.checkpoint.files",
        "aura_hpc.train.checkpoint.background_shards",
        "aura_hpc.train.process.distributed",
        "aura_hpc.ps.worker",
        "aura_hpc.ps.versions",
    }
