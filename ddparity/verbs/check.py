"""``check``: run a Case in every requested mode and world size, compare to the reference.

The controller decides and reports; user code (model factories, data, training) runs only
inside rank processes, so a model that hangs or segfaults becomes a report, never a
stuck or dead controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddparity.case import Case
from ddparity.checks.collectives import LiveWatch
from ddparity.compile_spec import COMPILE_DDP, CompileSpec
from ddparity.distances import Distances
from ddparity.errors import Interrupted, TaskFailed, UsageError, WorldFailure, WorldStartError
from ddparity.harness.ranks.compiled_blocks import compiled_replica_blocks_task
from ddparity.harness.ranks.probes import dp_trace_task, loss_scaling_task, reference_trace_task, replica_trace_task
from ddparity.harness.ranks.tasks import dp_task, prepare_task, reference_task, replica_run_name, replica_task
from ddparity.harness.ranks.threaded import threaded_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import THREADS, WorldPool, default_pool
from ddparity.harness.world.simulated import as_simulated
from ddparity.harness.world.world import PendingTask
from ddparity.report import Report
from ddparity.run_kinds import FLAT_SHARDED_MODE, REFERENCE_MODE, asked, kind
from ddparity.settings import (
    CHECK_MODES,
    CHECK_WORLD_SIZES,
    REAL_RANKS_LIMIT,
    TIMEOUT_S,
    CheckOptions,
)
from ddparity.verbs.checking import Checking, Planned, mark
from ddparity.verbs.compiled import (
    DP_NOT_COMPILED,
    compared_nothing,
    compile_figures,
    compiled_single,
    dropout_drawn,
    fewer_ops,
    locate_compiled,
    refused_run,
    summary_notes,
)
from ddparity.verbs.plan import choose_backend, run_backend
from ddparity.verdicts import RunResult


def check(
    case: Case,
    modes: tuple[str, ...] | list[str] = CHECK_MODES,
    world_sizes: tuple[int, ...] | list[int] = CHECK_WORLD_SIZES,
    backend: str = "auto",
    timeout: float = TIMEOUT_S,
    tolerance: str | float = "auto",
    *,
    steps: int | None = None,
    hsdp_shard: int | None = None,
    compile: str | None = None,  # noqa: A002 - SPEC's name: check(case, compile="inductor")
    compile_ddp: str | None = None,
    pool: WorldPool | None = None,
) -> Report:
    """Run ``case`` in every mode and world size; compare each run to the reference
    (``hsdp_shard``: mode hsdp's shard size, overriding the Case's; ``compile``: a
    ``torch.compile`` backend, every mode then also runs compiled, ``compile_ddp`` choosing
    Dynamo's DDP path, see :mod:`ddparity.verbs.compiled`)."""
    if not isinstance(case, Case):
        raise UsageError(f"check() needs a ddparity.Case, got {type(case).__name__}")
    opts = CheckOptions.validated("check()", modes=modes, world_sizes=world_sizes, backend=backend,
                                  timeout=timeout, tolerance=tolerance, steps=steps, hsdp_shard=hsdp_shard,
                                  compile=compile, compile_ddp=compile_ddp)
    checking = Checking.of(case, opts)
    chosen = choose_backend(opts.backend, opts.world_sizes)
    pool = pool or default_pool()
    report = Report(checking.case.label)
    doing = _Doing()
    with Spool() as spool:
        try:
            return _check(checking, chosen, pool, report, spool, doing)
        except KeyboardInterrupt as exc:  # Ctrl-C: the runs finished so far, and where the ranks were
            places = list(getattr(exc, "places", []))
            others = pool.interrupt()  # runs that trained alongside the one waited on
            if others:
                places = [f"{doing.run}: {p}" for p in places] + [f"{label}: {p}" for label, found in others
                                                                   for p in found]
            raise Interrupted(places, Report(report.case, [*report.runs, *doing.finished]), doing.run) from None


@dataclass
class _Doing:
    """What a check is doing, for a Ctrl-C's report: the run in progress, the DDP runs done."""

    run: str = "the set-up (the initial state, every step's global batch)"
    finished: list[RunResult] = field(default_factory=list)


def _check(checking: Checking, chosen: str, pool: WorldPool, report: Report, spool: Spool, doing: _Doing) -> Report:
    case, opts = checking.case, checking.opts
    started = time.perf_counter()
    replicas = [run for run in checking.planned() if kind(run[0]).replicated]
    ddp_sizes = tuple(sorted({ws for _, ws, _ in replicas}))
    dp_modes = asked(opts.modes, "one_process")
    dp_sizes = opts.world_sizes if dp_modes else ()
    backends = {ws: run_backend(opts, chosen, ws) for ws in ddp_sizes}
    if "threaded" in backends.values():
        pool.expect(1, "gloo", role=THREADS)  # its host starts clean, from the forkserver: warm it meanwhile
    try:
        ref_world = pool.get(1, chosen, role="reference")
        [(batch_sizes, valid)] = ref_world.run(prepare_task, case, spool.path, timeout=opts.timeout)
        doing.run = "the single-device reference"
        ref_pending = ref_world.submit(reference_task, case, spool.path, tuple(ddp_sizes) + tuple(dp_sizes),
                                       checking.sharded, timeout=opts.timeout)
    except WorldFailure as exc:
        return checking.failed_everywhere(report, chosen, exc, time.perf_counter() - started)
    # The first runnable replicated run trains alongside the reference (comparing each step
    # as the reference writes it); the others follow.
    plan = {(mode, ws, spec): checking.cannot_run(backends[ws], ws, batch_sizes, mode, spec)
            for mode, ws, spec in replicas}
    first = next((run for run, reason in plan.items() if reason is None and run[2] is None), None)
    early = _start(checking, backends[first[1]], first, pool, spool) if first is not None else None
    try:
        [reference] = [o.value for o in ref_pending.result()]
    except WorldFailure as exc:
        spool.abort()  # the early run waits for steps that will not come
        if early is not None and not isinstance(early[1], RunResult):
            try:
                early[1].result()
            except WorldFailure:
                pass
        return checking.failed_everywhere(report, chosen, exc, time.perf_counter() - started)
    checking.referenced(reference, valid)
    checking.loss_probe = lambda: _probe(ref_world if not ref_world.busy else pool.get(1, chosen, role="probe"),
                                         checking, spool)
    checking.locator = lambda mode, ws, backend, step, size, inside=None: _locate(
        ref_world if not ref_world.busy else pool.get(1, chosen, role="probe"), pool, checking, spool,
        (mode, ws, backend), step, size, inside)
    blowup = checking.blowup
    report.runs += checking.reference_rows(chosen, time.perf_counter() - started, blowup.reason() if blowup else None)
    if checking.sharded and case.fsdp is not None:
        _policy_run(checking, ref_world, spool)
    noise = None
    if opts.compile is not None:  # what compiling alone does: the compiled runs' noise floor
        refused = dropout_drawn(reference)
        if refused is None:
            single, noise = compiled_single(checking, opts.compile, ref_world, spool)
        else:
            single = refused_run(checking, opts.compile, REFERENCE_MODE, 1, chosen, refused)
            plan.update({(mode, ws, spec): refused_run(checking, spec, mode, ws, backends[ws], refused)
                         for (mode, ws, spec), reason in plan.items() if spec is not None and reason is None})
        if asked(opts.modes, "reference"):
            report.runs.append(single)
    dp_started = time.perf_counter()
    dp_pending = ref_world.submit(dp_task, case, spool.path, dp_sizes, timeout=opts.timeout) if dp_sizes else None
    ddp_runs = doing.finished
    for (mode, ws, spec), unrunnable in plan.items():
        if unrunnable is not None:
            ddp_runs.append(mark(unrunnable, spec))
            continue
        doing.run = f"{mode} world_size={ws} ({backends[ws]}{', ' + spec.label(mode) if spec else ''})"
        launched = early if (mode, ws, spec) == first and early is not None else _start(
            checking, backends[ws], (mode, ws, spec), pool, spool)
        ddp_runs.append(_finish(checking, backends[ws], (mode, ws, spec), launched,
                                noise if spec is not None else None))
    doing.run = f"dp world sizes {list(dp_sizes)}"
    for mode in dp_modes:
        report.runs.extend(_finish_dp(checking, mode, chosen, dp_sizes, dp_pending, dp_started, lambda sizes: (
            ref_world.submit(dp_task, case, spool.path, sizes, timeout=opts.timeout))))
        if opts.compile is not None:
            report.runs.extend(mark(RunResult(mode=mode, world_size=ws, backend=chosen, status="skipped",
                                              reason=DP_NOT_COMPILED), opts.compile) for ws in dp_sizes)
    report.runs.extend(ddp_runs)
    if opts.compile is not None:
        fewer_ops(ddp_runs, single)
        locate_compiled(report.runs, lambda run: _search_compiled(pool, checking, spool, run))
    if reference.dropout_calls and report.runs:
        report.runs[0].notes.insert(0, f"random draws compared on: every mode and rank drew the same dropout mask or "
                                       f"values for the same sample ({reference.dropout_calls} draw(s) a step: "
                                       f"dropouts, stochastic depth, per-sample noise or timesteps)")
    return report


def _policy_run(checking: Checking, world: Any, spool: Spool) -> None:
    """The user's own FSDP set-up (``Case.fsdp``: its ``MixedPrecisionPolicy``) on one rank:
    its distance to the reference is what the policy alone does to the numbers, the noise
    floor of the sharded runs that compute in its lower precision. Should that one-rank run
    fail, the sharded runs report it."""
    try:
        [distances] = world.run(replica_task, checking.case, spool.path, FLAT_SHARDED_MODE, 1,
                                timeout=checking.opts.timeout, shown_as=replica_run_name(FLAT_SHARDED_MODE))
    except WorldFailure:
        return
    checking.policy_noise(distances)


def _probe(world: Any, checking: Checking, spool: Spool) -> float | None:
    """The loss-scaling probe in the reference's world, or a world of one rank beside it while
    that one trains DataParallel (None should it fail: the causes are then named as
    candidates)."""
    try:
        [ratio] = world.run(loss_scaling_task, checking.case, spool.path, timeout=checking.opts.timeout)
    except WorldFailure:
        return None
    return ratio


def _locate(ref_world: Any, pool: WorldPool, checking: Checking, spool: Spool, run: tuple[str, int, str],
            step: int, size: int, inside: tuple[str, int, float] | None = None) -> list[Any] | str:
    """A failing run's step ``step`` re-run module by module (``inside``: that module call's
    aten ops): the reference's in its world (or one beside it) and, at the same time, the
    run's ranks in a world like the run's; every rank's answer, or why there is none."""
    mode, ws, backend = run
    case, timeout = checking.case, checking.opts.timeout
    call = inside[:2] if inside is not None else None
    try:
        if kind(mode).one_process:  # DataParallel: its replicas in one process, after the reference
            ref_world.run(reference_trace_task, case, spool.path, step, size, call, timeout=timeout)
            return list(ref_world.run(dp_trace_task, case, spool.path, ws, step, size, timeout=timeout))
        # the reference re-runs beside the ranks, which wait for its record once they have their own
        reference = ref_world.submit(reference_trace_task, case, spool.path, step, size, call, timeout=timeout)
        try:
            return _ranks_trace(pool, checking, spool.path, run, step, size, inside)
        finally:
            reference.result()
    except (WorldFailure, WorldStartError) as exc:
        return _rerun_failed(step, exc)


def _ranks_trace(pool: WorldPool, checking: Checking, spool: str, run: tuple[str, int, str], step: int,
                 size: int, inside: tuple[str, int, float] | None) -> list[Any]:
    """Every rank's answer of a run's re-run of step ``step`` (``inside``: that module call's ops)."""
    (mode, ws, backend), case, timeout = run, checking.case, checking.opts.timeout
    shard_size = kind(mode).shard_size(ws, checking.opts.shard)
    if backend == "threaded":
        host = pool.get(1, "gloo", role=THREADS)
        [(answers, _)] = host.run(threaded_task, replica_trace_task, case, spool, ws, mode, shard_size, step,
                                  size, inside, timeout=timeout, shown_as=replica_run_name(mode, simulated=True))
        return list(answers)
    return list(pool.get(ws, backend).run(replica_trace_task, case, spool, mode, shard_size, step, size,
                                          inside, timeout=timeout, shown_as=replica_run_name(mode)))


def _search_compiled(pool: WorldPool, checking: Checking, spool: Spool, run: RunResult) -> list[Any] | str:
    """A compiled replica run's blocks compiled against eager on each of its ranks' inputs of
    its first differing step, in a world like the run's; every rank's answer, or why none."""
    assert run.first_divergence is not None and run.compile is not None
    spec = CompileSpec(run.compile["backend"], run.compile.get("ddp") or COMPILE_DDP[0])
    try:
        return list(pool.get(run.world_size, run.backend).run(
            compiled_replica_blocks_task, checking.case, spool.path, run.mode,
            kind(run.mode).shard_size(run.world_size, checking.opts.shard), spec, run.first_divergence.step,
            timeout=checking.opts.timeout, shown_as=replica_run_name(run.mode)))
    except (WorldFailure, WorldStartError) as exc:
        return _rerun_failed(run.first_divergence.step, exc)


def _rerun_failed(step: int, exc: BaseException) -> str:
    return f"the re-run of step {step} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def _finish_dp(checking: Checking, mode: str, backend: str, sizes: tuple[int, ...], pending: PendingTask | None,
               started: float, resubmit: Callable[[tuple[int, ...]], PendingTask]) -> list[RunResult]:
    """DataParallel runs (real where enough GPUs exist, else simulated) against the reference.
    One task runs every world size; should it raise, each world size runs again on its own
    (``resubmit``), so that one size's failure is not every size's verdict."""
    assert pending is not None
    try:
        [results] = [o.value for o in pending.result()]
    except TaskFailed as exc:
        if len(sizes) == 1:
            return [checking.failed_one_process(mode, sizes[0], backend, exc, time.perf_counter() - started)]
        return [run for ws in sizes
                for run in _finish_dp(checking, mode, backend, (ws,), resubmit((ws,)), time.perf_counter(), resubmit)]
    except WorldFailure as exc:
        return [checking.failed_one_process(mode, ws, backend, exc, time.perf_counter() - started) for ws in sizes]
    runs = []
    for ws in sizes:
        distances, notes, simulated = results[ws]
        runs.append(checking.judge_one_process(mode, ws, backend, distances, notes, simulated,
                                               time.perf_counter() - started))
    return runs


