"""The verdicts a run can carry, typed: a :class:`Divergence` from the reference, a
:class:`Desync` across ranks, a :class:`Hang`, a :class:`Crash`, and the
:class:`Straggler` notes of a passing run, and the :class:`RunResult` of one run that
carries them (with its status, and :func:`exit_code` from statuses). Decided once in :mod:`ddparity.checks`; the
same objects become the text (:mod:`ddparity.render`), the JSON (``to_json``: the
version-1 fields of docs/cli.md, pinned byte for byte by ``tests/test_report_json.py``), the JUnit
properties and the exit code.

Each verdict also reads like its version-1 JSON object (``run.hang["suspect_ranks"]``),
as :class:`ddparity.RunResult`'s fields did when they were plain dicts.

A leaf module: plain data, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddparity.errors import Exit


class _ReadsAsJson(Mapping[str, Any]):
    """A read-only mapping over the verdict's ``to_json()``."""

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


def _finite(x: float) -> float | None:
    """JSON has no infinity; an infinite error (shape or NaN mismatch) is written as null."""
    return x if math.isfinite(x) else None


def _by_rank(values: Mapping[int, Any]) -> dict[str, Any]:
    return {str(r): v.to_json() if hasattr(v, "to_json") else v for r, v in sorted(values.items())}


@dataclass(frozen=True)
class ModuleFinding(_ReadsAsJson):
    """Where in the model a run's first differing step first differs from the reference's
    (:mod:`ddparity.harness.ranks.differing`): in ``phase`` ``"forward"``, the first module call
    whose ``input`` agrees and whose ``output`` differs; ``"loss"``, the gradient backward
    starts from (the loss's, compared x 1/W) differs, by ``factor``; ``"backward"``, the
    first module whose ``output gradient`` agrees and whose input or a parameter's gradient
    differs; ``"reduction"``: every activation and its gradient agree and every parameter's
    gradient differs; ``"compiled"``: the first block whose compiled output differs from its
    eager output on the same input; ``"none"``: every module's forward and backward agree.
    Its line of the report: :func:`ddparity.render.module_line`."""

    step: int
    rank: int
    phase: str
    module: str = ""
    type: str = ""
    differs: str = ""
    error: float = 0.0
    """``scale`` ``rel``: ||rank - reference|| / ||reference||; ``abs``: the largest absolute
    difference (a parameter's gradient, as the run's comparison measured it)."""
    tolerance: float = 0.0
    agrees: str = ""
    agrees_error: float | None = None
    agrees_ok: bool | None = None
    """Whether ``agrees`` is within its tolerance (None: nothing to compare it with)."""
    factor: float | None = None
    mismatch: str = ""
    """Why the error is infinite, in words (a gradient on one side only)."""
    scale: str = "rel"
    note: str = ""
    """What else the finding says (a compiled block's graph breaks, why no op is named)."""
    op: str = ""
    """Inside a module that differs in forward: the first aten op whose output differs."""
    op_error: float | None = None
    call: int = 0
    """The module's call number in the step (a module called twice: 0, then 1)."""
    position: int = 0
    """The call's place in its phase (forward: calls in the order they finished; backward:
    in the order their output gradients arrived)."""
    forwards: tuple[int, int] | None = None
    """(the rank's forwards of the model in the step, one device's), where they differ: a step
    that made fewer micro-batches of a smaller share."""
    uncompared: str = ""
    """Modules whose outputs could not be compared (rows not one per sample of the rank's share:
    ``d (32 rows for 16 samples)``), where the finding says what agrees: that is not about them."""

    @property
    def found(self) -> bool:
        return self.phase != "none"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "phase": self.phase, "module": self.module or None,
                "type": self.type or None, "differs": self.differs or None, "error": _finite(self.error), "scale": self.scale,
                "tolerance": self.tolerance, "agrees": self.agrees or None,
                "agrees_error": _finite(self.agrees_error) if self.agrees_error is not None else None,
                "factor": self.factor, **({"mismatch": self.mismatch} if self.mismatch else {}),
                **({"note": self.note} if self.note else {}),
                **({"forwards": list(self.forwards)} if self.forwards else {}),
                **({"uncompared": self.uncompared} if self.uncompared else {}),
                **({"op": self.op, "op_error": _finite(self.op_error or 0.0)} if self.op else {})}


