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
(:mod:`ddparity.harness.launch.watchdog`) and reported the same way, by the lowest rank alive.
``profile`` in a launch: :mod:`ddparity.verbs.launched_profile`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity.case import Case
from ddparity.checks.collectives import LiveWatch
from ddparity.errors import Exit, UsageError, WorldFailure
from ddparity.harness import store_keys
from ddparity.harness.launch import torchrun
from ddparity.harness.launch.everyone import Everyone
from ddparity.report import Report
from ddparity.run_kinds import FLAT_SHARDED_MODE, REPLICA_MODES, asked, kind
from ddparity.settings import CheckOptions, needs_newer_torch
from ddparity.verbs.checking import Checking
from ddparity.verdicts import RunResult

NONCE = "nonce"


def launch_world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "")
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"$WORLD_SIZE={text!r} is not a positive integer; is this process started by torchrun?")
    return int(text)


def launch_options(modes: tuple[str, ...] | list[str], world_sizes: Any, backend: str, timeout: float,
                   tolerance: str | float, steps: int | None, hsdp_shard: int | None = None,
                   compile: str | None = None, compile_ddp: str | None = None) -> CheckOptions:  # noqa: A002
    """The check's options under a launch, where torchrun decides the world size."""
    needs_newer_torch("ddparity check under torchrun", "run the check locally (ddparity check TARGET --world-sizes 2,4)")
    if compile is not None or compile_ddp is not None:
        raise UsageError("--compile is not supported under torchrun yet: check compiled training locally, on one "
                         "machine (ddparity check TARGET --modes single,ddp --compile BACKEND --world-sizes 2,4)")
    if world_sizes is not None:
        raise UsageError("--world-sizes is torchrun's to decide here (--nnodes x --nproc-per-node)")
    if backend == "threaded":
        raise UsageError("--backend threaded simulates ranks in one process; under torchrun the launched "
                         "processes are the ranks: use auto, gloo or nccl")
    opts = CheckOptions.validated("check", modes=modes, world_sizes=(launch_world_size(),), backend=backend,
                                  timeout=timeout, tolerance=tolerance, steps=steps, hsdp_shard=hsdp_shard)
    in_one_process = asked(opts.modes, "one_process")
    if in_one_process:
        mode = in_one_process[0]
        raise UsageError(f"mode {mode} (DataParallel) runs in one process over its GPUs: run it without torchrun "
                         f"(ddparity check TARGET --modes {mode})")
    return opts


def processes(world_size: int) -> str:
    nodes = os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_NNODES")
    return f"{world_size} processes" + (f" on {nodes} node(s)" if nodes else "")