def _start(checking: Checking, backend: str, run: Planned, pool: WorldPool,
           spool: Spool) -> tuple[float, PendingTask | RunResult]:
    """Start one run of a replicated mode (``run``: mode, world size, compiled or not) in a warm world."""
    mode, ws, spec = run
    opts = checking.opts
    started = time.perf_counter()
    try:
        shard_size = kind(mode).shard_size(ws, opts.shard)
        if backend == "threaded":
            host = pool.get(1, "gloo", role=THREADS)  # a hung thread costs this process only
            return started, host.submit(threaded_task, replica_task, checking.case, spool.path, ws, mode, shard_size,
                                        timeout=opts.timeout, shown_as=replica_run_name(mode, simulated=True))
        world = pool.get(ws, backend)
        return started, world.submit(replica_task, checking.case, spool.path, mode, shard_size, compiled=spec,
                                     timeout=opts.timeout, watch=LiveWatch(), shown_as=replica_run_name(mode))
    except WorldStartError as exc:
        return started, RunResult(mode=mode, world_size=ws, backend=backend, status="error", reason=str(exc),
                                  simulated=backend == "threaded", seconds=time.perf_counter() - started,
                                  repro=checking.repro(mode, ws, backend, spec))


def _finish(checking: Checking, backend: str, planned: Planned, launched: tuple[float, PendingTask | RunResult],
            compile_noise: Distances | None = None) -> RunResult:
    mode, ws, spec = planned
    started, pending = launched
    if isinstance(pending, RunResult):
        return mark(pending, spec)
    simulated = backend == "threaded"
    try:
        outcomes = pending.result()
    except WorldFailure as exc:
        failed = checking.failed(mode, ws, backend, as_simulated(exc) if simulated else exc,
                                 time.perf_counter() - started, spec)
        failed.simulated = simulated  # a simulated run that failed is still a simulated one
        return failed
    runs, records = outcomes[0].value if simulated else ([o.value for o in outcomes],
                                                          {o.rank: o.records for o in outcomes if o.records is not None})
    summaries = [r.compiled for r in runs] if spec is not None else []
    run = checking.replica_row(mode, ws, backend, time.perf_counter() - started, spec=spec,
                               said=summary_notes(summaries) if spec is not None else ())
    if spec is not None:
        compile_figures(run, summaries)  # no compile_noise: eager's noise alone
    run.simulated = simulated
    if simulated:
        run.notes.append(f"simulated: {ws} {mode.upper()} ranks as threads in one process (torch's threaded process "
                         f"group){'; real processes run up to ' + str(REAL_RANKS_LIMIT) + ' ranks here' if checking.opts.backend == 'auto' else ''}")
    judged = checking.judge(run, runs, records, compile_noise)
    return compared_nothing(judged) if spec is not None else judged


__all__ = ["check"]
