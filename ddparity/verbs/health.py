"""``health``: is this machine (or cluster) fit to train on? (``ddparity health``)

Locally it starts a World of real ranks (one per GPU under nccl, else 2 CPU ranks on
gloo); under torchrun each launched process is a rank (:mod:`ddparity.harness.launch.torchrun`).
The ranks measure (:mod:`ddparity.harness.health.probe`), rank 0 or the controller judges
(:mod:`ddparity.checks.health`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity.case import Case
from ddparity.checks.hardware import load_thresholds
from ddparity.checks.health import Check, judge, judge_pairs
from ddparity.errors import UsageError, WorldFailure
from ddparity.harness.health.allreduce_timing import NETWORK_ONLY, network_only
from ddparity.harness.health.probe import FAULT_ENV, HealthOptions, health_task, pairwise_task, parse_fault
from ddparity.harness.launch.gate_training import Training, health_then_training
from ddparity.harness.world import rendezvous
from ddparity.measurements import RankHealth
from ddparity.render import render_failure
from ddparity.report import HealthReport
from ddparity.run_kinds import kind
from ddparity.settings import (
    HEALTH_CPU_RANKS,
    HEALTH_LONG_SIZES_MIB,
    HEALTH_SIZES_MIB,
    NEWER_TORCH,
    TIMEOUT_S,
    torch_release,
    validate_min_busbw,
    validate_sizes_mib,
    validate_timeout,
    validate_world_size,
)
from ddparity.verbs.plan import failure, health_repro
from ddparity.verdicts import Failure


def options(sizes_mib: tuple[float, ...] | None = None, pairwise: bool = False, long: float | None = None) -> HealthOptions:
    parse_fault(os.environ.get(FAULT_ENV))  # a bad fault drill is a usage error, before anything starts
    if not isinstance(pairwise, bool):
        raise UsageError(f"health(): pairwise must be True or False, got {pairwise!r}")
    if long is not None:
        validate_timeout(long, "health(long=...)")
    if sizes_mib is None:
        sizes_mib = HEALTH_LONG_SIZES_MIB if long else HEALTH_SIZES_MIB
    validate_sizes_mib(sizes_mib, "health()")
    return HealthOptions(sizes_bytes=tuple(int(s * 2**20) for s in sizes_mib), pairwise=pairwise, long_s=long or 0.0)


def _flags(pairwise: bool, long: float | None, thresholds: str | None) -> str:
    """The reproduce line's flags for what was asked beyond the defaults."""
    import shlex

    return ((" --pairwise" if pairwise else "") + (f" --long {long:g}" if long else "")
            + (f" --thresholds {shlex.quote(thresholds)}" if thresholds else ""))


def health(world_size: int | None = None, backend: str = "auto", timeout: float = TIMEOUT_S,
           min_busbw: float | None = None, sizes_mib: tuple[float, ...] | None = None,
           thresholds: str | None = None, pairwise: bool = False, long: float | None = None) -> HealthReport:
    """Run the health checks on a local World of real ranks (``thresholds``: a JSON file of
    the hardware readings' limits, :func:`ddparity.checks.hardware.load_thresholds`;
    ``pairwise``: all-reduce bandwidth pair by pair, and under nccl again through the
    network alone, in fresh ranks; ``long``: seconds of a stress pass, every result checked)."""
    from ddparity.harness.world.world import World

    opts = options(sizes_mib, pairwise, long)
    _check_numbers(timeout, min_busbw)
    limits = load_thresholds(thresholds)
    if world_size is None:
        gpus = rendezvous.cuda_device_count() if backend in ("auto", "nccl") else 0
        world_size = gpus if gpus else HEALTH_CPU_RANKS
    validate_world_size(world_size, "health()")
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault and max(fault.rank, fault.peer or 0) >= world_size:
        raise UsageError(f"${FAULT_ENV}={os.environ[FAULT_ENV]!r} drills a rank the world of {world_size} does not "
                         f"have: name ranks 0 to {world_size - 1}")
    chosen = rendezvous.resolve_backend(backend, world_size)
    flags = f"--world-size {world_size} --backend {chosen}" + _flags(pairwise, long, thresholds)
    report = HealthReport("local", chosen, world_size, repro=health_repro("ddparity", flags, timeout, min_busbw,
                                                                      opts.sizes_bytes, FAULT_ENV))
    try:
        report.ranks = list(_in_world(World(world_size, chosen), health_task, opts, timeout))
        network = (_in_world(World(world_size, chosen, env=NETWORK_ONLY), pairwise_task, opts, timeout)
                   if pairwise and chosen == "nccl" else None)
    except WorldFailure as exc:
        return _failed(report, exc)
    report.checks, report.bandwidth = judge(report.ranks, min_busbw, limits)
    if pairwise:
        _judge_pairs(report, [p for r in report.ranks for p in r.pairs])
    if network is not None:
        _judge_pairs(report, [p for pairs in network for p in pairs], "pairwise (network only)")
    report.checks.append(training(world_size, chosen, timeout))
    return report