class _LaunchedCheck:
    """One process's part of a launched check (the state the failure report needs). Stage 1
    is rank 0's reference; stage 2 + i every rank's run of the i-th replica mode asked for
    (ddp, fsdp, hsdp, in that order)."""

    def __init__(self, checking: Checking, emit: Callable[[Report], None]) -> None:
        self.checking, self.case, self.opts, self._emit_to = checking, checking.case, checking.opts, emit
        self.modes = [m for m in REPLICA_MODES if m in self.opts.modes]
        self.world = everyone(self.opts.backend, self.opts.timeout, self._report_failure, stages=1 + len(self.modes))
        self.launch, self.ctx, self.recorder, self.watch = (self.world.launch, self.world.ctx, self.world.recorder,
                                                            self.world.watch)
        self.started = time.perf_counter()
        self.ref_seconds = 0.0
        self.go: store_keys.CheckPlan | None = None
        self.spool_path = ""
        self.state: Any = None
        self.mode_started: dict[str, float] = {}

    # -- rank 0's reference ----------------------------------------------------------

    def reference_stage(self) -> store_keys.CheckPlan:
        from ddparity.harness.ranks.rank import released
        from ddparity.harness.ranks.tasks import prepare_task, reference_task, replica_task
        from ddparity.harness.spool_files import Spool

        checking, case, ctx, store = self.checking, self.case, self.ctx, self.launch.store
        self.recorder.begin_task(1)
        self.spool = Spool(janitor=True)
        self.watch.on_exit.append(self.spool.close)
        skipped: dict[str, tuple[str, str | None]] = {}
        with torchrun.alone(ctx.backend):
            sizes, valid = prepare_task(ctx, case, self.spool.path)
            for mode in self.modes:  # GPUs: the launch's own
                unrunnable = checking.cannot_run("gloo", ctx.world_size, sizes, mode)
                if unrunnable is not None:
                    skipped[mode] = (unrunnable.status, unrunnable.reason)
            if len(skipped) < len(self.modes) or not self.modes:
                checking.referenced(reference_task(ctx, case, self.spool.path, (ctx.world_size,), checking.sharded),
                                    valid)
                self.ref_seconds = time.perf_counter() - self.started
            if case.fsdp is not None and any(kind(m).sharded and m not in skipped for m in self.modes):
                released()
                alone = dataclasses.replace(ctx, world_size=1)
                checking.policy_noise(replica_task(alone, case, self.spool.path, FLAT_SHARDED_MODE, 1))
        released()
        self.recorder.end_task()
        nonce = secrets.token_hex(16)
        with open(os.path.join(self.spool.path, NONCE), "w") as f:
            f.write(nonce)
        go = store_keys.CheckPlan(self.spool.path, nonce, self.launch.node, skipped,
                                  [m for m in self.modes if m not in skipped], self._single_run())
        store.set(store_keys.CHECK_PLAN, go.encode())
        self.go = go
        return go

    def wait_for_reference(self) -> store_keys.CheckPlan:
        store = self.launch.store
        while not store.check([store_keys.CHECK_PLAN]):  # the watch reports rank 0 should it hang or die meanwhile
            time.sleep(0.05)
        self.go = store_keys.CheckPlan.decode(store.get(store_keys.CHECK_PLAN))
        return self.go

    # -- every rank's replicas ---------------------------------------------------------

    def join(self, go: store_keys.CheckPlan) -> Any:
        """Every rank: the launch's process group, and the reference's way here (rank 0's
        spool in place on its node, else its initial state fetched over the network)."""
        from ddparity.harness.launch.refserve import ReferenceServer, RemoteReference
        from ddparity.harness.ranks.tasks import WAIT_LIMIT_S
        from ddparity.harness.spool_files import Spool, load_state

        ctx, launch = self.ctx, self.launch
        self.watch.stage = 2
        torchrun.form_world(launch, self.opts.timeout)
        self.spool_path = go.spool
        self.served = ctx.rank != 0 and not self._reads_rank0_spool(go)
        if ctx.rank != 0 and not self.served:  # should rank 0 die (a gloo abort), its spool is ours to remove
            self.watch.on_exit.append(lambda: self._remove_if_gone(go.spool))
        if ctx.rank == 0:  # each peer asks for the state or says bye: no thread of it is left to take later asks
            ReferenceServer(launch.serve, self.spool_path, list(range(1, ctx.world_size)), WAIT_LIMIT_S)
        else:
            remote = RemoteReference(launch.serve)
            if self.served:
                with Spool() as own:  # the state, loaded (mapped) then unlinked: nothing left should this rank die
                    remote.fetch_state(own.path)
                    self.state = load_state(own.path)
            remote.close()
        launch.store.set(store_keys.reference_read(ctx.rank), store_keys.SERVED if self.served else store_keys.IN_PLACE)

    def replica_stage(self, index: int, mode: str) -> Any:
        """Every rank's run of ``mode``, compared step by step with the reference."""
        from ddparity.harness.launch.refserve import ReferenceServer, RemoteReference
        from ddparity.harness.ranks.tasks import WAIT_LIMIT_S, replica_task

        ctx = self.ctx
        self.watch.stage = 2 + index
        self.mode_started[mode] = time.perf_counter()
        if ctx.rank == 0:
            ReferenceServer(self.launch.serve, self.spool_path, list(range(1, ctx.world_size)), WAIT_LIMIT_S)
        remote = RemoteReference(self.launch.serve) if ctx.rank != 0 else None
        if remote is not None and not self.served:
            remote.close()  # on rank 0's node: the spool in place
            remote = None
        self.recorder.begin_task(2 + index)
        open_step = remote.open_step if remote else None
        shard_size = kind(mode).shard_size(ctx.world_size, self.opts.shard)
        distances = replica_task(ctx, self.case, self.spool_path, mode, shard_size, open_step=open_step,
                                 state=self.state)
        self.recorder.end_task()
        if remote is not None:
            remote.close()
        return distances

    def _remove_if_gone(self, spool: str) -> None:
        if self.watch.gone(0):
            shutil.rmtree(spool, ignore_errors=True)

    def _reads_rank0_spool(self, go: store_keys.CheckPlan) -> bool:
        if self.launch.node != go.node:
            return False
        try:
            with open(os.path.join(go.spool, NONCE)) as f:
                return f.read() == go.nonce
        except OSError:
            return False

    # -- rank 0's report ----------------------------------------------------------------

    def report_completed(self) -> int:
        """Rank 0, once every rank published its distances of the last mode (the others
        wait for the verdict)."""

        store, n = self.launch.store, self.ctx.world_size
        ran = self.go.run if self.go else []
        if ran:
            self.world.gather()
        elif not self.watch.claim():
            self.watch.idle()
        report = self._report()
        if ran and self.ctx.rank == 0:
            self.checking.loss_probe = self._probe
        served = [r for r in range(n) if store.get(store_keys.reference_read(r)).decode() == store_keys.SERVED] if ran \
            else []
        assert self.checking.reference is not None or not ran
        locator = self._locator(served) if ran else None
        try:
            self._judge_each(report, ran, served)
        finally:
            if locator is not None:
                locator.close()
        return self._emit(report)

    def _locator(self, served: list[int]) -> Any:
        """Rank 0's re-runs of a diverging run's first differing step by every rank
        (:mod:`ddparity.harness.launch.localise`), as :class:`Checking` asks for them."""
        from ddparity.harness.launch.localise import LaunchLocator

        locator = LaunchLocator(self.launch, self.case, self.spool_path, self.opts.timeout, served,
                                self.localise_stage)
        self.checking.locator = lambda mode, ws, backend, step, size, inside=None: locator(
            mode, kind(mode).shard_size(ws, self.opts.shard), step, size, inside)
        return locator

    @property
    def localise_stage(self) -> int:
        """The store's stage of the first re-run asked for (after every mode's)."""
        return 2 + len(self.modes)

    def answer_asks(self) -> None:
        """Every rank but 0, after its last run: the re-runs rank 0 asks for, until it says none."""
        from ddparity.harness.launch.localise import answer_asks

        answer_asks(self.launch, self.case, self.spool_path, self.localise_stage, self.served)

    def _judge_each(self, report: Report, ran: list[str], served: list[int]) -> None:
        from ddparity.harness.sidechannel import TaskChannel

        store, n = self.launch.store, self.ctx.world_size
        for mode in self.modes:
            if mode not in ran:
                report.runs.append(self._skipped(mode))
                continue
            stage = 2 + self.modes.index(mode)
            runs = self.world.collect(stage)
            records = TaskChannel(store, "", stage, n).read()
            run = self._replica_run(mode, "pass")
            if served:
                run.notes.append(f"rank(s) {served} (not on rank 0's node) compared against the reference served "
                                 f"by rank 0 over the network")
            report.runs.append(self.checking.judge(run, runs, records))

    def _probe(self) -> float | None:
        """Rank 0: the loss-scaling probe on its own device, from its spool (None should it
        fail: the causes are then named as candidates)."""
        from ddparity.harness.ranks.probes import loss_scaling_task

        try:
            return loss_scaling_task(dataclasses.replace(self.ctx, world_size=1), self.case, self.spool.path)
        except Exception:
            return None

    def _single_run(self) -> tuple[str | None, float] | None:
        """The reference's run as rank 0 saw it (any rank may have to report it)."""
        if not asked(self.opts.modes, "reference") or self.checking.reference is None:
            return None
        blowup = self.checking.blowup
        return (blowup.reason() if blowup else None, self.ref_seconds)

    def _report(self) -> Report:
        report = Report(self.case.label)
        single = self.go.single if self.go else None
        if single:
            reason, seconds = single
            report.runs += self.checking.reference_rows(self.ctx.backend, seconds, reason)
        return report

    def _skipped(self, mode: str) -> RunResult:
        assert self.go is not None
        status, reason = self.go.skipped.get(mode) or (
            "skipped", "not run: the launch ended at an earlier mode's failure")
        return RunResult(mode=mode, world_size=self.ctx.world_size, backend=self.ctx.backend, status=status,
                         reason=reason, repro=self.checking.repro(mode, self.ctx.world_size, self.ctx.backend))

    def _replica_run(self, mode: str, status: str) -> RunResult:
        ctx = self.ctx
        return self.checking.replica_row(
            mode, ctx.world_size, ctx.backend, time.perf_counter() - self.mode_started.get(mode, self.started), status,
            said=[f"launched: {processes(ctx.world_size)}; the reference on rank 0 ({ctx.device})"])

    def _report_failure(self, exc: WorldFailure, stage: int) -> int:
        from ddparity.verbs.plan import ended

        report = Report(self.case.label)
        if stage == 1:
            return self._emit(self.checking.failed_everywhere(report, self.ctx.backend, exc,
                                                              time.perf_counter() - self.started))
        report = self._report()
        failed = self.modes[stage - 2]
        for mode in self.modes:
            if mode == failed:
                report.runs.append(ended(self._replica_run(mode, "error"), exc))
            elif self.go is not None and mode in self.go.skipped:
                report.runs.append(self._skipped(mode))
            else:  # judged only once every mode ran: an earlier mode's verdict is not this report's to give
                run = self._skipped(mode)
                run.reason = (f"not judged: the launch stopped at the {failed} run's failure" if
                              self.modes.index(mode) < self.modes.index(failed) else
                              f"not run: the launch stopped at the {failed} run's failure")
                report.runs.append(run)
        return self._emit(report)

    def _emit(self, report: Report) -> int:
        self._emit_to(report)
        return report.exit_code



