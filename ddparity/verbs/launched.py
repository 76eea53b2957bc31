"""``check`` and ``profile`` inside a torchrun (or Slurm) launch: the launched processes
are the world (``torchrun ... -m ddparity check TARGET``).

Every process loads the target and joins the launch (:func:`ddparity.harness.launch.torchrun.connect`).
For ``check``:

1. rank 0 builds the initial state into its spool and trains the single-device reference
   (and its calibration twin) on its own device, writing every step; the others wait;
2. every rank trains its DDP replica at world size ``WORLD_SIZE`` and compares each step
   with the reference: in place where it can read rank 0's spool (rank 0's node), else
   served by rank 0 over a gloo group of its own (:mod:`ddparity.harness.launch.refserve`);
3. rank 0 gathers the distances and what the ranks left in the side channel (through the
   launch's store), judges them exactly as a local check does, prints the report and
   writes the JSON; every process exits with the verdict's code.

A hang, a crash or a collective mismatch anywhere is found by the processes' watch threads
(:mod:`ddparity.harness.launch.watch`) and reported the same way, by the lowest rank alive.
``profile`` times DDP steps on every rank and rank 0 summarises them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity.case import Case
from ddparity.checks.collectives import LiveWatch
from ddparity.checks.equivalence import NonFinite, first_non_finite
from ddparity.distances import Reference
from ddparity.errors import Exit, UsageError, WorldFailure
from ddparity.harness.launch import torchrun
from ddparity.harness.launch.everyone import Everyone
from ddparity.report import Report
from ddparity.settings import CheckOptions, needs_newer_torch
from ddparity.verdicts import RunResult

NONCE = "nonce"
PROGRAM = "torchrun <the same launch options> -m ddparity"


def _world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "")
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"$WORLD_SIZE={text!r} is not a positive integer; is this process started by torchrun?")
    return int(text)


def launch_options(modes: tuple[str, ...] | list[str], world_sizes: Any, backend: str, timeout: float,
                   tolerance: str | float, steps: int | None) -> CheckOptions:
    """The check's options under a launch, where torchrun decides the world size."""
    needs_newer_torch("ddparity check under torchrun", "run the check locally (ddparity check TARGET --world-sizes 2,4)")
    if world_sizes is not None:
        raise UsageError("--world-sizes is torchrun's to decide here (--nnodes x --nproc-per-node)")
    if "dp" in modes:
        raise UsageError("mode dp (DataParallel) runs in one process over its GPUs: run it without torchrun "
                         "(ddparity check TARGET --modes dp)")
    if backend == "threaded":
        raise UsageError("--backend threaded simulates ranks in one process; under torchrun the launched "
                         "processes are the ranks: use auto, gloo or nccl")
    sharded = [m for m in modes if m in ("fsdp", "hsdp")]
    if sharded:
        raise UsageError(f"mode {', '.join(sharded)} is not checked under torchrun yet (only ddp is): run it "
                         f"locally (ddparity check TARGET --modes {','.join(sharded)} --world-sizes 2,4)")
    return CheckOptions.validated("check", modes=modes, world_sizes=(_world_size(),), backend=backend,
                                  timeout=timeout, tolerance=tolerance, steps=steps)


def _repro(case: Case, backend: str, opts: CheckOptions) -> str:
    target = case.target or "TARGET"
    return f"{PROGRAM} check {target} --backend {backend} --steps {case.steps} --tolerance {opts.tolerance}"


def _processes(world_size: int) -> str:
    nodes = os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_NNODES")
    return f"{world_size} processes" + (f" on {nodes} node(s)" if nodes else "")