def _in_world(world: Any, task: Callable[..., Any], opts: HealthOptions, timeout: float) -> list[Any]:
    try:
        return list(world.start().run(task, opts, timeout=timeout))
    finally:
        world.close()


def _judge_pairs(report: HealthReport, timings: list[Any], name: str = "pairwise") -> None:
    check, rows = judge_pairs(timings, name)
    report.checks.append(check)
    report.pairs += rows


TRAINING_STEPS = 3
"""The gate's training: a small MLP, SGD, this many steps, 8 samples a rank (:func:`gate_case`)."""


def _step(model: Any, batch: Any, optimizer: Any, ctx: Any, drilled: int | None = None) -> Any:
    """ddparity's own step (cross-entropy, SGD); on the drilled rank (``wrong_step@RANK``)
    the replica moves before its first step, as a node that trains wrong would."""
    import torch
    import torch.nn.functional as F

    x, y = batch
    if drilled is not None and ctx.world_size > 1 and ctx.rank == drilled and not getattr(model, "_drilled", False):
        model._drilled = True
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def gate_case() -> Case:
    """The gate's training as a Case: a small MLP, SGD, :data:`TRAINING_STEPS` steps, 8
    samples a rank of the world ``$WORLD_SIZE`` names (the launched gate's target,
    ``ddparity.verbs.health:gate_case``); the drill ``wrong_step@RANK`` from the environment."""
    return _case(int(os.environ.get("WORLD_SIZE", "1")))


def _case(world_size: int) -> Case:
    from ddparity.fixtures.models import MLP, vectors

    fault = parse_fault(os.environ.get(FAULT_ENV))
    drilled = fault.rank if fault and fault.kind == "wrong_step" else None
    return Case(model=MLP, data=functools.partial(vectors, batch=8 * world_size), optimizer="sgd", lr=0.1,
                steps=TRAINING_STEPS, train_step=functools.partial(_step, drilled=drilled), name="health: MLP + SGD")


def training_modes() -> tuple[str, ...]:
    return ("single", "ddp", "fsdp") if torch_release() >= NEWER_TORCH else ("single", "ddp")


def training(world_size: int, backend: str, timeout: float) -> Check:
    """The gate's last check: a real training step, ``check`` of a small built-in MLP across
    the world (DDP, and FSDP2 where this torch runs it) against one device (see
    :func:`training_check`)."""
    from ddparity.harness.world.pool import WorldPool
    from ddparity.verbs.check import check

    pool = WorldPool()
    try:
        report = check(_case(world_size), modes=training_modes(), world_sizes=(world_size,), backend=backend,
                       timeout=timeout, pool=pool)
    finally:
        pool.close()
    return training_check(report.to_json()["runs"], world_size)


def training_check(runs: list[dict[str, Any]], world_size: int, where: str = "") -> Check:
    """The ``training`` row from a check's runs (its JSON): ``pass`` when every replica run
    passed (or was skipped), else ``fail`` naming the runs that differ, hang or crash and the
    ranks their own evidence names: a desync's (replicas that drift apart), a hang's
    suspects, the crashed rank; a divergence names none (where it was first seen is not who
    caused it: under FSDP every rank sees a shard's error)."""
    replicas = [r for r in runs if not kind(r["mode"]).reference]
    bad = [r for r in replicas if r["status"] not in ("pass", "skipped")]
    if not bad:
        ran = [r["mode"] for r in replicas if r["status"] == "pass"]
        return Check("training", "pass", f"a small MLP trains the same under {' and '.join(ran)} at {world_size} "
                                         f"rank(s){where} as on one device ({TRAINING_STEPS} SGD steps)")
    ranks = sorted({rank for r in bad for rank in _blamed(r)})
    said = "; ".join(f"{r['mode']} at {world_size} rank(s) {r['status'].upper()}" + _why(r) for r in bad)
    return Check("training", "fail", f"a small MLP trains differently{where} than on one device: {said}", ranks)


