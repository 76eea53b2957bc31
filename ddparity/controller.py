"""``check``: run a Case in every requested mode and world size, compare to the reference.

The controller decides and reports; user code (model factories, data, training) runs only
inside rank processes, so a model that hangs or segfaults becomes a report, never a
stuck or dead controller.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

from ddparity.case import Case
from ddparity.checks.equivalence import divergences, worst
from ddparity.checks.ledger import LiveWatch
from ddparity.checks.tolerance import auto_tolerance, fixed_tolerance
from ddparity.checks.verdict import judge_completed, judge_failure
from ddparity.errors import (
    RankCrashed,
    TaskFailed,
    UsageError,
    WorldFailure,
    WorldStartError,
)
from ddparity.harness import rendezvous
from ddparity.harness.modes import CaseError, ddp_task, dp_task, prepare_task, reference_task
from ddparity.harness.world import PendingTask, World
from ddparity.report import Report, RunResult
from ddparity.settings import (
    CHECK_MODES,
    CHECK_WORLD_SIZES,
    REAL_RANKS_LIMIT,
    TIMEOUT_S,
    CheckOptions,
    default_max_ranks,
    validate_max_ranks,
)


class WorldPool:
    """Warm worlds, one per (world size, backend, role), reused across checks.

    At most ``max_ranks`` rank processes stay alive (``None``: no cap): before a world
    starts, the least recently used idle worlds are closed to make room. A world in use
    is never closed, so a check that alone needs more ranks than the cap still runs.
    """

    def __init__(self, max_ranks: int | None = None) -> None:
        self.max_ranks = validate_max_ranks(max_ranks, "WorldPool(max_ranks=...)")
        self._worlds: dict[tuple[int, str, str], World] = {}  # least recently used first
        self.closed_for_room = 0

    def get(self, world_size: int, backend: str, role: str = "ddp") -> World:
        """The warm world for ``role``: the reference has its own 1-rank world, so that it
        can train while the DDP worlds (a 1-rank one included) run."""
        key = (world_size, backend, role)
        world = self._worlds.pop(key, None)
        if world is None:
            world = World(world_size, backend)
        if not world.pids:
            self._make_room(world_size)
        self._worlds[key] = world
        return world.start()

    def _make_room(self, needed: int) -> None:
        if self.max_ranks is None:
            return
        for key, world in list(self._worlds.items()):
            if len(self.pids) + needed <= self.max_ranks:
                return
            if not world.busy:
                world.close()
                del self._worlds[key]
                self.closed_for_room += 1

    @property
    def pids(self) -> set[int]:
        """The rank processes of every live world in the pool."""
        return {pid for world in self._worlds.values() for pid in world.pids}

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


_default_pool: WorldPool | None = None


def default_pool() -> WorldPool:
    global _default_pool
    if _default_pool is None:
        _default_pool = WorldPool(max_ranks=default_max_ranks())
        atexit.register(_default_pool.close)
    return _default_pool


def choose_backend(backend: str, world_sizes: tuple[int, ...]) -> str:
    """One backend for the whole check, so every run is compared on the same device kind
    (``threaded`` runs its simulated ranks in a gloo world's process)."""
    if backend == "threaded":
        from ddparity.harness.threaded import threaded_pg

        threaded_pg()  # raises a UsageError naming the fix where torch lacks it
        return "gloo"
    if backend == "auto":
        sizes = [ws for ws in world_sizes if ws <= REAL_RANKS_LIMIT] or [1]
        return rendezvous.resolve_backend("auto", max(sizes))
    if backend == "nccl" and rendezvous.cuda_device_count() == 0:
        rendezvous.resolve_backend("nccl", 1)  # raises: no GPU at all is a usage error
    return backend


def _user_error(exc: BaseException) -> str:
    """The error as the user should read it, with the traceback from their code."""
    if isinstance(exc, TaskFailed):
        bad = [o for o in exc.outcomes if not o.ok]
        head = bad[0]
        return f"rank {head.rank}: {type(head.error).__name__}: {head.error}\n{head.traceback}".rstrip()
    return f"{type(exc).__name__}: {exc}"


def _is_case_error(exc: TaskFailed) -> bool:
    return any(isinstance(o.error, (CaseError, UsageError)) for o in exc.outcomes if not o.ok)


def failure_run(mode: str, ws: int, backend: str, exc: BaseException, seconds: float, repro: str) -> RunResult:
    run = RunResult(mode=mode, world_size=ws, backend=backend, status="error", seconds=seconds, repro=repro)
    if isinstance(exc, TaskFailed) and _is_case_error(exc):
        run.reason = _user_error(exc)
        return run
    if isinstance(exc, WorldFailure) and not isinstance(exc, WorldStartError):
        return judge_failure(run, exc)
    run.reason = _user_error(exc)
    return run


def _repro(case: Case, mode: str, ws: int, backend: str, tolerance: Any) -> str:
    if case.target:
        return (
            f"ddparity check {case.target} --modes {mode} --world-sizes {ws} --backend {backend} "
            f"--steps {case.steps} --tolerance {tolerance}"
        )
    return (
        f"ddparity.check(case, modes=({mode!r},), world_sizes=({ws},), backend={backend!r}, "
        f"tolerance={tolerance!r})  # seed={case.seed}, steps={case.steps}"
    )


def check(
    case: Case,
    modes: tuple[str, ...] | list[str] = CHECK_MODES,
    world_sizes: tuple[int, ...] | list[int] = CHECK_WORLD_SIZES,
    backend: str = "auto",
    timeout: float = TIMEOUT_S,
    tolerance: str | float = "auto",
    *,
    steps: int | None = None,
    pool: WorldPool | None = None,
) -> Report:
    """Run ``case`` in every mode and world size; compare each run to the reference."""
    if not isinstance(case, Case):
        raise UsageError(f"check() needs a ddparity.Case, got {type(case).__name__}")
    opts = CheckOptions.validated("check()", modes=modes, world_sizes=world_sizes, backend=backend,
                                  timeout=timeout, tolerance=tolerance, steps=steps)
    case = case.with_steps(opts.steps).validate()
    chosen = choose_backend(opts.backend, opts.world_sizes)
    pool = pool or default_pool()
    report = Report(case.label)

    started = time.perf_counter()
    ddp_sizes = opts.world_sizes if "ddp" in opts.modes else ()
    dp_sizes = opts.world_sizes if "dp" in opts.modes else ()
    try:
        ref_world = pool.get(1, chosen, role="reference")
        [(state, batch_sizes)] = ref_world.run(prepare_task, case, timeout=opts.timeout)
        ref_pending = ref_world.submit(reference_task, case, state, tuple(ddp_sizes) + tuple(dp_sizes),
                                       timeout=opts.timeout)
    except WorldFailure as exc:
        return _case_failed(report, case, opts, chosen, exc, time.perf_counter() - started)
    # The first runnable DDP run trains alongside the reference; the others follow.
    backends = {ws: _run_backend(opts, chosen, ws) for ws in ddp_sizes}
    plan = {ws: _unrunnable(case, opts, backends[ws], ws, batch_sizes) for ws in ddp_sizes}
    first = next((ws for ws, reason in plan.items() if reason is None), None)
    early = _start_ddp(case, opts, backends[first], first, pool, state) if first is not None else None
    try:
        [(reference, twin)] = [o.value for o in ref_pending.result()]
    except WorldFailure as exc:
        if early is not None and not isinstance(early[1], RunResult):
            try:
                early[1].result()
            except WorldFailure:
                pass
        return _case_failed(report, case, opts, chosen, exc, time.perf_counter() - started)
    if "single" in opts.modes:
        report.runs.append(
            RunResult(mode="single", world_size=1, backend=chosen, status="pass",
                      seconds=time.perf_counter() - started, tolerance="reference")
        )
    dp_started = time.perf_counter()
    dp_pending = ref_world.submit(dp_task, case, state, dp_sizes, timeout=opts.timeout) if dp_sizes else None
    ddp_runs = []
    for ws, unrunnable in plan.items():
        if unrunnable is not None:
            ddp_runs.append(unrunnable)
            continue
        launched = early if ws == first and early is not None else _start_ddp(case, opts, backends[ws], ws, pool, state)
        ddp_runs.append(_finish_ddp(case, opts, backends[ws], ws, launched, reference, twin))
    if dp_pending is not None:
        report.runs.extend(_finish_dp(case, opts, chosen, dp_sizes, dp_pending, dp_started, reference, twin))
    report.runs.extend(ddp_runs)
    return report


def _finish_dp(case: Case, opts: CheckOptions, backend: str, sizes: tuple[int, ...], pending: PendingTask,
               started: float, reference: Any, twin: Any) -> list[RunResult]:
    """DataParallel runs (real where enough GPUs exist, else simulated) against the reference."""
    try:
        [results] = [o.value for o in pending.result()]
    except WorldFailure as exc:
        return [failure_run("dp", ws, backend, exc, time.perf_counter() - started,
                             _repro(case, "dp", ws, backend, opts.tolerance)) for ws in sizes]
    runs = []
    for ws in sizes:
        trace, notes, simulated = results[ws]
        tol = _tolerance(case, opts, reference, twin, ws)
        found = divergences(reference, [trace], tol)
        device = "cuda" if backend == "nccl" else "cpu"  # where the reference world runs it
        run = RunResult(mode="dp", world_size=ws, backend=device,
                        status="diverged" if found else "pass", simulated=simulated,
                        seconds=time.perf_counter() - started, tolerance=tol.description,
                        repro=_repro(case, "dp", ws, backend, opts.tolerance))
        if found:
            run.first_divergence, run.worst = found[0], worst(found)
        run.notes = [f"DataParallel pitfall, {name}: {text}" for name, text in notes.items()]
        runs.append(run)
    return runs


def _case_failed(report: Report, case: Case, opts: CheckOptions, backend: str, exc: WorldFailure,
                 elapsed: float) -> Report:
    """The case cannot even run on one device: every requested run shares that fate."""
    for mode, ws in _planned(opts):
        run = failure_run(mode, ws, backend, exc, elapsed, _repro(case, mode, ws, backend, opts.tolerance))
        if run.status == "crash" and not isinstance(exc, RankCrashed):
            run.status = "error"  # raised by the user's code on a single device: bad input
        report.runs.append(run)
    return report


def _planned(opts: CheckOptions) -> list[tuple[str, int]]:
    plan = [("single", 1)] if "single" in opts.modes else []
    if "dp" in opts.modes:
        plan += [("dp", ws) for ws in opts.world_sizes]
    if "ddp" in opts.modes:
        plan += [("ddp", ws) for ws in opts.world_sizes]
    return plan


def _unrunnable(case: Case, opts: CheckOptions, backend: str, ws: int, sizes: list[int]) -> RunResult | None:
    """Why a DDP run at ``ws`` cannot happen here (an ``error`` or ``skipped`` run), or None."""
    repro = _repro(case, "ddp", ws, backend, opts.tolerance)
    if any(size < 1 for size in sizes):
        return RunResult(mode="ddp", world_size=ws, backend=backend, status="error", repro=repro,
                         reason="cannot find the batch dimension: the data function's inputs hold no tensor "
                                "with a dim 0 to shard")
    uneven = [(step, size) for step, size in enumerate(sizes) if size % ws]
    if uneven:
        step, size = uneven[0]
        return RunResult(mode="ddp", world_size=ws, backend=backend, status="error", repro=repro,
                         reason=f"the global batch of step {step} has {size} samples, which cannot be split "
                                f"into {ws} equal shards; use a batch size divisible by every world size "
                                f"(e.g. {_lcm(opts.world_sizes)})")
    gpus = rendezvous.cuda_device_count() if backend == "nccl" else 0
    if backend == "nccl" and gpus < ws:
        return RunResult(mode="ddp", world_size=ws, backend=backend, status="skipped", repro=repro,
                         reason=f"nccl needs {ws} CUDA devices, {gpus} visible")
    return None


def _run_backend(opts: CheckOptions, chosen: str, ws: int) -> str:
    """The backend of the DDP run at ``ws``: ``threaded`` (simulated ranks) when asked for,
    or with ``auto`` above :data:`REAL_RANKS_LIMIT` CPU ranks; else the check's backend."""
    if opts.backend == "threaded" or (opts.backend == "auto" and chosen == "gloo" and ws > REAL_RANKS_LIMIT):
        return "threaded"
    return chosen


def _start_ddp(case: Case, opts: CheckOptions, backend: str, ws: int, pool: WorldPool,
               state: Any) -> tuple[float, PendingTask | RunResult]:
    started = time.perf_counter()
    try:
        if backend == "threaded":
            from ddparity.harness.threaded import threaded_ddp_task

            host = pool.get(1, "gloo", role="threads")  # a hung thread costs this process only
            return started, host.submit(threaded_ddp_task, case, state, ws, timeout=opts.timeout)
        world = pool.get(ws, backend)
        return started, world.submit(ddp_task, case, state, timeout=opts.timeout, watch=LiveWatch())
    except WorldStartError as exc:
        return started, RunResult(mode="ddp", world_size=ws, backend=backend, status="error", reason=str(exc),
                                  seconds=time.perf_counter() - started,
                                  repro=_repro(case, "ddp", ws, backend, opts.tolerance))


def _finish_ddp(case: Case, opts: CheckOptions, backend: str, ws: int,
                launched: tuple[float, PendingTask | RunResult], reference: Any, twin: Any) -> RunResult:
    started, pending = launched
    if isinstance(pending, RunResult):
        return pending
    repro = _repro(case, "ddp", ws, backend, opts.tolerance)
    try:
        outcomes = pending.result()
    except WorldFailure as exc:
        return failure_run("ddp", ws, backend, exc, time.perf_counter() - started, repro)
    tol = _tolerance(case, opts, reference, twin, ws)
    simulated = backend == "threaded"
    traces = outcomes[0].value if simulated else [o.value for o in outcomes]
    found = divergences(reference, traces, tol)
    run = RunResult(mode="ddp", world_size=ws, backend=backend, status="pass", simulated=simulated,
                    seconds=time.perf_counter() - started, tolerance=tol.description, repro=repro)
    run.worst = worst(found)
    if simulated:
        run.notes.append(f"simulated: {ws} DDP ranks as threads in one process (torch's threaded process "
                         f"group){'; real processes run up to ' + str(REAL_RANKS_LIMIT) + ' ranks here' if opts.backend == 'auto' else ''}")
    signals = {} if simulated else {o.rank: o.signals for o in outcomes if o.signals is not None}
    return judge_completed(run, signals, found, traces)


def _tolerance(case: Case, opts: CheckOptions, reference: Any, twin: Any, ws: int) -> Any:
    if opts.tolerance == "auto":
        return auto_tolerance(reference, twin, ws, case.torch_dtype)
    return fixed_tolerance(reference, float(opts.tolerance))


def _lcm(values: tuple[int, ...]) -> int:
    import math

    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


__all__ = ["CheckOptions", "WorldPool", "check", "default_max_ranks", "default_pool"]
