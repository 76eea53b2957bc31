"""``check``: run a Case in every requested mode and world size, compare to the reference.

The controller decides and reports; user code (model factories, data, training) runs only
inside rank processes, so a model that hangs or segfaults becomes a report, never a
stuck or dead controller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ddparity.case import Case
from ddparity.checks.causes import likely_cause
from ddparity.checks.collectives import LiveWatch
from ddparity.checks.equivalence import NonFinite, divergences, first_non_finite, worst
from ddparity.checks.judge import judge_completed
from ddparity.checks.tolerance import Uncalibrated, auto_tolerance, fixed_tolerance
from ddparity.compile_spec import CompileSpec
from ddparity.distances import Distances, Reference
from ddparity.errors import Interrupted, RankCrashed, UsageError, WorldFailure, WorldStartError
from ddparity.harness.ranks.spool import Spool
from ddparity.harness.ranks.tasks import dp_task, prepare_task, reference_task, replica_run_name, replica_task
from ddparity.harness.ranks.threaded import threaded_task
from ddparity.harness.world.pool import THREADS, WorldPool, default_pool
from ddparity.harness.world.simulated import as_simulated
from ddparity.harness.world.world import PendingTask
from ddparity.report import Report
from ddparity.run_kinds import REPLICA_MODES, asked, kind
from ddparity.settings import (
    CHECK_MODES,
    CHECK_WORLD_SIZES,
    REAL_RANKS_LIMIT,
    TIMEOUT_S,
    CheckOptions,
)
from ddparity.verbs.compiled import (
    DP_NOT_COMPILED,
    compared_nothing,
    compiled_single,
    describe,
    dropout_drawn,
    mark,
    refused_run,
)
from ddparity.verbs.plan import cannot_run, check_repro, choose_backend, failure_run, hsdp_shard, run_backend
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
    case = case.with_steps(opts.steps).validate()
    chosen = choose_backend(opts.backend, opts.world_sizes)
    pool = pool or default_pool()
    report = Report(case.label)
    doing = _Doing()
    with Spool() as spool:
        try:
            return _check(case, opts, chosen, pool, report, spool, doing)
        except KeyboardInterrupt as exc:  # Ctrl-C: the runs finished so far, and where the ranks were
            places = list(getattr(exc, "places", []))
            others = pool.interrupt()  # runs that trained alongside the one waited on
            if others:
                places = [f"{doing.run}: {p}" for p in places] + [f"{label}: {p}" for label, found in others
                                                                   for p in found]
            raise Interrupted(places, Report(case.label, [*report.runs, *doing.finished]), doing.run) from None


@dataclass
class _Doing:
    """What a check is doing, for a Ctrl-C's report: the run in progress, the DDP runs done."""

    run: str = "the set-up (the initial state, every step's global batch)"
    finished: list[RunResult] = field(default_factory=list)


