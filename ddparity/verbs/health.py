"""``health``: is this machine (or cluster) fit to train on? (``ddparity health``)

Locally it starts a World of real ranks (one per GPU under nccl, else 2 CPU ranks on
gloo); under torchrun each launched process is a rank (:mod:`ddparity.harness.launch.torchrun`).
The ranks measure (:mod:`ddparity.harness.ranks.health_probe`), rank 0 or the controller judges
(:mod:`ddparity.checks.health`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn

from ddparity.checks.hardware import load_thresholds
from ddparity.checks.health import judge
from ddparity.errors import WorldFailure
from ddparity.harness.ranks.health_probe import FAULT_ENV, HealthOptions, health_task, parse_fault
from ddparity.harness.world import rendezvous
from ddparity.render import render_failure
from ddparity.report import HealthReport
from ddparity.settings import (
    HEALTH_CPU_RANKS,
    TIMEOUT_S,
    validate_min_busbw,
    validate_sizes_mib,
    validate_timeout,
    validate_world_size,
)
from ddparity.verbs.plan import failure, health_repro
from ddparity.verdicts import Failure


def options(sizes_mib: tuple[float, ...] | None = None) -> HealthOptions:
    parse_fault(os.environ.get(FAULT_ENV))  # a bad fault drill is a usage error, before anything starts
    if sizes_mib is None:
        return HealthOptions()
    validate_sizes_mib(sizes_mib, "health()")
    return HealthOptions(sizes_bytes=tuple(int(s * 2**20) for s in sizes_mib))


def health(world_size: int | None = None, backend: str = "auto", timeout: float = TIMEOUT_S,
           min_busbw: float | None = None, sizes_mib: tuple[float, ...] | None = None,
           thresholds: str | None = None) -> HealthReport:
    """Run the health checks on a local World of real ranks (``thresholds``: a JSON file of
    the hardware readings' limits, :func:`ddparity.checks.hardware.load_thresholds`)."""
    from ddparity.harness.world.world import World

    opts = options(sizes_mib)
    _check_numbers(timeout, min_busbw)
    limits = load_thresholds(thresholds)
    if world_size is None:
        gpus = rendezvous.cuda_device_count() if backend in ("auto", "nccl") else 0
        world_size = gpus if gpus else HEALTH_CPU_RANKS
    validate_world_size(world_size, "health()")
    chosen = rendezvous.resolve_backend(backend, world_size)
    report = HealthReport("local", chosen, world_size, repro=health_repro("ddparity", f"--world-size {world_size} --backend {chosen}",
                                                                      timeout, min_busbw, opts.sizes_bytes, FAULT_ENV))
    world = World(world_size, chosen)
    try:
        outcomes = world.start().run(health_task, opts, timeout=timeout)
    except WorldFailure as exc:
        return _failed(report, exc)
    finally:
        world.close()
    report.ranks = list(outcomes)
    report.checks, report.bandwidth = judge(report.ranks, min_busbw, limits)
    return report


def health_under_torchrun(emit: Callable[[HealthReport], None], backend: str = "auto", timeout: float = TIMEOUT_S,
                          min_busbw: float | None = None, sizes_mib: tuple[float, ...] | None = None,
                          thresholds: str | None = None) -> NoReturn:
    """This process's part of a torchrun-launched health check: every launched process
    measures, rank 0 (or, should it die, the lowest rank alive) judges and hands the report
    to ``emit``; every process exits with its code. Hangs and crashes are found by the
    launch's watch threads (:mod:`ddparity.harness.launch.watchdog`)."""
    from ddparity.verbs.launched import everyone

    opts = options(sizes_mib)
    _check_numbers(timeout, min_busbw)
    limits = load_thresholds(thresholds)

    def report_for(backend: str, world_size: int) -> HealthReport:
        return HealthReport("torchrun", backend, world_size,
                            repro=health_repro("torchrun <the same launch options> -m ddparity", f"--backend {backend}",
                                               timeout, min_busbw, opts.sizes_bytes, FAULT_ENV))

    def failed(exc: WorldFailure, stage: int) -> int:
        report = _failed(report_for(me.ctx.backend, me.ctx.world_size), exc)
        emit(report)
        return report.exit_code

    me = everyone(backend, timeout, failed)
    ranks = me.run(None, health_task, opts)
    report = report_for(me.ctx.backend, me.ctx.world_size)
    report.ranks = list(ranks)
    report.checks, report.bandwidth = judge(report.ranks, min_busbw, limits)
    emit(report)
    me.watch.finish(report.exit_code)


def _failed(report: HealthReport, exc: WorldFailure) -> HealthReport:
    ended = failure(exc)
    report.failure = Failure(ended.status, render_failure(ended), hang=ended.hang, crash=ended.crash)
    return report


def _check_numbers(timeout: float, min_busbw: float | None) -> None:
    validate_timeout(timeout, "health()")
    validate_min_busbw(min_busbw, "health()")


__all__ = ["health", "health_under_torchrun"]
