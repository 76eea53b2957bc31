"""What ``check``, ``profile`` and ``health`` share: the planning of runs (which backend,
which world sizes can run here), the turning of a world failure into a verdict, and the
line that reproduces a run.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ddparity.case import Case
from ddparity.checks.causes import likely_cause
from ddparity.checks.judge import crash_cause, judge_failure
from ddparity.errors import CaseError, StillRunning, TaskFailed, UsageError, WorldFailure, WorldStartError
from ddparity.frames import own_error_site, without_package_frames
from ddparity.harness.world import rendezvous
from ddparity.run_kinds import kind
from ddparity.settings import PROFILE_MODES, REAL_RANKS_LIMIT, TIMEOUT_S, CheckOptions
from ddparity.verdicts import Failure, RunResult

# -- planning ----------------------------------------------------------------------------


def choose_backend(backend: str, world_sizes: tuple[int, ...]) -> str:
    """One backend for the whole check, so every run is compared on the same device kind
    (``threaded`` runs its simulated ranks in a gloo world's process)."""
    if backend == "threaded":
        from ddparity.harness.ranks.threaded import threaded_pg

        threaded_pg()  # raises a UsageError naming the fix where torch lacks it
        return "gloo"
    if backend == "auto":
        sizes = [ws for ws in world_sizes if ws <= REAL_RANKS_LIMIT] or [1]
        return rendezvous.resolve_backend("auto", max(sizes))
    if backend == "nccl" and rendezvous.cuda_device_count() == 0:
        rendezvous.resolve_backend("nccl", 1)  # raises: no GPU at all is a usage error
    return backend


def run_backend(opts: CheckOptions, chosen: str, ws: int) -> str:
    """The backend of the DDP run at ``ws``: ``threaded`` (simulated ranks) when asked for,
    or with ``auto`` above :data:`REAL_RANKS_LIMIT` CPU ranks; else the check's backend."""
    if opts.backend == "threaded" or (opts.backend == "auto" and chosen == "gloo" and ws > REAL_RANKS_LIMIT):
        return "threaded"
    return chosen


def cannot_run(case: Case, opts: CheckOptions, backend: str, ws: int, sizes: list[int],
               mode: str = "ddp", compiled: Any = None) -> RunResult | None:
    """The ``error`` or ``skipped`` run that stands for a run of ``mode`` (ddp, fsdp, hsdp;
    ``compiled``: its CompileSpec) at ``ws`` which cannot happen here (a batch that cannot
    be sharded, too few GPUs, a mesh the world size does not fit, simulated ranks compiled);
    None when it can run."""
    repro = check_repro(case, opts, mode, ws, backend, compiled)
    if compiled is not None and backend == "threaded":
        return RunResult(mode=mode, world_size=ws, backend=backend, status="skipped", repro=repro, simulated=True,
                         reason=f"compiled runs need real rank processes: Dynamo's caches and compiled autograd are "
                                f"per process, and simulated ranks are threads of one; check compiled at world "
                                f"sizes up to {REAL_RANKS_LIMIT} (real processes)")
    skip = kind(mode).skip_reason(ws, opts.shard)
    if skip is not None:
        return RunResult(mode=mode, world_size=ws, backend=backend, status="skipped", repro=repro, reason=skip)
    if any(size < 1 for size in sizes):
        return RunResult(mode=mode, world_size=ws, backend=backend, status="error", repro=repro,
                         reason="cannot find the batch dimension: the data function's inputs hold no tensor "
                                "with a dim 0 to shard")
    uneven = [(step, size) for step, size in enumerate(sizes) if size % ws]
    if uneven:
        step, size = uneven[0]
        return RunResult(mode=mode, world_size=ws, backend=backend, status="error", repro=repro,
                         reason=f"the global batch of step {step} has {size} samples, which cannot be split "
                                f"into {ws} equal shards; use a batch size divisible by every world size "
                                f"(e.g. {_nearest_multiples(size, math.lcm(*opts.world_sizes))})")
    gpus = rendezvous.cuda_device_count() if backend == "nccl" else 0
    if backend == "nccl" and gpus < ws:
        return RunResult(mode=mode, world_size=ws, backend=backend, status="skipped", repro=repro,
                         reason=f"nccl needs {ws} CUDA devices, {gpus} visible")
    return None


def _nearest_multiples(size: int, multiple: int) -> str:
    """The batch sizes nearest ``size`` that ``multiple`` divides: ``15 or 18``."""
    below = size // multiple * multiple
    return f"{below} or {below + multiple}" if below else str(multiple)


# -- failures ----------------------------------------------------------------------------


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n"


def _user_error(exc: BaseException) -> str:
    """The error as the user should read it, with the traceback from their code (for
    ddparity's own messages about the case, only the traceback of what caused them)."""
    if isinstance(exc, TaskFailed):
        bad = [o for o in exc.outcomes if not o.ok]
        head = bad[0]
        tb = head.traceback
        if isinstance(head.error, (CaseError, UsageError)):
            tb = without_package_frames(tb.split(_CAUSE)[0]) if _CAUSE in tb else ""
        return f"rank {head.rank}: {type(head.error).__name__}: {head.error}\n{tb}".rstrip()
    return f"{type(exc).__name__}: {exc}"


def _own_error(exc: BaseException) -> str | None:
    """The reason for a run that ddparity's own code failed (not the user's rank): said
    as ddparity's, with the full traceback, never as the user's rank raising."""
    if not isinstance(exc, TaskFailed):
        return None
    for o in exc.outcomes:
        site = None if o.ok or isinstance(o.error, StillRunning) else own_error_site(o.traceback or "")
        if site is not None:
            return (f"ddparity's own code failed at {site} (a bug in ddparity, not in your model or step): "
                    f"{type(o.error).__name__}: {str(o.error).splitlines()[0] if str(o.error) else ''}\n"
                    f"please report it with the reproduce line below\n{o.traceback.rstrip()}")
    return None


def failure(exc: BaseException) -> Failure:
    """Why a run the World could not finish ended: ``error`` when the case itself cannot
    run (its factory, data or loss raised; the world could not start), else the desync,
    hang or crash that :func:`ddparity.checks.judge.judge_failure` finds."""
    if isinstance(exc, TaskFailed) and any(isinstance(o.error, (CaseError, UsageError))
                                           for o in exc.outcomes if not o.ok):
        return Failure("error", _user_error(exc))
    own = _own_error(exc)
    if own is not None:
        return Failure("error", own)
    if isinstance(exc, WorldFailure) and not isinstance(exc, WorldStartError):
        return judge_failure(exc)
    return Failure("error", _user_error(exc))


def failure_run(mode: str, ws: int, backend: str, exc: BaseException, seconds: float, repro: str) -> RunResult:
    """A check's run at ``ws`` that ``exc`` ended (see :func:`failure`)."""
    return ended(RunResult(mode=mode, world_size=ws, backend=backend, status="error", seconds=seconds, repro=repro),
                 exc)


def ended(run: RunResult, exc: BaseException) -> RunResult:
    """``run``, ended by ``exc`` (see :func:`failure`), with the likely cause of its desync."""
    run = run.failed(failure(exc))
    cause = likely_cause([], run.world_size, run.desync) if run.desync is not None else None
    run.notes += [c for c in (cause, crash_cause(run.crash, run.mode)) if c]
    return run


# -- reproduce lines ---------------------------------------------------------------------


LAUNCHED = "torchrun <the same launch options> -m ddparity"
"""How a reproduce line starts under a launch (its options are the user's own)."""


def check_repro(case: Case, opts: CheckOptions, mode: str, ws: int | None, backend: str, compiled: Any = None) -> str:
    """The command (or call) that runs this one run again: its mode with the mode's own
    options (:class:`~ddparity.run_kinds.RunKind`), world size (None: under a launch, whose
    world size torchrun decides), backend, steps, tolerance, a timeout other than the
    default, and ``compiled`` (the CompileSpec of a compiled run). Local and launched checks
    alike."""
    row, shard = kind(mode), opts.hsdp_shard
    timeout = opts.timeout if opts.timeout != TIMEOUT_S else None
    if case.target or ws is None:
        program, sizes = ("ddparity", f" --world-sizes {ws}") if ws is not None else (LAUNCHED, "")
        return (f"{program} check {case.target or 'TARGET'} --modes {mode}{row.cli_flags(shard)}{sizes} "
                f"--backend {backend} --steps {case.steps} --tolerance {opts.tolerance}"
                f"{f' --timeout {timeout:g}' if timeout else ''}{compiled.flags() if compiled else ''}")
    options = row.call_args(shard) + (f", timeout={timeout:g}" if timeout else "")
    if compiled:
        options += f", compile={compiled.backend!r}" + (f", compile_ddp={compiled.ddp!r}" if row.buckets else "")
    return (
        f"ddparity.check(case, modes=({mode!r},), world_sizes=({ws},), backend={backend!r}, "
        f"tolerance={opts.tolerance!r}{options})  # seed={case.seed}, steps={case.steps}"
    )


def profile_repro(case: Case, ws: int, backend: str, steps: int, warmup: int, timeout: float, mode: str = PROFILE_MODES[0],
                  shard: int = 0, arm: tuple[str, str] = ("", "")) -> str:
    """The command that profiles one row again (``arm``: its sweep's CLI flags and
    ``profile()`` arguments, :class:`~ddparity.verbs.profile_arms.Arm`)."""
    flags, call = arm
    if case.target:
        modes = f" --modes {mode}{kind(mode).cli_flags(shard)}" if (mode,) != PROFILE_MODES else ""
        return (f"ddparity profile {case.target}{modes}{flags} --world-sizes {ws} --backend {backend} --steps {steps} "
                f"--warmup {warmup} --timeout {timeout:g}")
    modes = f"modes=({mode!r},){kind(mode).call_args(shard)}, " if (mode,) != PROFILE_MODES else ""
    return (f"ddparity.profile(case, {modes}{call}world_sizes=({ws},), backend={backend!r}, timeout={timeout:g}, "
            f"steps={steps}, warmup={warmup})  # seed={case.seed}")


def health_repro(program: str, head: str, timeout: float, min_busbw: float | None,
                 sizes_bytes: tuple[int, ...], fault_env: str) -> str:
    sizes = ",".join(f"{b / 2**20:g}" for b in sizes_bytes)
    floor = f" --min-busbw {min_busbw:g}" if min_busbw is not None else ""
    drill = f"{fault_env}={os.environ[fault_env]} " if os.environ.get(fault_env) else ""
    return f"{drill}{program} health {head} --sizes {sizes} --timeout {timeout:g}{floor}"