class _LaunchedCheck:
    """One process's part of a launched check (the state the failure report needs)."""

    def __init__(self, case: Case, opts: CheckOptions, emit: Callable[[Report], None]) -> None:
        self.case, self.opts, self._emit_to = case, opts, emit
        self.world = everyone(opts.backend, opts.timeout, self._report_failure)
        self.launch, self.ctx, self.recorder, self.watch = (self.world.launch, self.world.ctx, self.world.recorder,
                                                            self.world.watch)
        self.started = time.perf_counter()
        self.reference: Reference | None = None
        self.blowup: NonFinite | None = None
        self.ref_seconds = 0.0
        self.go: dict[str, Any] | None = None
        self.valid: dict[str, list[int]] = {}

    # -- rank 0's reference ----------------------------------------------------------

    def reference_stage(self) -> dict[str, Any]:
        from ddparity.harness.ranks.rank import released
        from ddparity.harness.ranks.spool import Spool
        from ddparity.harness.ranks.tasks import prepare_task, reference_task
        from ddparity.verbs.plan import cannot_run

        case, ctx, store = self.case, self.ctx, self.launch.store
        self.recorder.begin_task(1)
        self.spool = Spool(janitor=True)
        self.watch.on_exit.append(self.spool.close)
        with torchrun.alone(ctx.backend):
            sizes, self.valid = prepare_task(ctx, case, self.spool.path)
            unrunnable = cannot_run(case, self.opts, "gloo", ctx.world_size, sizes)  # GPUs: the launch's own
            if unrunnable is not None:
                unrunnable.backend, unrunnable.repro = ctx.backend, _repro(case, ctx.backend, self.opts)
                self.unrunnable = unrunnable
            else:
                self.reference = reference_task(ctx, case, self.spool.path, (ctx.world_size,))
                self.ref_seconds = time.perf_counter() - self.started
                self.blowup = first_non_finite(self.reference)
        released()
        self.recorder.end_task()
        nonce = secrets.token_hex(16)
        with open(os.path.join(self.spool.path, NONCE), "w") as f:
            f.write(nonce)
        go = {"spool": self.spool.path, "nonce": nonce, "node": self.launch.node, "run": unrunnable is None,
              "single": self._single_run()}
        store.set("go", json.dumps(go))
        self.go = go
        return go

    def wait_for_reference(self) -> dict[str, Any]:
        store = self.launch.store
        while not store.check(["go"]):  # the watch reports rank 0 should it hang or die meanwhile
            time.sleep(0.05)
        self.go = json.loads(store.get("go"))
        return self.go

    # -- every rank's DDP replica ------------------------------------------------------

    def ddp_stage(self, go: dict[str, Any]) -> Any:
        from ddparity.harness.launch.refserve import ReferenceServer, RemoteReference
        from ddparity.harness.ranks.spool import Spool, load_state
        from ddparity.harness.ranks.tasks import WAIT_LIMIT_S, ddp_task

        ctx, launch = self.ctx, self.launch
        self.watch.stage = 2
        torchrun.form_world(launch, self.opts.timeout)
        if ctx.rank == 0:
            self.server = ReferenceServer(launch.serve, go["spool"], list(range(1, ctx.world_size)), WAIT_LIMIT_S)
        remote = None if ctx.rank == 0 else RemoteReference(launch.serve)
        spool_path, state = go["spool"], None
        if remote is not None and self._reads_rank0_spool(go):
            remote.close()  # on rank 0's node: the spool in place
            remote = None
            # should rank 0 die (a gloo abort), its spool is ours to remove
            self.watch.on_exit.append(lambda: self._remove_if_gone(go["spool"]))
        elif remote is not None:
            with Spool() as own:  # the state, loaded (mapped) then unlinked: nothing left should this rank die
                remote.fetch_state(own.path)
                state = load_state(own.path)
        launch.store.set(f"N{ctx.rank}", "served" if remote is not None else "spool")
        self.recorder.begin_task(2)
        distances = ddp_task(ctx, self.case, spool_path, open_step=remote.open_step if remote else None, state=state)
        self.recorder.end_task()
        if remote is not None:
            remote.close()
        return distances

    def _remove_if_gone(self, spool: str) -> None:
        if self.watch.gone(0):
            shutil.rmtree(spool, ignore_errors=True)

    def _reads_rank0_spool(self, go: dict[str, Any]) -> bool:
        if self.launch.node != go["node"]:
            return False
        try:
            with open(os.path.join(go["spool"], NONCE)) as f:
                return f.read() == go["nonce"]
        except OSError:
            return False

    # -- rank 0's report ----------------------------------------------------------------

    def report_completed(self) -> int:
        """Rank 0, once every rank published its distances (the others wait for the verdict)."""
        from ddparity.harness.sidechannel import TaskChannel
        from ddparity.verbs.check import judge_ddp

        store, n = self.launch.store, self.ctx.world_size
        runs = self.world.gather()
        records = TaskChannel(store, "", 2, n).read()
        report = self._report()
        run = self._ddp_run("pass")
        served = [r for r in range(n) if store.get(f"N{r}") == b"served"]
        if served:
            run.notes.append(f"rank(s) {served} (not on rank 0's node) compared against the reference served by "
                             f"rank 0 over the network")
        assert self.reference is not None
        report.runs.append(judge_ddp(self.case, self.opts, run, runs, records, self.reference, self.blowup,
                                     self.valid))
        return self._emit(report)

    def report_unrunnable(self) -> int:
        if not self.watch.claim():
            self.watch.idle()
        report = Report(self.case.label, [self.unrunnable])
        return self._emit(report)

    def _single_run(self) -> dict[str, Any] | None:
        """The reference's run as rank 0 saw it (any rank may have to report it)."""
        if "single" not in self.opts.modes or self.reference is None:
            return None
        blowup = self.blowup
        return {"status": "error" if blowup else "pass", "reason": blowup.reason() if blowup else None,
                "seconds": self.ref_seconds}

    def _report(self) -> Report:
        report = Report(self.case.label)
        single = self.go.get("single") if self.go else None
        if single:
            report.runs.append(RunResult(mode="single", world_size=1, backend=self.ctx.backend, tolerance="reference",
                                         **single))
        return report

    def _ddp_run(self, status: str) -> RunResult:
        ctx = self.ctx
        run = RunResult(mode="ddp", world_size=ctx.world_size, backend=ctx.backend, status=status,
                        seconds=time.perf_counter() - self.started,
                        repro=_repro(self.case, ctx.backend, self.opts))
        run.notes.append(f"launched: {_processes(ctx.world_size)}; the reference on rank 0 ({ctx.device})")
        return run

    def _report_failure(self, exc: WorldFailure, stage: int) -> int:
        from ddparity.verbs.check import case_failed
        from ddparity.verbs.plan import failure

        report = Report(self.case.label)
        if stage == 1:
            case_failed(report, self.case, self.opts, self.ctx.backend, exc, time.perf_counter() - self.started)
            for run in report.runs:
                run.repro = _repro(self.case, self.ctx.backend, self.opts)
        else:
            report = self._report()
            report.runs.append(self._ddp_run("error").failed(failure(exc)))
        return self._emit(report)

    def _emit(self, report: Report) -> int:
        self._emit_to(report)
        return report.exit_code


