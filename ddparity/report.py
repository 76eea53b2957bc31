"""The reports of the three verbs: ``check`` (:class:`Report` of
:class:`~ddparity.verdicts.RunResult`),
``profile`` (:class:`ProfileReport`) and ``health`` (:class:`HealthReport`), with their
exit codes and JSON (version 1). Their text is :mod:`ddparity.render`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ddparity.errors import Exit, ParityError
from ddparity.verdicts import Failure, RunResult, exit_code, json_or_none

if TYPE_CHECKING:
    from ddparity.checks.comm import WorldProfile
    from ddparity.checks.health import Bandwidth, Check, PairBandwidth
    from ddparity.measurements import RankHealth

@dataclass
class Report:
    case: str
    runs: list[RunResult] = field(default_factory=list)
    verb: str = "check"
    """``check``, or ``watch`` (a user's script watched: no reference to be equivalent to)."""

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

        return render_report(self.case, self.runs, self.verb)

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise ParityError(self.render(), self)

    def __str__(self) -> str:
        return self.render()


@dataclass
class ProfileReport:
    """What ``profile`` measured: the figures of every world size."""

    case: str
    runs: list[WorldProfile] = field(default_factory=list)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def exit_code(self) -> int:
        """0 every world size profiled (or skipped), 2 bad input, 3 a hang or crash."""
        return exit_code({r.status for r in self.runs})

    @property
    def recommendation(self) -> str | None:
        """Which arm to pick, from the measured rows (:mod:`ddparity.checks.recommend`)."""
        from ddparity.checks.recommend import recommend

        return recommend(self.runs)

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "case": self.case, "cpus": self.cpus, "runs": [r.to_json() for r in self.runs],
                "recommendation": self.recommendation}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def render(self) -> str:
        from ddparity.render import render_profile

        return render_profile(self.case, self.runs, self.recommendation)

    def __str__(self) -> str:
        return self.render()


@dataclass
class HealthReport:
    """What ``health`` found: every check's verdict and the measurements behind it."""

    launcher: str  # local | torchrun
    backend: str
    world_size: int
    checks: list[Check] = field(default_factory=list)
    bandwidth: list[Bandwidth] = field(default_factory=list)
    pairs: list[PairBandwidth] = field(default_factory=list)
    """``--pairwise``: every pair's all-reduce (and again through the network alone, on nccl)."""
    ranks: list[RankHealth] = field(default_factory=list)
    failure: Failure | None = None
    """Why the health check could not finish (``hang``, ``crash``, ``error``); its reason the
    rendered failure."""
    repro: str = ""

    @property
    def healthy(self) -> bool:
        return self.failure is None and not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 a check failed, 2 bad input, 3 a hang or crash."""
        if self.failure is not None:
            return Exit.USAGE if self.failure.status == "error" else Exit.HANG_OR_CRASH
        return Exit.OK if self.healthy else Exit.FAILED

    def render(self) -> str:
        header = f"ddparity health: {self.world_size} rank(s), {self.backend}, {self.launcher}"
        if self.failure is not None:
            return f"{header}\n{self.failure.status.upper()}: {self.failure.reason}\nreproduce: {self.repro}\n"
        from ddparity.render import render_health

        text = render_health(self.checks, self.bandwidth, self.ranks, header, self.pairs)
        return text if self.healthy else f"{text}reproduce: {self.repro}\n"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": 1, "launcher": self.launcher, "backend": self.backend,
                                "world_size": self.world_size}
        if self.failure is not None:
            failed = {"status": self.failure.status, "reason": self.failure.reason,
                      "hang": json_or_none(self.failure.hang), "crash": json_or_none(self.failure.crash)}
            return {**data, "healthy": False, "failure": failed, "checks": [], "bandwidth": [], "pairs": [],
                    "ranks": []}
        return {**data, "healthy": self.healthy,
                "checks": [asdict(c) for c in self.checks],
                "bandwidth": [asdict(b) for b in self.bandwidth],
                "pairs": [asdict(p) for p in self.pairs],
                "ranks": [asdict(r) for r in sorted(self.ranks, key=lambda r: r.rank)]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)
