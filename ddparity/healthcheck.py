"""``health``: is this machine (or cluster) fit to train on? (``ddparity health``)

Locally it starts a World of real ranks (one per GPU under nccl, else 2 CPU ranks on
gloo); under torchrun each launched process is a rank (:mod:`ddparity.harness.torchrun`).
The ranks measure (:mod:`ddparity.harness.health_task`), rank 0 or the controller judges
(:mod:`ddparity.checks.health`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ddparity.checks.health import Bandwidth, Check, judge, render, to_json
from ddparity.errors import WorldFailure
from ddparity.harness import rendezvous
from ddparity.harness.health_task import FAULT_ENV, HealthOptions, RankHealth, health_task, parse_fault
from ddparity.settings import (
    HEALTH_CPU_RANKS,
    TIMEOUT_S,
    validate_min_busbw,
    validate_sizes_mib,
    validate_timeout,
    validate_world_size,
)


@dataclass
class HealthReport:
    launcher: str  # local | torchrun
    backend: str
    world_size: int
    checks: list[Check] = field(default_factory=list)
    bandwidth: list[Bandwidth] = field(default_factory=list)
    ranks: list[RankHealth] = field(default_factory=list)
    failure: dict[str, Any] | None = None  # {"status": "hang"|"crash"|"error", "reason", "hang", "crash"}
    repro: str = ""

    @property
    def healthy(self) -> bool:
        return self.failure is None and not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 a check failed, 2 bad input, 3 a hang or crash."""
        if self.failure is not None:
            return 2 if self.failure["status"] == "error" else 3
        return 0 if self.healthy else 1

    def render(self) -> str:
        header = f"ddparity health: {self.world_size} rank(s), {self.backend}, {self.launcher}"
        if self.failure is not None:
            return f"{header}\n{self.failure['status'].upper()}: {self.failure['reason']}\nreproduce: {self.repro}\n"
        text = render(self.checks, self.bandwidth, self.ranks, header)
        return text if self.healthy else f"{text}reproduce: {self.repro}\n"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": 1, "launcher": self.launcher, "backend": self.backend,
                                "world_size": self.world_size}
        if self.failure is not None:
            return {**data, "healthy": False, "failure": self.failure, "checks": [], "bandwidth": [], "ranks": []}
        return {**data, **to_json(self.checks, self.bandwidth, self.ranks)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def options(sizes_mib: tuple[float, ...] | None = None) -> HealthOptions:
    parse_fault(os.environ.get(FAULT_ENV))  # a bad fault drill is a usage error, before anything starts
    if sizes_mib is None:
        return HealthOptions()
    validate_sizes_mib(sizes_mib, "health()")
    return HealthOptions(sizes_bytes=tuple(int(s * 2**20) for s in sizes_mib))


def health(world_size: int | None = None, backend: str = "auto", timeout: float = TIMEOUT_S,
           min_busbw: float | None = None, sizes_mib: tuple[float, ...] | None = None) -> HealthReport:
    """Run the health checks on a local World of real ranks."""
    from ddparity.controller import failure_run
    from ddparity.harness.world import World
    from ddparity.render import failure_detail

    opts = options(sizes_mib)
    _check_numbers(timeout, min_busbw)
    if world_size is None:
        gpus = rendezvous.cuda_device_count() if backend in ("auto", "nccl") else 0
        world_size = gpus if gpus else HEALTH_CPU_RANKS
    validate_world_size(world_size, "health()")
    chosen = rendezvous.resolve_backend(backend, world_size)
    report = HealthReport("local", chosen, world_size, repro=_command("ddparity", f"--world-size {world_size} --backend {chosen}",
                                                                      timeout, min_busbw, opts))
    world = World(world_size, chosen)
    try:
        outcomes = world.start().run(health_task, opts, timeout=timeout)
    except WorldFailure as exc:
        run = failure_run("health", world_size, chosen, exc, 0.0, "")
        report.failure = {"status": run.status, "reason": failure_detail(run), "hang": run.hang, "crash": run.crash}
        return report
    finally:
        world.close()
    report.ranks = list(outcomes)
    report.checks, report.bandwidth = judge(report.ranks, min_busbw)
    return report


def health_under_torchrun(backend: str = "auto", timeout: float = TIMEOUT_S, min_busbw: float | None = None,
                          sizes_mib: tuple[float, ...] | None = None) -> tuple[Any, HealthReport | None]:
    """This process's part of a torchrun-launched health check: ``(ctx, report)``, the
    report on rank 0 only."""
    from ddparity.harness import torchrun

    opts = options(sizes_mib)
    _check_numbers(timeout, min_busbw)
    ctx, gathered = torchrun.run(health_task, opts, backend=backend, timeout=timeout)
    if gathered is None:
        return ctx, None
    report = HealthReport("torchrun", ctx.backend, ctx.world_size, ranks=list(gathered),
                          repro=_command("torchrun <the same launch options> -m ddparity.cli", f"--backend {ctx.backend}",
                                         timeout, min_busbw, opts))
    report.checks, report.bandwidth = judge(report.ranks, min_busbw)
    return ctx, report


def _command(program: str, head: str, timeout: float, min_busbw: float | None, opts: HealthOptions) -> str:
    sizes = ",".join(f"{b / 2**20:g}" for b in opts.sizes_bytes)
    floor = f" --min-busbw {min_busbw:g}" if min_busbw is not None else ""
    drill = f"{FAULT_ENV}={os.environ[FAULT_ENV]} " if os.environ.get(FAULT_ENV) else ""
    return f"{drill}{program} health {head} --sizes {sizes} --timeout {timeout:g}{floor}"


def _check_numbers(timeout: float, min_busbw: float | None) -> None:
    validate_timeout(timeout, "health()")
    validate_min_busbw(min_busbw, "health()")


__all__ = ["HealthReport", "health", "health_under_torchrun"]