def check_launched(case: Case, opts: CheckOptions, emit: Callable[[Report], None]) -> NoReturn:
    """This process's part of ``check`` in a launch; rank 0 (or the lowest rank alive)
    hands the report to ``emit`` (print it, write the JSON); every process exits with the
    verdict's code."""
    case = case.with_steps(opts.steps).validate()
    me = _LaunchedCheck(case, opts, emit)
    rank = me.ctx.rank
    try:
        go = me.reference_stage() if rank == 0 else me.wait_for_reference()
        if not go["run"]:
            if rank == 0:
                me.watch.finish(me.report_unrunnable())
            me.watch.idle()
        me.world.publish(me.ddp_stage(go))
    except KeyboardInterrupt:
        os._exit(Exit.INTERRUPTED)
    except BaseException as exc:
        me.watch.fail(exc)
    me.watch.finish(me.report_completed())


def profile_launched(case: Case, backend: str, timeout: float, steps: int, warmup: int,
                     emit: Callable[[Any], None]) -> NoReturn:
    """This process's part of ``profile`` in a launch: rank 0 times the case on its own
    first (world size 1, in a process group of its own: the baseline of the scaling
    figure), then every rank times DDP steps; rank 0 summarises both and reports; every
    process exits with the report's code."""
    from ddparity.checks.comm import add_scaling, summarize
    from ddparity.harness.ranks.tasks import profile_task
    from ddparity.harness.ranks.training import initial_state
    from ddparity.report import ProfileReport
    from ddparity.verbs.profile import failed_run

    if backend == "threaded":
        raise UsageError("profiling needs real rank processes: use --backend auto, gloo or nccl")
    needs_newer_torch("ddparity profile under torchrun", "profile locally (ddparity profile TARGET)")
    case = case.validate()
    started = time.perf_counter()
    runs: list[Any] = []

    def failed(exc: WorldFailure, stage: int) -> int:
        ws = 1 if stage == 1 else me.ctx.world_size
        report = ProfileReport(case.label, [*runs, failed_run(ws, me.ctx.backend, exc, time.perf_counter() - started)])
        emit(report)
        return report.exit_code

    def baseline() -> None:
        one = summarize([me.alone(profile_task, case, initial_state(case), steps, warmup)], me.ctx.backend)
        one.notes.append("rank 0 alone: the baseline of the scaling figure")
        runs.append(one)

    me = everyone(backend, timeout, failed)
    # every rank builds the initial state from the seed; DDP broadcasts rank 0's anyway
    profiles = me.run(baseline, lambda ctx: profile_task(ctx, case, initial_state(case), steps, warmup))
    run = summarize(profiles, me.ctx.backend)
    run.seconds = time.perf_counter() - started
    run.notes.append(f"launched: {_processes(me.ctx.world_size)}; bus bandwidth over the launch's own interconnect")
    report = ProfileReport(case.label, [*runs, run])
    add_scaling(report.runs)
    emit(report)
    me.watch.finish(report.exit_code)


def everyone(backend: str, timeout: float, failed: Callable[[WorldFailure, int], int]) -> Everyone:
    """A launch in which every rank runs one task, watched for collective mismatches too
    (see :class:`~ddparity.harness.launch.everyone.Everyone`)."""
    return Everyone(backend, timeout, failed, LiveWatch())


__all__ = ["check_launched", "everyone", "launch_options", "profile_launched"]
