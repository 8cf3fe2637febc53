"""torch's c10d rendezvous state, read as data before torch unpickles it.

torch keeps that state pickled in node 0's store (dynamic_rendezvous._RendezvousState, the same eight
fields from torch 2.6 on), and every launcher unpickles whatever the key holds: anyone who reaches the
port could run code there. `check` reads the bytes first, as a plain pickle of that shape and nothing
else: only the opcodes such a pickle uses, with nothing left on the stack at its end; stand-ins for
torch's two classes (made anew for each read, never torch's own, so a pickle cannot change them) that
are made only as torch's pickle makes them; the fields and their types; and a size a run of that many
nodes can have. What fails is a StateTampered, recorded here for the launcher.
"""

from __future__ import annotations

import datetime
import io
import pickle
import pickletools
from typing import Any

_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# Every opcode torch's pickle of the state uses (protocols 4 and 5, 1 to 40 nodes), and the few that a larger
# one adds (memo and string lengths). None allocates what it declares, calls a persistent loader or an extension.
_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
        "BININT1", "BININT2", "LONG1", "SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES", "EMPTY_TUPLE", "TUPLE",
        "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "STACK_GLOBAL",
        "NEWOBJ", "REDUCE", "BUILD",
    }
)  # fmt: skip
_DATETIME = {"datetime": datetime.datetime, "timezone": datetime.timezone, "timedelta": datetime.timedelta}  # immutable types
_FIELDS = {
    "round": (int,), "complete": (bool,), "deadline": (type(None), datetime.datetime), "closed": (bool,),
    "participants": (dict,), "wait_list": (set,), "redundancy_list": (set,), "last_heartbeats": (dict,),
}  # fmt: skip
_NODE_FIELDS = {"addr": str, "pid": int, "local_id": int}
# What a memo entry torch's pickle fetches again was made by: a node (NEWOBJ), a time (REDUCE), a string or a
# class. A tuple fetched again is how a few bytes stand for a tree of 2**depth leaves, hashed in C as a dict key.
_REFETCHED = frozenset({"NEWOBJ", "REDUCE", "SHORT_BINUNICODE", "BINUNICODE", "STACK_GLOBAL"})


class StateTampered(Exception):
    """The rendezvous state in the store is gone, or is not one torch's rendezvous wrote: what happened to it."""


# What this process's rendezvous found tampered with, newest last: torch's agent swallows the error where it
# closes the rendezvous (after the workers of a node that noticed nothing itself stopped), so the launcher reads it here.
_SEEN: list[StateTampered] = []


def record(what: StateTampered) -> None:
    _SEEN.append(what)


def tampering_seen() -> StateTampered | None:
    return _SEEN[-1] if _SEEN else None


def forget_tampering() -> None:
    _SEEN.clear()


def max_bytes(max_nodes: int) -> int:
    """About 75 bytes a node in torch's pickle: room for far more, and no more than that to read."""
    return 4096 + 1024 * max(max_nodes, 1)


def check(bits: bytes, max_nodes: int) -> None:
    """Raises StateTampered unless `bits` is a pickled rendezvous state of at most `max_nodes` nodes."""
    read(bits, max_nodes)


def read(bits: bytes, max_nodes: int) -> Any:
    """The state as data (its fields on a stand-in, its nodes with addr, pid and local_id), once `check`'s reading
    passed; raises StateTampered like it."""
    limit = max_bytes(max_nodes)
    if len(bits) > limit:
        raise StateTampered(f"rewritten (a value of {len(bits):,} bytes, over the {limit:,} a state of {max_nodes} nodes can take)")
    try:
        _check_opcodes(bits)
        state, node = _read(bits)
        _check_shape(state, node, max_nodes)
    except StateTampered:
        raise
    except Exception as exc:  # any damage at all: a truncated or hand-made pickle, a node hashed before it was made
        raise StateTampered(f"rewritten (not a rendezvous state: {type(exc).__name__})") from None
    return state