@dataclass(frozen=True)
class Divergence(_ReadsAsJson):
    """The first (or a worst) tensor of a run beyond its tolerance of the reference."""

    step: int
    kind: str
    """loss | grad | param | optimizer | buffer (``distances.RECORD_KINDS``)"""
    name: str
    rank: int
    max_abs: float
    max_rel: float
    tolerance: float
    mismatch: str | None = None
    """Why the error is infinite, in words (a tensor missing, another shape, a NaN)."""
    module: ModuleFinding | None = None
    """Where in the model the step first differs (the first divergence of a failing run)."""
    factor: float | None = None
    """The rank's step-0 update as a factor of one device's, where that is what diverged
    (:data:`~ddparity.checks.equivalence.UPDATE_FACTOR`; ``max_abs`` is then ``|factor - 1|``)."""

    @property
    def where(self) -> str:
        """``step 0, the loss, rank 0`` or ``step 2, grad 'fc.weight', rank 1``."""
        what = "the loss" if self.kind == "loss" else f"{self.kind} {self.name!r}"
        return f"step {self.step}, {what}, rank {self.rank}"

    @property
    def excess(self) -> float:
        """How many tolerances away the run is (inf when the tolerance is 0)."""
        return self.max_abs / self.tolerance if self.tolerance else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "name": self.name, "rank": self.rank,
                "max_abs": _finite(self.max_abs), "max_rel": _finite(self.max_rel), "tolerance": self.tolerance,
                **({"mismatch": self.mismatch} if self.mismatch else {}),
                **({"factor": _finite(self.factor)} if self.factor is not None else {}),
                **({"module": self.module.to_json()} if self.module is not None else {})}


@dataclass(frozen=True)
class IssuedCollective(_ReadsAsJson):
    """What one rank issued at a mismatched slot of the collective sequence."""

    collective: str
    site: str
    via: str
    step: int

    def to_json(self) -> dict[str, Any]:
        return {"collective": self.collective, "site": self.site, "via": self.via, "step": self.step}


@dataclass(frozen=True)
class MismatchedSlot(_ReadsAsJson):
    """The place in a group's collective sequence where ranks issued different collectives."""

    group: str
    seq: int
    ranks: dict[int, IssuedCollective]

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "seq": self.seq, "ranks": _by_rank(self.ranks)}


@dataclass(frozen=True)
class Desync(_ReadsAsJson):
    """Ranks that should agree do not: they issued different collectives (``collective``),
    or their replicas drifted apart after a step (``differs``, ``agreeing_ranks``)."""

    step: int
    what: str
    ranks: list[int]
    """The minority: the ranks that differ from the others."""
    collective: MismatchedSlot | None = None
    differs: list[str] | None = None
    """Replica state that differs (``param w``, ``rng cpu``), in model order."""
    agreeing_ranks: list[int] | None = None
    stacks: dict[int, str] | None = None
    """Every rank's stack when a watcher stopped the task over the mismatch."""
    in_backward: bool = False
    """Every rank's optimizer stepped DDP's parameters inside backward at that step (``watch``)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "what": self.what, "ranks": self.ranks}
        if self.in_backward:
            out["in_backward"] = True
        if self.collective is not None:
            out["collective"] = self.collective.to_json()
        if self.differs is not None:
            out["differs"] = self.differs
            out["agreeing_ranks"] = self.agreeing_ranks
        if self.stacks is not None:
            out["stacks"] = _by_rank(self.stacks)
        return out


@dataclass(frozen=True)
class RankPlace(_ReadsAsJson):
    """Where one rank was when a run hung or crashed."""

    collective_seq: int
    collective: str
    step: int
    phase: str
    finished: bool
    stack: str
    raised: str = ""
    """What the rank raised, where it ended the task by raising too ("" if not)."""

    def to_json(self) -> dict[str, Any]:
        out = {"collective_seq": self.collective_seq, "collective": self.collective, "step": self.step,
               "phase": self.phase, "finished": self.finished, "stack": self.stack}
        return {**out, "raised": self.raised} if self.raised else out


@dataclass(frozen=True)
class FlightFinding(_ReadsAsJson):
    """What the ranks' own Flight Recorders say of a hang: ``kind`` ``"inside"`` (every rank
    of ``group`` issued collective ``seq`` and none completed it: the transport, network or
    a device is stuck), ``"host"`` (``not_issued_by`` never issued it: their host code is
    elsewhere) or ``"idle"`` (no collective unfinished anywhere)."""

    kind: str
    explanation: str
    group: str = ""
    seq: int = -1
    collective: str = ""
    issued_by: list[int] = field(default_factory=list)
    not_issued_by: list[int] = field(default_factory=list)
    not_started_on: list[int] = field(default_factory=list)
    unread: list[int] = field(default_factory=list)
    """Ranks whose recorder could not be read (off, or the process unhealthy)."""

    def to_json(self) -> dict[str, Any]:
        return {"finding": self.kind, "explanation": self.explanation, "group": self.group,
                "collective_seq": self.seq, "collective": self.collective, "issued_by": self.issued_by,
                "not_issued_by": self.not_issued_by, "not_started_on": self.not_started_on, "unread": self.unread}


@dataclass(frozen=True)
class Hang(_ReadsAsJson):
    """Ranks made no progress: the suspects, and where every rank was (and, in a launch,
    what the ranks' own Flight Recorders say)."""

    suspect_ranks: list[int]
    ranks: dict[int, RankPlace] = field(default_factory=dict)
    flight: FlightFinding | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"suspect_ranks": self.suspect_ranks, "ranks": _by_rank(self.ranks)}
        if self.flight is not None:
            out["flight_recorder"] = self.flight.to_json()
        return out