def _check(case: Case, opts: CheckOptions, chosen: str, pool: WorldPool, report: Report, spool: Spool,
           doing: _Doing) -> Report:
    started = time.perf_counter()
    replicas = [run for run in _planned(opts) if run[0] in REPLICA_MODES]
    ddp_sizes = tuple(sorted({ws for _, ws, _ in replicas}))
    dp_sizes = opts.world_sizes if asked(opts.modes, "one_process") else ()
    backends = {ws: run_backend(opts, chosen, ws) for ws in ddp_sizes}
    if "threaded" in backends.values():
        pool.expect(1, "gloo", role=THREADS)  # its host starts clean, from the forkserver: warm it meanwhile
    try:
        ref_world = pool.get(1, chosen, role="reference")
        [(batch_sizes, valid)] = ref_world.run(prepare_task, case, spool.path, timeout=opts.timeout)
        doing.run = "the single-device reference"
        ref_pending = ref_world.submit(reference_task, case, spool.path, tuple(ddp_sizes) + tuple(dp_sizes),
                                       sharded(opts), timeout=opts.timeout)
    except WorldFailure as exc:
        return case_failed(report, case, opts, chosen, exc, time.perf_counter() - started)
    # The first runnable DDP run trains alongside the reference (comparing each step as the
    # reference writes it); the others follow.
    plan = {(mode, ws, spec): cannot_run(case, opts, backends[ws], ws, batch_sizes, mode, spec)
            for mode, ws, spec in replicas}
    first = next((run for run, reason in plan.items() if reason is None and run[2] is None), None)
    early = _start_ddp(case, opts, backends[first[1]], first, pool, spool) if first is not None else None
    try:
        [reference] = [o.value for o in ref_pending.result()]
    except WorldFailure as exc:
        spool.abort()  # the early run waits for steps that will not come
        if early is not None and not isinstance(early[1], RunResult):
            try:
                early[1].result()
            except WorldFailure:
                pass
        return case_failed(report, case, opts, chosen, exc, time.perf_counter() - started)
    blowup = first_non_finite(reference)
    for mode in asked(opts.modes, "reference"):
        report.runs.append(reference_run(case, opts, mode, 1, chosen, blowup.reason() if blowup else None,
                                         time.perf_counter() - started))
    policy = _policy_run(case, opts, ref_world, spool) if sharded(opts) else None
    noise = None
    if opts.compile is not None:  # what compiling alone does: the compiled runs' noise floor
        refused = dropout_drawn(reference)
        if refused is None:
            single, noise = compiled_single(case, opts, opts.compile, ref_world, spool, reference, blowup, _tolerance)
        else:
            single = refused_run(case, opts, opts.compile, "single", 1, chosen, refused)
            plan.update({(mode, ws, spec): refused_run(case, opts, spec, mode, ws, backends[ws], refused)
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
        launched = early if (mode, ws, spec) == first and early is not None else _start_ddp(
            case, opts, backends[ws], (mode, ws, spec), pool, spool)
        floor = policy if kind(mode).sharded else None
        ddp_runs.append(_finish_ddp(case, opts, backends[ws], (mode, ws, spec), launched, reference, blowup, valid,
                                    floor, noise if spec is not None else None))
    doing.run = f"dp world sizes {list(dp_sizes)}"
    if dp_pending is not None:
        report.runs.extend(_finish_dp(case, opts, chosen, dp_sizes, dp_pending, dp_started, reference, blowup))
        if opts.compile is not None:
            report.runs.extend(mark(RunResult(mode="dp", world_size=ws, backend=chosen, status="skipped",
                                              reason=DP_NOT_COMPILED), opts.compile) for ws in dp_sizes)
    report.runs.extend(ddp_runs)
    if reference.dropout_calls and report.runs:
        report.runs[0].notes.insert(0, f"dropout compared on: every mode and rank drew the same mask for the same "
                                       f"sample ({reference.dropout_calls} dropout call(s) a step)")
    return report


def reference_run(case: Case, opts: CheckOptions, mode: str, ws: int | None, backend: str, blowup: str | None,
                  seconds: float) -> RunResult:
    """The reference's own row (an ``error`` where it computed a NaN or inf: ``blowup``),
    for a local check and a launched one (``ws`` None) alike."""
    return RunResult(mode=mode, world_size=1, backend=backend, status="error" if blowup else "pass", reason=blowup,
                     seconds=seconds, tolerance="reference",
                     repro=check_repro(case, opts, mode, ws, backend) if blowup else "")


def sharded(opts: CheckOptions) -> bool:
    """Whether a sharded mode is checked: the reference then writes its optimizer's state,
    which they compare (DDP's ranks publish theirs as fingerprints, compared across ranks)."""
    return any(kind(m).sharded for m in opts.modes)


def _policy_run(case: Case, opts: CheckOptions, world: Any, spool: Spool) -> Distances | None:
    """The user's own FSDP set-up (``Case.fsdp``: its ``MixedPrecisionPolicy``) on one rank:
    its distance to the reference is what the policy alone does to the numbers, the noise
    floor of the sharded runs that compute in its lower precision. None without a
    ``Case.fsdp``, or should that one-rank run fail (the sharded runs then report it)."""
    if case.fsdp is None:
        return None
    try:
        [distances] = world.run(replica_task, case, spool.path, "fsdp", 1, timeout=opts.timeout,
                                shown_as=replica_run_name("fsdp"))
    except WorldFailure:
        return None
    return policy_noise(distances)


def policy_noise(distances: Distances) -> Distances | None:
    """The user's FSDP set-up on one rank against the reference: the noise of its
    ``MixedPrecisionPolicy`` alone, where it computes in a lower precision (else None)."""
    return distances if distances.computed_dtype else None


def _stop(blowup: NonFinite | None, tol: Any) -> NonFinite | Uncalibrated | None:
    """Where comparing ends: the reference's blow-up, or the first step no tolerance can be
    calibrated for, whichever comes first."""
    stops = [s for s in (blowup, tol.uncalibrated) if s is not None]
    return min(stops, key=lambda s: s.step) if stops else None


def _until(stop: NonFinite | Uncalibrated | None) -> int | None:
    """The step before which runs are compared: the stop's, but every step where the stop is
    only imprecision (a tolerance looser than it should be is still a bound: a run beyond it
    diverged)."""
    if stop is None or (isinstance(stop, Uncalibrated) and stop.world_size):
        return None
    return stop.step


def _compared_up_to(run: RunResult, blowup: NonFinite | Uncalibrated | None) -> RunResult:
    """A run compared only up to the reference's blow-up (or the end of calibration): never
    a pass."""
    if blowup is None:
        return run
    if (isinstance(blowup, NonFinite) and run.status == "desync" and run.desync is not None
            and run.desync.step >= blowup.step):
        run.status, run.desync = "pass", None  # replicas of NaN: their bits say nothing
    if run.status == "pass":
        matched = f"; steps before {blowup.step} matched" if blowup.step else ""
        run.status, run.reason = "error", blowup.reason() + matched
    elif isinstance(blowup, Uncalibrated) and blowup.world_size:
        run.notes.append(f"judged within loose tolerances only: {blowup.reason()}")
    else:
        run.notes.append(f"compared up to step {blowup.step} only: {blowup.reason()}")
    return run


def _finish_dp(case: Case, opts: CheckOptions, backend: str, sizes: tuple[int, ...], pending: PendingTask,
               started: float, reference: Reference, blowup: NonFinite | None) -> list[RunResult]:
    """DataParallel runs (real where enough GPUs exist, else simulated) against the reference."""
    try:
        [results] = [o.value for o in pending.result()]
    except WorldFailure as exc:
        return [failure_run("dp", ws, backend, exc, time.perf_counter() - started,
                             check_repro(case, opts, "dp", ws, backend)) for ws in sizes]
    runs = []
    for ws in sizes:
        distances, notes, simulated = results[ws]
        tol = _tolerance(case, opts, reference, ws)
        stop = _stop(blowup, tol)
        found = divergences(reference, [distances], tol, until=_until(stop))
        device = "cuda" if backend == "nccl" else "cpu"  # where the reference world runs it
        run = RunResult(mode="dp", world_size=ws, backend=device,
                        status="diverged" if found else "pass", simulated=simulated,
                        seconds=time.perf_counter() - started, tolerance=tol.description,
                        repro=check_repro(case, opts, "dp", ws, backend))
        if found:
            run.first_divergence, run.worst = found[0], worst(found)
        run.notes = [f"DataParallel pitfall, {name}: {text}" for name, text in notes.items()]
        if tol.loose:
            run.notes.append(tol.loose)
        runs.append(_compared_up_to(run, stop))
    return runs


def case_failed(report: Report, case: Case, opts: CheckOptions, backend: str, exc: WorldFailure,
                 elapsed: float) -> Report:
    """The case cannot even run on one device: every requested run shares that fate."""
    for mode, ws, spec in _planned(opts):
        run = failure_run(mode, ws, backend, exc, elapsed,
                          check_repro(case, opts, mode, ws, backend, spec))
        if run.status == "crash" and not isinstance(exc, RankCrashed):
            run.status = "error"  # raised by the user's code on a single device: bad input
        report.runs.append(mark(run, spec))
    return report


def _planned(opts: CheckOptions) -> list[tuple[str, int, CompileSpec | None]]:
    compiles = (None, opts.compile) if opts.compile is not None else (None,)
    plan = [(mode, 1, spec) for mode in asked(opts.modes, "reference") for spec in compiles]
    plan += [(mode, ws, None) for mode in asked(opts.modes, "one_process") for ws in opts.world_sizes]
    plan += [(mode, ws, spec) for mode in REPLICA_MODES if mode in opts.modes for ws in opts.world_sizes
             for spec in compiles]
    return plan


def _start_ddp(case: Case, opts: CheckOptions, backend: str, run: tuple[str, int, CompileSpec | None],
               pool: WorldPool, spool: Spool) -> tuple[float, PendingTask | RunResult]:
    """Start one run of a replica mode (``run``: mode, world size, compiled or not) in a warm world."""
    mode, ws, spec = run
    started = time.perf_counter()
    try:
        shard_size = kind(mode).shard_size(ws, hsdp_shard(case, opts))
        if backend == "threaded":
            host = pool.get(1, "gloo", role=THREADS)  # a hung thread costs this process only
            return started, host.submit(threaded_task, replica_task, case, spool.path, ws, mode, shard_size,
                                        timeout=opts.timeout, shown_as=replica_run_name(mode, simulated=True))
        world = pool.get(ws, backend)
        return started, world.submit(replica_task, case, spool.path, mode, shard_size, compiled=spec,
                                     timeout=opts.timeout, watch=LiveWatch(), shown_as=replica_run_name(mode))
    except WorldStartError as exc:
        return started, RunResult(mode=mode, world_size=ws, backend=backend, status="error", reason=str(exc),
                                  simulated=backend == "threaded",
                                  seconds=time.perf_counter() - started,
                                  repro=check_repro(case, opts, mode, ws, backend, spec))


def _finish_ddp(case: Case, opts: CheckOptions, backend: str, planned: tuple[str, int, CompileSpec | None],
                launched: tuple[float, PendingTask | RunResult],
                reference: Reference, blowup: NonFinite | None, valid: dict[str, list[int]],
                policy: Distances | None = None, compile_noise: Distances | None = None) -> RunResult:
    mode, ws, spec = planned
    started, pending = launched
    if isinstance(pending, RunResult):
        return mark(pending, spec)
    repro = check_repro(case, opts, mode, ws, backend, spec)
    try:
        outcomes = pending.result()
    except WorldFailure as exc:
        if backend == "threaded":
            exc = as_simulated(exc)
        failed = failure_run(mode, ws, backend, exc, time.perf_counter() - started, repro)
        failed.simulated = backend == "threaded"  # a simulated run that failed is still a simulated one
        return mark(failed, spec)
    simulated = backend == "threaded"
    runs, records = outcomes[0].value if simulated else ([o.value for o in outcomes],
                                                          {o.rank: o.records for o in outcomes if o.records is not None})
    run = RunResult(mode=mode, world_size=ws, backend=backend, status="pass", simulated=simulated,
                    seconds=time.perf_counter() - started, repro=repro)
    if spec is not None:
        describe(mark(run, spec), [r.compiled for r in runs])  # no compile_noise: eager's noise alone
    mesh = kind(mode).mesh_note(ws, hsdp_shard(case, opts))
    if mesh:
        run.notes.append(mesh)
    if simulated:
        run.notes.append(f"simulated: {ws} {mode.upper()} ranks as threads in one process (torch's threaded process "
                         f"group){'; real processes run up to ' + str(REAL_RANKS_LIMIT) + ' ranks here' if opts.backend == 'auto' else ''}")
    judged = judge_ddp(case, opts, run, runs, records, reference, blowup, valid, policy, compile_noise)
    return compared_nothing(judged) if spec is not None else judged


def judge_ddp(case: Case, opts: CheckOptions, run: RunResult, runs: list[Distances], records: dict[int, Any],
              reference: Reference, blowup: NonFinite | None, valid: dict[str, list[int]],
              policy: Distances | None = None, compile_noise: Distances | None = None) -> RunResult:
    """A DDP run whose every rank finished: its distances to the reference (``runs``, one
    per rank) and what the ranks left in the side channel (``records``) judged (``policy``,
    ``compile_noise``: one-device runs under the same MixedPrecisionPolicy, or compiled,
    whose distances to the reference are this run's noise too)."""
    ws = run.world_size
    low = next((r.computed_dtype for r in runs if r.computed_dtype), None)
    floors = [d.steps for d in (policy if low else None, compile_noise) if d is not None]
    tol = _tolerance(case, opts, reference, ws, low, _larger(floors) if floors else None)
    stop = _stop(blowup, tol)
    found = divergences(reference, runs, tol, until=_until(stop))
    run.tolerance = tol.description
    run.worst = worst(found)
    if tol.loose:
        run.notes.append(tol.loose)
    judged = judge_completed(run, records, found)
    params = reference.params
    unsharded = sorted({n for r in runs for n in r.unsharded})
    cause = (likely_cause(found, ws, params=params, valid=valid, layer_types=reference.layer_types, mode=run.mode,
                          unsharded=unsharded)
             if judged.status == "diverged"
             else likely_cause(found, ws, judged.desync, params) if judged.status == "desync" else None)
    if cause:
        judged.notes.append(cause)
    return _compared_up_to(judged, stop)


def _larger(floors: list[list[dict[tuple[str, str], float]]]) -> list[dict[tuple[str, str], float]]:
    """Per step and tensor, the larger of the noise floors' distances."""
    out: list[dict[tuple[str, str], float]] = []
    for steps in floors:
        for step, distances in enumerate(steps):
            if step == len(out):
                out.append({})
            for key, far in distances.items():
                out[step][key] = max(out[step].get(key, 0.0), far)
    return out


def _tolerance(case: Case, opts: CheckOptions, reference: Reference, ws: int, low: str | None = None,
               policy_noise: list[dict[tuple[str, str], float]] | None = None) -> Any:
    if opts.tolerance == "auto":
        return auto_tolerance(reference, ws, case.torch_dtype, low, policy_noise)
    return fixed_tolerance(reference, float(opts.tolerance))


__all__ = ["check"]