def _check_opcodes(bits: bytes) -> None:
    """Only the opcodes of a state, no integer made to collide, and one object at STOP: objects piled on the
    stack (which the unpickler keeps until the end) are refused before anything is made."""
    depth, marks, memo, previous = 0, [], [], ""
    for op, arg, _ in pickletools.genops(bits):
        if op.name not in _OPCODES:
            raise StateTampered(f"rewritten (pickle opcode {op.name}, which no rendezvous state holds)")
        if op.name == "MEMOIZE":
            memo.append(previous)
        elif op.name in ("BINGET", "LONG_BINGET") and not (0 <= arg < len(memo) and memo[arg] in _REFETCHED):
            raise StateTampered("rewritten (an object used twice that no rendezvous state shares)")
        previous = op.name
        if op.name == "LONG1" and abs(arg) >= 2**60:  # ints whose hashes an attacker picks to collide
            raise StateTampered("rewritten (an integer no rendezvous state holds)")
        if op.name == "MARK":
            marks.append(depth)
        elif pickletools.markobject in op.stack_before:  # TUPLE, SETITEMS, ADDITEMS: down to the mark
            if not marks:
                raise StateTampered("rewritten (not a rendezvous state: no mark)")
            depth = marks.pop() - op.stack_before.index(pickletools.markobject) + len(op.stack_after)
        else:
            depth += len(op.stack_after) - len(op.stack_before)
        if depth < 0:
            raise StateTampered("rewritten (not a rendezvous state: an empty stack)")
    if depth != 0 or marks:  # STOP took the one object there was
        raise StateTampered("rewritten (not a rendezvous state: more than one object)")


def _stand_in(name: str, types: dict[str, tuple[type, ...]], hashed: bool) -> type:
    """A class in place of torch's: made only as torch's pickle makes it (NEWOBJ, then one BUILD with a
    dict of exactly its fields, each of its type: a node whose address is another node would be hashed
    through every node it names), and hashed as torch's frozen dataclass is, so what fails torch's load
    fails here first."""
    fields = tuple(types)

    def __new__(cls: type, *args: Any) -> Any:
        if args:
            raise StateTampered(f"rewritten (a {name} made with arguments)")
        return object.__new__(cls)

    def __init__(self: Any, *args: Any) -> None:  # only REDUCE calls it: torch's pickle uses NEWOBJ
        raise StateTampered(f"rewritten (a {name} made by a call)")

    def __setstate__(self: Any, state: Any) -> None:
        if vars(self) or type(state) is not dict or set(state) != set(fields) or any(type(state[f]) not in types[f] for f in fields):
            raise StateTampered(f"rewritten (a {name} whose fields are not torch's)")
        vars(self).update(state)

    def __hash__(self: Any) -> int:
        return hash(tuple(vars(self)[f] for f in fields))

    def __eq__(self: Any, other: Any) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    methods = {"__new__": __new__, "__init__": __init__, "__setstate__": __setstate__}
    if hashed:
        methods |= {"__hash__": __hash__, "__eq__": __eq__}
    # A BUILD aimed at the class itself calls its __setstate__ unbound, and fails: nothing sets attributes on it.
    return type(name, (), methods)


def _read(bits: bytes) -> tuple[Any, type]:
    state_cls = _stand_in("State", _FIELDS, hashed=False)
    node_cls = _stand_in("Node", {k: (t,) for k, t in _NODE_FIELDS.items()}, hashed=True)
    stand_ins = {"_RendezvousState": state_cls, "_NodeDesc": node_cls}

    class Reader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == _MODULE and name in stand_ins:
                return stand_ins[name]
            if module == "datetime" and name in _DATETIME:
                return _DATETIME[name]
            raise StateTampered(f"rewritten (it names {module[:80]}.{name[:80]}, which no rendezvous state holds)")

    state = Reader(io.BytesIO(bits)).load()
    if type(state) is not state_cls:
        raise StateTampered(f"rewritten (a {type(state).__name__[:40]}, not a rendezvous state)")
    return state, node_cls


def _aware(t: Any) -> bool:
    """torch compares every time in the state with an aware now(): a naive one would fail there."""
    return type(t) is datetime.datetime and t.tzinfo is not None


def _check_shape(state: Any, node_cls: type, max_nodes: int) -> None:
    fields = vars(state)
    if set(fields) != set(_FIELDS) or any(type(fields[k]) not in types for k, types in _FIELDS.items()):
        raise StateTampered("rewritten (a state whose fields are not torch's)")
    if state.deadline is not None and not _aware(state.deadline):
        raise StateTampered("rewritten (a deadline torch cannot compare)")
    nodes = [*state.participants, *state.wait_list, *state.redundancy_list, *state.last_heartbeats]
    for node in nodes:
        parts = vars(node) if type(node) is node_cls else {}
        if set(parts) != set(_NODE_FIELDS) or any(type(parts[k]) is not t for k, t in _NODE_FIELDS.items()) or len(parts["addr"]) > 255:
            raise StateTampered("rewritten (a node that is not torch's description of one)")
    values_ok = all(type(r) is int for r in state.participants.values()) and all(_aware(t) for t in state.last_heartbeats.values())
    if not values_ok or len(state.participants) > max_nodes:
        raise StateTampered("rewritten (ranks or heartbeats that are not torch's)")
