"""Results of a check: per-run results, the report, its text and JSON (SPEC version 1)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ddparity.errors import ParityError

STATUSES = ("pass", "diverged", "desync", "hang", "crash", "error", "skipped")
FAILING = ("diverged", "desync", "hang", "crash", "error")


@dataclass(frozen=True)
class Divergence:
    step: int
    kind: str  # loss | grad | param | buffer
    name: str
    rank: int
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def excess(self) -> float:
        """How many tolerances away the run is (inf when the tolerance is 0)."""
        return self.max_abs / self.tolerance if self.tolerance else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "name": self.name,
            "rank": self.rank,
            "max_abs": _finite(self.max_abs),
            "max_rel": _finite(self.max_rel),
            "tolerance": self.tolerance,
        }


def _finite(x: float) -> float | None:
    """JSON has no infinity; an infinite error (shape or NaN mismatch) is written as null."""
    return x if math.isfinite(x) else None


@dataclass
class RunResult:
    mode: str
    world_size: int
    backend: str
    status: str
    simulated: bool = False
    reason: str | None = None
    first_divergence: Divergence | None = None
    worst: list[Divergence] = field(default_factory=list)
    desync: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None
    crash: dict[str, Any] | None = None
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tolerance: str = ""
    repro: str = ""

    @property
    def ok(self) -> bool:
        return self.status not in FAILING

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "backend": self.backend,
            "simulated": self.simulated,
            "status": self.status,
            "reason": self.reason,
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "desync": self.desync,
            "hang": self.hang,
            "crash": self.crash,
            "stragglers": self.stragglers,
            "notes": self.notes,
            "seconds": round(self.seconds, 4),
            "worst": [d.to_json() for d in self.worst],
            "tolerance": self.tolerance,
            "repro": self.repro,
        }


def exit_code(statuses: set[str]) -> int:
    """SPEC exit codes from run statuses: 3 hang/crash, 2 bad input, 1 divergence/desync,
    0 otherwise (equivalent, profiled, skipped)."""
    if statuses & {"hang", "crash"}:
        return 3
    if "error" in statuses:
        return 2
    if statuses & {"diverged", "desync"}:
        return 1
    return 0


@dataclass
class Report:
    case: str
    runs: list[RunResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    @property
    def exit_code(self) -> int:
        return exit_code({r.status for r in self.runs})

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "ok": self.ok, "case": self.case, "runs": [r.to_json() for r in self.runs]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def render(self) -> str:
        from ddparity.render import render_report

        return render_report(self)

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise ParityError(self.render(), self)

    def __str__(self) -> str:
        return self.render()
