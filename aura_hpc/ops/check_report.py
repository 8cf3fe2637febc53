"""What a `check` found: one Finding per check, collected into a Report (printed or --json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # reported, but not a failure

    def line(self) -> str:
        return f"{self.name}: {self.detail}" + (f" (fix: {self.fix})" if self.fix else "")


@dataclass
class Report:
    node_rank: int = 0
    nnodes: int = 1
    findings: list[Finding] = field(default_factory=list)
    bandwidth: list[dict[str, float]] = field(default_factory=list)
    advice: list[dict[str, Any]] = field(default_factory=list)  # the link advice's options, between nodes
    nodes: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(f.ok or f.warning for f in self.findings)

    def add(self, name: str, ok: bool, detail: str, fix: str = "", warning: bool = False) -> Finding:
        f = Finding(name, ok, detail, fix, warning)
        self.findings.append(f)
        return f

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "elapsed_s": round(self.elapsed_s, 3),
            "findings": [asdict(f) for f in self.findings],
            "bandwidth": self.bandwidth,
            "advice": self.advice,
            "nodes": self.nodes,
        }


class Failed(Exception):
    """A check that makes the following ones pointless (e.g. the master is unreachable)."""