def check_launched(case: Case, opts: CheckOptions, emit: Callable[[Report], None]) -> NoReturn:
    """This process's part of ``check`` in a launch; rank 0 (or the lowest rank alive)
    hands the report to ``emit`` (print it, write the JSON); every process exits with the
    verdict's code."""
    me = _LaunchedCheck(Checking.of(case, opts, launched=True), emit)
    rank = me.ctx.rank
    try:
        go = me.reference_stage() if rank == 0 else me.wait_for_reference()
        if go.run:
            me.join(go)
        for index, mode in enumerate(me.modes):
            if mode in go.run:
                me.world.publish(me.replica_stage(index, mode))
    except KeyboardInterrupt:
        os._exit(Exit.INTERRUPTED)
    except BaseException as exc:
        me.watch.fail(exc)
    if rank != 0:
        if go.run:
            me.answer_asks()
        me.watch.idle()
    me.watch.finish(me.report_completed())


def everyone(backend: str, timeout: float, failed: Callable[[WorldFailure, int], int], stages: int = 2) -> Everyone:
    """A launch in which every rank runs one task (or one a stage), watched for collective
    mismatches too (see :class:`~ddparity.harness.launch.everyone.Everyone`)."""
    return Everyone(backend, timeout, failed, LiveWatch(), stages)


__all__ = ["check_launched", "everyone", "launch_options"]
