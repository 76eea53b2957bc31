"""``profile`` inside a torchrun (or Slurm) launch: the launched processes are the world
(``torchrun ... -m ddparity profile TARGET [--modes ddp,fsdp,hsdp]``). Rank 0 times the case
alone first (the baseline of the scaling figure), then every rank times its steps, arm after
arm (each mode, DDP's swept settings: :mod:`ddparity.verbs.profile_arms`); rank 0 summarises
them (:mod:`ddparity.checks.comm`) and reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity.case import Case
from ddparity.checks.comm import WorldProfile
from ddparity.errors import UsageError, WorldFailure
from ddparity.run_kinds import REPLICA_MODES, kind
from ddparity.settings import CheckOptions, needs_newer_torch
from ddparity.verbs.launched import everyone, launch_world_size, processes
from ddparity.verbs.profile_arms import Arm, Sweep, arms


def profile_launched(case: Case, backend: str, timeout: float, steps: int, warmup: int,
                     emit: Callable[[Any], None], modes: tuple[str, ...] | list[str] = ("ddp",),
                     hsdp_shard: int | None = None, sweep: Sweep = Sweep()) -> NoReturn:
    """This process's part of ``profile`` in a launch: rank 0 times the case on its own
    first (world size 1, in a process group of its own: the baseline of the scaling
    figure), then every rank times its steps, arm after arm (ddp, fsdp, hsdp, DDP's swept
    settings); rank 0 summarises them and reports; every process exits with the report's
    code."""
    from ddparity.checks.comm import add_scaling, summarize
    from ddparity.harness.ranks.tasks import profile_task
    from ddparity.harness.ranks.training import initial_state
    from ddparity.report import ProfileReport
    from ddparity.verbs.profile import failed_run, one_rank_note

    if backend == "threaded":
        raise UsageError("profiling needs real rank processes: use --backend auto, gloo or nccl")
    needs_newer_torch("ddparity profile under torchrun", "profile locally (ddparity profile TARGET)")
    opts = CheckOptions.validated("profile", modes=modes, world_sizes=(launch_world_size(),), timeout=timeout,
                                  hsdp_shard=hsdp_shard)
    if any(m not in REPLICA_MODES for m in opts.modes):
        raise UsageError("profile times ddp, fsdp and hsdp (--modes); single and dp have no communication to time")
    case = case.validate()
    every = arms(case, opts.modes, sweep)  # bad sweeps refused before any work
    shard = opts.for_case(case).shard
    started = time.perf_counter()
    runs: list[Any] = []
    ran: list[Arm] = []  # the arms this launch can time (its backend decided once it is up)
    timing = [every[0].mode]  # the mode being timed, for a failure's report

    def failed(exc: WorldFailure, stage: int) -> int:
        ws = 1 if stage == 1 else me.ctx.world_size
        report = ProfileReport(case.label, [*runs, failed_run(ws, me.ctx.backend, exc, time.perf_counter() - started,
                                                              timing[0])])
        emit(report)
        return report.exit_code

    def baseline() -> None:
        for arm in ran:
            if kind(arm.mode).skip_reason(1, shard) is not None:
                continue  # no (replicate, shard) mesh of one rank but the degenerate one
            timing[0] = arm.mode
            one = summarize([me.alone(profile_task, arm.case, initial_state(case), steps, warmup, arm.mode, shard)],
                            me.ctx.backend, arm.mode)
            one.notes += [one_rank_note(arm.mode), "rank 0 alone: the baseline of the scaling figure"]
            runs.append(arm.row(one))

    def every_arm(ctx: Any) -> list[Any]:
        profiles = []
        for arm in ran:
            timing[0] = arm.mode
            profiles.append(profile_task(ctx, arm.case, initial_state(case), steps, warmup, arm.mode, shard))
        return profiles

    me = everyone(backend, timeout, failed)
    skipped = {}
    for arm in every:
        reason = kind(arm.mode).skip_reason(me.ctx.world_size, shard) or (
            arm.not_on_gloo if me.ctx.backend == "gloo" else None)
        if reason is None:
            ran.append(arm)
        else:
            skipped[arm.label] = reason
    # every rank builds the initial state from the seed; DDP broadcasts rank 0's anyway
    by_rank = me.run(baseline, every_arm)
    for i, arm in enumerate(ran):
        run = summarize([profiles[i] for profiles in by_rank], me.ctx.backend, arm.mode)
        run.seconds = time.perf_counter() - started
        run.notes.append(f"launched: {processes(me.ctx.world_size)}; bus bandwidth over the launch's own "
                         f"interconnect")
        mesh = kind(arm.mode).mesh_note(me.ctx.world_size, shard)
        if mesh:
            run.notes.append(mesh)
        runs.append(arm.row(run))
    for arm in every:
        if arm.label in skipped:
            runs.append(arm.row(WorldProfile(world_size=me.ctx.world_size, backend=me.ctx.backend, mode=arm.mode,
                                             status="skipped", reason=skipped[arm.label])))
    order = {arm.label: i for i, arm in enumerate(every)}
    report = ProfileReport(case.label, sorted(runs, key=lambda r: (REPLICA_MODES.index(r.mode), order[r.label], r.world_size)))
    add_scaling(report.runs)
    emit(report)
    me.watch.finish(report.exit_code)


__all__ = ["profile_launched"]