def _blamed(run: dict[str, Any]) -> list[int]:
    if run.get("desync"):
        return list(run["desync"]["ranks"])
    if run.get("hang"):
        return list(run["hang"]["suspect_ranks"])
    return [run["crash"]["rank"]] if run.get("crash") else []


def _why(run: dict[str, Any]) -> str:
    cause = next((n[len("likely cause: "):] for n in run.get("notes") or () if n.startswith("likely cause: ")), None)
    if cause:
        return f" ({cause.split(';')[0]})"
    first = run.get("first_divergence")
    if first:
        what = "the loss" if first["kind"] == "loss" else f"{first['kind']} {first['name']!r}"
        return f" (first divergence: step {first['step']}, {what}, rank {first['rank']})"
    return f" ({run['reason'].splitlines()[0]})" if run.get("reason") else ""


def health_under_torchrun(emit: Callable[[HealthReport], None], backend: str = "auto", timeout: float = TIMEOUT_S,
                          min_busbw: float | None = None, sizes_mib: tuple[float, ...] | None = None,
                          thresholds: str | None = None, pairwise: bool = False,
                          long: float | None = None) -> NoReturn:
    """This process's part of a torchrun-launched health check: every launched process
    measures, rank 0 (or, should it die, the lowest rank alive) judges and hands the report
    to ``emit``; every process exits with its code. Hangs and crashes are found by the
    launch's watch threads (:mod:`ddparity.harness.launch.watchdog`)."""
    from ddparity.verbs.launched import everyone

    opts = options(sizes_mib, pairwise, long)
    _check_numbers(timeout, min_busbw)
    limits = load_thresholds(thresholds)

    def report_for(backend: str, world_size: int) -> HealthReport:
        return HealthReport("torchrun", backend, world_size,
                            repro=health_repro("torchrun <the same launch options> -m ddparity",
                                               f"--backend {backend}" + _flags(pairwise, long, thresholds),
                                               timeout, min_busbw, opts.sizes_bytes, FAULT_ENV))

    def failed(exc: WorldFailure, stage: int) -> int:
        report = _failed(report_for(me.ctx.backend, me.ctx.world_size), exc)
        emit(report)
        return report.exit_code

    me = everyone(backend, timeout, failed)
    ranks = me.run(None, health_then_training, opts, Training(training_modes(), timeout))
    report = report_for(me.ctx.backend, me.ctx.world_size)
    report.ranks = list(ranks)
    report.checks, report.bandwidth = judge(report.ranks, min_busbw, limits)
    if pairwise:
        _judge_pairs(report, [p for r in report.ranks for p in r.pairs],
                     "pairwise (network only)" if network_only(me.ctx.backend) else "pairwise")
        if me.ctx.backend == "nccl" and not network_only(me.ctx.backend):
            report.checks.append(Check("pairwise (network only)", "skip", "NCCL reads its transports once per "
                                       "process: launch again with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 set on "
                                       "every node for the network alone"))
    report.checks.append(launched_training(report.ranks))
    emit(report)
    me.watch.finish(report.exit_code)


def launched_training(ranks: list[RankHealth]) -> Check:
    """The ``training`` row of a launch: the check its children ran as a launch of their own
    (:mod:`ddparity.harness.launch.gate_training`), judged as locally; a child that did not
    finish or a check that gave no report fails, naming those ranks, with the command."""
    got = {r.rank: r.training or {} for r in ranks}
    first = got[min(got)]
    late = sorted(rank for rank, t in got.items() if t.get("exit") is None)
    if late:
        return Check("training", "fail", f"the gate's training launch did not finish on rank(s) {late} "
                                         f"({got[late[0]].get('output', '')}): python -m {first.get('command')}", late)
    if "runs" not in first:
        said = (first.get("output") or "").strip().splitlines()
        return Check("training", "fail", f"the gate's training launch gave no report (exit {first.get('exit')}): "
                                         f"{said[-1] if said else 'no output'}; python -m {first.get('command')}")
    return training_check(first["runs"], len(ranks), where=" in the launch")


def _failed(report: HealthReport, exc: WorldFailure) -> HealthReport:
    ended = failure(exc)
    report.failure = Failure(ended.status, render_failure(ended), hang=ended.hang, crash=ended.crash)
    return report


def _check_numbers(timeout: float, min_busbw: float | None) -> None:
    validate_timeout(timeout, "health()")
    validate_min_busbw(min_busbw, "health()")


__all__ = ["health", "health_under_torchrun"]