@dataclass(frozen=True)
class Crash(_ReadsAsJson):
    """A rank raised (``exitcode`` None, its ``traceback``) or died (its exit code or
    signal, its last ``output``), and where the other ranks were."""

    rank: int
    exitcode: int | None
    error: str
    output: str | None = None
    traceback: str | None = None
    ranks: dict[int, RankPlace] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "exitcode": self.exitcode, "error": self.error}
        if self.output is not None:
            out["output"] = self.output
        if self.traceback is not None:
            out["traceback"] = self.traceback
        out["ranks"] = _by_rank(self.ranks)
        return out


@dataclass(frozen=True)
class Straggler(_ReadsAsJson):
    """A rank that arrives last at most collectives every rank issued."""

    rank: int
    last_count: int
    """Collectives at which it arrived last (``arrived_last`` in the JSON)."""
    collectives: int
    mean_late_s: float
    """Mean delay behind the first rank to arrive."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "arrived_last": self.last_count, "collectives": self.collectives,
                "mean_late_s": round(self.mean_late_s, 4)}


@dataclass(frozen=True)
class Failure:
    """Why a run could not finish: the status (``desync``, ``hang``, ``crash`` or
    ``error``), the one-line reason, and the verdict that explains it. Shared by every
    verb: a check's run, a profiled world size and a health check carry it alike."""

    status: str
    reason: str | None = None
    desync: Desync | None = None
    hang: Hang | None = None
    crash: Crash | None = None


def json_or_none(verdict: _ReadsAsJson | None) -> dict[str, Any] | None:
    return verdict.to_json() if verdict is not None else None


FAILING = ("diverged", "desync", "hang", "crash", "error")


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
    desync: Desync | None = None
    hang: Hang | None = None
    crash: Crash | None = None
    stragglers: list[Straggler] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tolerance: str = ""
    repro: str = ""
    compile: dict[str, Any] | None = None
    """A compiled run's ``{"backend": str, "ddp": str | None}``; None for an eager one."""
    label: str = ""
    """What the table adds to the mode (``compiled inductor``)."""

    @property
    def name(self) -> str:
        """The mode as reports name it: ``ddp``, ``ddp (compiled inductor)``."""
        return f"{self.mode} ({self.label})" if self.label else self.mode

    @property
    def ok(self) -> bool:
        return self.status not in FAILING

    def failed(self, failure: Failure) -> RunResult:
        """This run, ended by ``failure`` (its status, reason and verdict)."""
        self.status, self.reason = failure.status, failure.reason
        self.desync, self.hang, self.crash = failure.desync, failure.hang, failure.crash
        return self

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "backend": self.backend,
            "simulated": self.simulated,
            "status": self.status,
            "reason": self.reason,
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "desync": json_or_none(self.desync),
            "hang": json_or_none(self.hang),
            "crash": json_or_none(self.crash),
            "stragglers": [s.to_json() for s in self.stragglers],
            "notes": self.notes,
            "seconds": round(self.seconds, 4),
            "worst": [d.to_json() for d in self.worst],
            "tolerance": self.tolerance,
            "repro": self.repro,
            "compile": self.compile,
        }


def exit_code(statuses: set[str]) -> int:
    """The exit codes (docs/cli.md) from run statuses: 3 hang/crash, 2 bad input, 1 divergence/desync,
    0 otherwise (equivalent, profiled, skipped)."""
    if statuses & {"hang", "crash"}:
        return Exit.HANG_OR_CRASH
    if "error" in statuses:
        return Exit.USAGE
    if statuses & {"diverged", "desync"}:
        return Exit.FAILED
    return Exit.OK
