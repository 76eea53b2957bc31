"""``profile``: a case's DDP (or FSDP2) communication at each world size (``ddparity profile``).

Runs in the same warm worlds as :func:`ddparity.check`, with the same hang and crash
detection; the rank side is :mod:`ddparity.harness.ranks.modes.timed`, the figures
:mod:`ddparity.checks.comm`.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from ddparity.case import Case
from ddparity.checks.comm import WorldProfile, add_scaling, percentile, size_text, summarize
from ddparity.errors import UsageError, WorldFailure, WorldStartError
from ddparity.harness.ranks.modes.timed_dp import dp_profile_task
from ddparity.harness.ranks.tasks import prepare_task, profile_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import WorldPool, default_pool
from ddparity.render import render_failure
from ddparity.report import ProfileReport
from ddparity.run_kinds import REPLICA_MODES, kind
from ddparity.settings import (
    PROFILE_MODES,
    PROFILE_STEPS,
    PROFILE_WARMUP,
    PROFILE_WORLD_SIZES,
    REAL_RANKS_LIMIT,
    TIMEOUT_S,
    CheckOptions,
    validate_count,
)
from ddparity.verbs.plan import cannot_run, choose_backend, failure, profile_repro
from ddparity.verbs.profile_arms import Arm, Sweep, arms


def profile(
    case: Case,
    world_sizes: tuple[int, ...] | list[int] = PROFILE_WORLD_SIZES,
    backend: str = "auto",
    timeout: float = TIMEOUT_S,
    *,
    steps: int = PROFILE_STEPS,
    warmup: int = PROFILE_WARMUP,
    pool: WorldPool | None = None,
    modes: tuple[str, ...] | list[str] = PROFILE_MODES,
    hsdp_shard: int | None = None,
    bucket_cap_mb: tuple[float, ...] | list[float] | None = None,
    bucket_cap_mb_list: tuple[tuple[float, ...], ...] | list[list[float]] | None = None,
    ddp: tuple[str, ...] | list[str] | None = None,
    comm_hooks: tuple[str, ...] | list[str] | None = None,
) -> ProfileReport:
    """Time ``case`` under DDP (and/or ``modes`` ``fsdp``, ``hsdp``: FSDP2) at every world
    size: step (median and p95), compute, exposed and total communication, each collective
    op's time and bytes, bus bandwidth, overlap, scaling efficiency and the state a rank
    holds; DDP's settings swept as arms of their own (``bucket_cap_mb`` sizes,
    ``bucket_cap_mb_list`` lists of caps bucket by bucket, ``ddp`` options turned on,
    torch's ``comm_hooks``: :mod:`ddparity.verbs.profile_arms`), every
    arm timed at each world size in the same warm world, one after another."""
    if not isinstance(case, Case):
        raise UsageError(f"profile() needs a ddparity.Case, got {type(case).__name__}")
    if backend == "threaded":
        raise UsageError("profiling needs real rank processes: simulated (threaded) ranks share one process "
                         "and their timings mean nothing; use --backend auto, gloo or nccl")
    validate_count(steps, "steps", "profile()")
    validate_count(warmup, "warmup", "profile()", least=0)
    opts = CheckOptions.validated("profile()", modes=modes, world_sizes=world_sizes, backend=backend,
                                  timeout=timeout, hsdp_shard=hsdp_shard)
    unprofiled = [m for m in opts.modes if m not in REPLICA_MODES and not kind(m).one_process]
    if unprofiled:
        raise UsageError(f"profile() times dp, ddp, fsdp and hsdp; not {', '.join(unprofiled)} (one device: the "
                         f"smallest world size of a mode is its baseline)")
    sweep = arms(case, opts.modes, Sweep.of(bucket_cap_mb, bucket_cap_mb_list, ddp, comm_hooks))
    case = case.validate()
    opts = opts.for_case(case)
    chosen = choose_backend(opts.backend, opts.world_sizes)
    pool = pool or default_pool()
    report = ProfileReport(case.label)
    started = time.perf_counter()
    with Spool() as spool:  # the initial state, memory-mapped by every rank
        try:
            [(batch_sizes, _)] = pool.get(1, chosen, role="reference").run(prepare_task, case, spool.path,
                                                                           timeout=opts.timeout)
        except WorldFailure as exc:
            for arm in sweep:
                for ws in opts.world_sizes:
                    run = failed_run(ws, chosen, exc, time.perf_counter() - started, arm.mode)
                    report.runs.append(_as_arm(run, arm, case, chosen, steps, warmup, opts))
            return report
        rows: dict[tuple[int, int], WorldProfile] = {}
        for ws in opts.world_sizes:  # each world warm once, its arms one after another
            for i, arm in enumerate(sweep):
                if arm.not_on_gloo and chosen == "gloo":
                    run = WorldProfile(world_size=ws, backend="gloo", mode=arm.mode, status="skipped",
                                       reason=arm.not_on_gloo)
                elif kind(arm.mode).one_process:
                    run = _profile_dp(case, opts, chosen, ws, spool.path, batch_sizes, steps, warmup, pool)
                else:
                    run = _profile_one(arm.case, opts, chosen, (arm.mode, ws), spool.path, batch_sizes, steps, warmup,
                                       pool)
                rows[i, ws] = _as_arm(run, arm, case, run.backend, steps, warmup, opts)
        report.runs = [rows[key] for key in sorted(rows)]  # the table: arm by arm, world sizes in order
    add_scaling(report.runs)
    return report


def _as_arm(run: WorldProfile, arm: Arm, case: Case, backend: str, steps: int, warmup: int,
            opts: CheckOptions) -> WorldProfile:
    arm.row(run)
    run.repro = profile_repro(case, run.world_size, backend, steps, warmup, opts.timeout, arm.mode, shard(opts),
                              (arm.flags, arm.call))
    return run


def _profile_one(case: Case, opts: CheckOptions, backend: str, planned: tuple[str, int], state: Any,
                 batch_sizes: list[int], steps: int, warmup: int, pool: WorldPool) -> WorldProfile:
    mode, ws = planned
    started = time.perf_counter()
    if opts.backend == "auto" and backend == "gloo" and ws > REAL_RANKS_LIMIT:
        return WorldProfile(world_size=ws, backend=backend, mode=mode, status="skipped",
                            reason=f"{ws} ranks exceed this machine's limit for real processes ({REAL_RANKS_LIMIT}, "
                                   f"2 x CPUs); profiling needs real ones. Force it with --backend gloo "
                                   f"(oversubscribed: the figures will say more about the CPUs than the network)")
    unrunnable = cannot_run(case, opts, backend, ws, batch_sizes, mode)
    if unrunnable is not None:
        return WorldProfile(world_size=ws, backend=backend, mode=mode, status=unrunnable.status,
                            reason=unrunnable.reason)
    try:
        outcomes = pool.get(ws, backend).run(profile_task, case, state, steps, warmup, mode, shard(opts),
                                             timeout=opts.timeout)
    except WorldStartError as exc:
        return WorldProfile(world_size=ws, backend=backend, mode=mode, status="error", reason=str(exc),
                            seconds=time.perf_counter() - started)
    except WorldFailure as exc:
        return failed_run(ws, backend, exc, time.perf_counter() - started, mode)
    run = summarize(outcomes, backend, mode)
    run.seconds = time.perf_counter() - started
    cpus = os.cpu_count() or 1
    if backend == "gloo" and ws > cpus:
        run.notes.append(f"oversubscribed: {ws} ranks on {cpus} CPUs; communication waits for descheduled ranks")
    if ws == 1:
        run.notes.append(one_rank_note(mode))
    mesh = kind(mode).mesh_note(ws, shard(opts))
    if mesh:
        run.notes.append(mesh)
    return run


def _profile_dp(case: Case, opts: CheckOptions, backend: str, ws: int, state: Any, batch_sizes: list[int],
                steps: int, warmup: int, pool: WorldPool) -> WorldProfile:
    """DataParallel over ``ws`` CUDA devices in the reference's one process
    (:mod:`ddparity.harness.ranks.modes.timed_dp`), or the row that says why not here."""
    started = time.perf_counter()
    try:
        [answer] = pool.get(1, backend, role="reference").run(dp_profile_task, case, state, steps, warmup, ws,
                                                              timeout=opts.timeout)
    except WorldFailure as exc:
        return failed_run(ws, backend, exc, time.perf_counter() - started, "dp")
    if isinstance(answer, str):
        return WorldProfile(world_size=ws, backend=backend, mode="dp", status="skipped", reason=answer)
    seconds, peaks = answer
    step = statistics.median(seconds)
    run = WorldProfile(world_size=ws, backend=backend, mode="dp", device="cuda", steps=len(seconds),
                       samples_per_step=batch_sizes[0] if batch_sizes else 0, step_s=step,
                       step_p95_s=percentile(seconds, 0.95), memory_per_rank={"peak_allocated": max(peaks)},
                       seconds=time.perf_counter() - started)
    run.samples_per_s = run.samples_per_step / step if step > 0 else None
    others = statistics.mean(peaks[1:])
    run.notes.append(f"one process over {ws} devices: no communication figures (DataParallel scatters, replicates "
                     f"and gathers inside its forward); step = the training loop's whole step, every device "
                     f"synchronised")
    run.notes.append(f"peak allocated per device: {', '.join(f'cuda:{i} {size_text(p)}' for i, p in enumerate(peaks))}"
                     + (f"; device 0 holds {peaks[0] / others:.2f}x the others' mean (the gathered outputs, the loss)"
                        if others > 0 else ""))
    return run


def one_rank_note(mode: str) -> str:
    """What a one-rank profile's exposed time is."""
    if kind(mode).buckets:
        return ("one rank: no bus bandwidth; its exposed time is DDP's own synchronisation work (bucket copies, the "
                "comm hook, a local all-reduce), the floor for larger worlds")
    return ("one rank: no bus bandwidth; its exposed time is FSDP's own work around its collectives (copies in and "
            "out of the all-gather and reduce-scatter buffers, local collectives), the floor for larger worlds")


def shard(opts: CheckOptions) -> int:
    """Mode hsdp's shard size, resolved (0 where no run on a (replicate, shard) mesh is asked for)."""
    return opts.shard if any(kind(m).mesh for m in opts.modes) else 0


def failed_run(ws: int, backend: str, exc: WorldFailure, seconds: float, mode: str = "ddp") -> WorldProfile:
    """A hang, crash or error while profiling, with the evidence ``check`` would give."""
    ended = failure(exc)
    return WorldProfile(world_size=ws, backend=backend, mode=mode, status=ended.status, reason=render_failure(ended),
                        hang=ended.hang, crash=ended.crash, seconds=seconds)


__all__ = ["profile"]
