"""``ddparity watch``: a training script ddparity did not write, run as it is in every rank
of a launch, watched for hangs, crashes, mismatched collectives and replicas drifting apart.

Each process joins the launch's store (:func:`ddparity.harness.launch.torchrun.connect`),
records every collective (:mod:`ddparity.harness.recording.recorder`, the keys kept to the
last few: :class:`~ddparity.harness.sidechannel.RingRankChannel`), learns the script's DDP
and FSDP2 modules and fingerprints their parameters after each ``optimizer.step()``
(:mod:`ddparity.harness.recording.replicas`), starts its watch thread
(:class:`~ddparity.harness.launch.watchdog.LaunchWatch`) and runs the script
(:func:`ddparity.harness.launch.watched.run_script`). The reporter's watch thread judges
live with :class:`WatchLive`: ranks that issued different collectives, replicas whose
fingerprints differ, a rank whose place has not moved for the timeout. When every rank's
script ended, the reporter judges what they left (the same judges as ``check``); a
passing verdict lets each process exit with its script's own exit code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity.checks.causes import likely_cause
from ddparity.checks.collectives import LiveWatch
from ddparity.checks.desync import ReplicaDrift, first_desync
from ddparity.checks.judge import judge_completed, state_desync
from ddparity.errors import Exit, TaskStopped, UsageError, WorldFailure
from ddparity.harness import store_keys
from ddparity.records import fingerprint_line, last_fingerprint_step, parse_fingerprints
from ddparity.report import Report
from ddparity.verdicts import Failure, RunResult

STAGE = 2
"""The launch's stage in which every rank runs the script (its side-channel task)."""

PROGRAM = "ddparity watch"
VERDICT_ENV = "DDPARITY_WATCH_VERDICT"
"""Where the reporter writes the verdict's exit code for :func:`watch_locally` (a file in
the launcher's private folder)."""


class WatchLive:
    """The reporter's live judge of a watched launch, called with every rank's progress
    record whenever one changed: a reason to stop the run, or None."""

    def __init__(self, store: Any, world_size: int, timeout: float) -> None:
        from ddparity.harness.sidechannel import task_prefix

        self.store, self.n, self.timeout = store, world_size, timeout
        self.collectives = LiveWatch()
        self.drift: ReplicaDrift | None = None
        self._since: dict[int, tuple[str, float]] = {}
        self._finished: set[int] = set()
        self._compared = -1
        self._keys = [f"{task_prefix('', STAGE)}F{r}" for r in range(world_size)]

    def __call__(self, progress: list[str]) -> str | None:
        reason = self.collectives(progress)
        if reason:
            return reason
        drift = self._drifted()
        if drift is not None:
            self.drift = drift
            return f"replicas drifted apart: {drift.what()} differ across ranks after step {drift.step}"
        return self._stalled(progress)

    def _drifted(self) -> ReplicaDrift | None:
        """Compare the fingerprints of the latest step every rank published (each step's
        line once; the whole window only where they differ, to name the first step)."""
        if self.n < 2:
            return None
        texts = [v.decode() for v in self.store.multi_get(self._keys)]
        lasts = [last_fingerprint_step(t) for t in texts]
        if any(s is None for s in lasts):
            return None
        common = min(s for s in lasts if s is not None)
        if common <= self._compared:
            return None
        self._compared = common
        if len({fingerprint_line(t, common) for t in texts}) == 1:
            return None  # byte-identical: every rank holds the same names and values
        return first_desync({r: parse_fingerprints(t) for r, t in enumerate(texts)})

    def _stalled(self, progress: list[str]) -> str | None:
        """A rank that has not finished and whose record has not changed for the timeout."""
        now = time.monotonic()
        for r, text in enumerate(progress):
            if r not in self._since or self._since[r][0] != text:
                self._since[r] = (text, now)
        late = [r for r in range(self.n) if r not in self._finished and now - self._since[r][1] > self.timeout]
        self._finished.update(r for r in late if self.store.check([store_keys.result(STAGE, r)]))
        stalled = [r for r in late if r not in self._finished]
        if not stalled:
            return None
        return (f"rank(s) {stalled} made no progress for {self.timeout:g} s (no collective, no optimizer step, "
                f"their Python standing still)")


class _Watched:
    """One process of a watched launch: the script's rank, and (rank 0, or the lowest
    rank alive) the reporter."""

    def __init__(self, script: str, args: list[str], timeout: float, emit: Callable[[Report], None],
                 module: bool = False, flight_recorder: str | None = None) -> None:
        from ddparity.harness.launch import torchrun
        from ddparity.harness.launch.watchdog import LaunchWatch
        from ddparity.harness.recording.recorder import install_recorder
        from ddparity.harness.recording.replicas import install
        from ddparity.harness.sidechannel import RingRankChannel

        self.script, self.args, self.timeout, self._emit_to, self.module = script, args, timeout, emit, module
        self.file = validate_script(script, module)
        self.started = time.perf_counter()
        self.launch = torchrun.connect("gloo", timeout, tasks=(STAGE,))
        self.rank, self.n, self.store = self.launch.ctx.rank, self.launch.ctx.world_size, self.launch.store
        self.channel = RingRankChannel(self.store, "", self.rank)
        self.recorder = install_recorder(self.channel, write_behind=True)
        self.replicas = install(self.recorder, self.n)
        self.live = WatchLive(self.store, self.n, timeout)
        self.watch = LaunchWatch(self.store, self.rank, self.n, timeout, self._report_failure, self.live)
        self.watch.stage = STAGE
        self.flight_recorder = flight_recorder
        if flight_recorder:
            self.watch.on_exit.append(lambda: self._dump(finished=False))

    def run(self) -> int:
        """Run the script; return its exit code once the verdict passed (a failing verdict
        ends the process with the verdict's code)."""
        from ddparity.harness.launch.watched import FrameTicker, from_script, run_script

        self.recorder.begin_task(STAGE)
        self.recorder.set_phase(0, "")
        ticker = FrameTicker(self.recorder)
        try:
            code = run_script(self.script, self.args, self.module)
            self.replicas.flush()
        except KeyboardInterrupt:
            os._exit(Exit.INTERRUPTED)
        except BaseException as exc:
            ticker.stop()
            self.recorder.flush()  # its last collective (one gloo aborted, say) in the store first
            self.watch.fail(from_script(exc, self.file))
        ticker.stop()
        self.recorder.end_task()
        self.store.set(store_keys.result(STAGE, self.rank), json.dumps(self._summary(code)))
        if self.rank != 0:
            self.watch.await_verdict()
            self._dump(finished=True)
            return code
        while not self.store.check([store_keys.result(STAGE, r) for r in range(self.n)]):
            time.sleep(0.05)
        if not self.watch.claim():
            self.watch.idle()
        verdict = self._report_completed()
        if verdict != 0:
            self.watch.finish(verdict)
        self.watch.publish_verdict(0)
        self._dump(finished=True)
        return code

    def _dump(self, finished: bool) -> None:
        """This rank's ledger as a Flight Recorder dump, where ``--flight-recorder`` asked."""
        from ddparity.harness.launch.flight import fr_dump, write_fr_dump
        from ddparity.harness.recording.calls import GROUP_RANKS

        if self.flight_recorder:
            backend = self._summary(0)["backend"] or "gloo"
            running = not finished and self.recorder.last_running()
            write_fr_dump(self.flight_recorder, self.rank,
                          fr_dump(list(self.channel.ledger), self.rank, self.n, GROUP_RANKS, running, backend))

    def _summary(self, code: int) -> dict[str, Any]:
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else self.replicas.backend
        return {"code": code, "steps": self.replicas.steps, "mode": self.replicas.mode, "backend": backend,
                "unmatched": self.replicas.unmatched, "replicated": self.replicas.replicated,
                "collectives": sum(n + 1 for n in self.recorder.seq.values())}

    # -- the reporter -----------------------------------------------------------------

    def _run(self, status: str, results: list[dict[str, Any]] | None = None) -> RunResult:
        mine = results[0] if results else self._summary(-1)
        run = RunResult(mode=mine["mode"], world_size=self.n, backend=mine["backend"] or "unknown", status=status,
                        seconds=time.perf_counter() - self.started, repro=self._repro())
        run.notes.append(f"watched: {self.n} processes running {self.script} as it is (no Case)")
        if results:
            steps = min(r["steps"] for r in results)
            compared = (f"{steps} optimizer step(s) fingerprinted and compared across {mine['mode']} replicas"
                        if min(r["replicated"] for r in results) else
                        f"{steps} optimizer step(s) ran; no parameter is held by two ranks (FSDP2 shards, or one "
                        f"rank): no replicas to compare" if steps else "no optimizer.step() ran: replicas not compared")
            run.notes.append(f"{min(r['collectives'] for r in results)} collectives recorded per rank; {compared}")
            unmatched = max(r["unmatched"] for r in results)
            if unmatched:
                run.notes.append(f"{unmatched} parameter(s) an optimizer stepped belong to no DDP or FSDP2 module: "
                                 f"not compared across ranks")
            if self.flight_recorder:
                run.notes.append(f"each rank's collectives written as a Flight Recorder dump to {self.flight_recorder} "
                                 f"(on its own node): python -m torch.distributed.flight_recorder.fr_trace "
                                 f"{self.flight_recorder}")
            codes = {r: res["code"] for r, res in enumerate(results) if res["code"]}
            if codes:
                run.notes.append(f"the script's own exit code(s), passed through: {codes}")
        return run

    def _repro(self) -> str:
        import shlex

        return f"torchrun --nproc-per-node {self.n} -m {PROGRAM} --timeout {self.timeout:g} " + shlex.join(
            [*(["-m"] if self.module else []), self.script, *self.args])

    def _report_completed(self) -> int:
        from ddparity.harness.sidechannel import TaskChannel

        results = [json.loads(self.store.get(store_keys.result(STAGE, r))) for r in range(self.n)]
        records = TaskChannel(self.store, "", STAGE, self.n).read()
        run = judge_completed(self._run("pass", results), records, [])
        return self._emit(run)

    def _report_failure(self, exc: WorldFailure, stage: int) -> int:
        from ddparity.verbs.plan import failure

        run = self._run("error")
        drift = self.live.drift
        if drift is not None and isinstance(exc, TaskStopped):
            prints = {r: parse_fingerprints(s.fingerprints) for r, s in (exc.records or {}).items()}
            drift = first_desync(prints) or drift  # the first step the ranks' windows hold
            run.failed(Failure("desync", f"replicas drifted apart after step {drift.step}",
                               desync=state_desync(drift)))
        else:
            run.failed(failure(exc))
        return self._emit(run)

    def _emit(self, run: RunResult) -> int:
        cause = likely_cause([], self.n, run.desync) if run.desync is not None else None
        run.notes += [cause] if cause else []
        report = Report(self.script, [run], verb="watch")
        self._emit_to(report)
        verdict_file = os.environ.get(VERDICT_ENV)
        if verdict_file:  # the local launcher's private file
            with open(verdict_file, "w") as f:
                f.write(str(report.exit_code))
        return report.exit_code


def watch_launched(script: str, args: list[str], timeout: float, emit: Callable[[Report], None],
                   module: bool = False, flight_recorder: str | None = None) -> NoReturn:
    """This process's part of ``watch`` in a launch: it ends with the script's exit code
    when the verdict passes, else with the verdict's."""
    from ddparity.harness.launch.watched import exit_as_the_script_would

    exit_as_the_script_would(_Watched(script, args, timeout, emit, module, flight_recorder).run())


def watch_locally(nproc: int, rank_argv: list[str]) -> int:
    """``ddparity watch --nproc-per-node N``: the ranks started here (this process holds the
    store, as torchrun's agent would); the verdict's exit code, else the script's own."""
    from ddparity.harness.launch.watchdog import ACK_WAIT_S, TERM_GRACE_S
    from ddparity.harness.launch.watched import launch_locally
    from ddparity.harness.sidechannel import private_root

    verdict_file = os.path.join(private_root(), f"watch-verdict-{os.getpid()}")
    codes = launch_locally(nproc, rank_argv, ACK_WAIT_S + TERM_GRACE_S, {VERDICT_ENV: verdict_file})
    verdict = None
    if os.path.exists(verdict_file):
        with open(verdict_file) as f:
            verdict = int(f.read().strip() or Exit.INTERNAL)
        os.unlink(verdict_file)
    if verdict is None:
        ended = ", ".join(f"rank {r}: {_ended(c)}" for r, c in enumerate(codes))
        print(f"ddparity: watch: no rank reported a verdict ({ended})", file=sys.stderr)
        return Exit.HANG_OR_CRASH if any(codes) else Exit.OK
    if verdict != 0:
        return verdict
    return next((c for c in codes if c), 0)


def _ended(code: int) -> str:
    import signal

    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def watch_command(script: str, args: list[str], nproc: int | None, timeout: float, json_path: str | None,
                  emit: Callable[[Report], None], writable: Callable[[str | None], None], module: bool = False,
                  flight_recorder: str | None = None, quiet: bool = False) -> int:
    """``ddparity watch``: this process is one rank of a launch (under torchrun), or starts
    ``nproc`` ranks here. ``writable`` raises a usage error for a JSON path that cannot be
    written (before any work)."""
    from ddparity.errors import WorldStartError
    from ddparity.harness.launch import torchrun

    validate_script(script, module)
    if json_path == "-":
        raise UsageError("--json - would mix the JSON with your script's own output: give a file path")
    if not torchrun.launched():
        if nproc is None:
            raise UsageError("say how many ranks: ddparity watch --nproc-per-node N SCRIPT (or run it under "
                             "torchrun: torchrun --nproc-per-node N -m ddparity watch SCRIPT)")
        writable(json_path)
        flags = ["--timeout", f"{timeout:g}"] + (["--json", os.path.abspath(json_path)] if json_path else [])
        flags += ["--flight-recorder", os.path.abspath(flight_recorder)] if flight_recorder else []
        flags += ["-q"] if quiet else []
        return watch_locally(nproc, [*flags, *(["-m"] if module else []), "--", script, *args])
    if nproc is not None:
        raise UsageError("--nproc-per-node is torchrun's to decide here (torchrun --nproc-per-node N ...)")
    if os.environ.get("RANK") == "0":
        writable(json_path)
    try:
        return watch_launched(script, args, timeout, emit, module, flight_recorder)
    except WorldStartError as exc:
        print(f"ddparity: {exc}", file=sys.stderr)
        return Exit.HANG_OR_CRASH


def validate_script(script: str, module: bool = False) -> str:
    """The script's file; a usage error naming the problem when there is none."""
    from ddparity.harness.launch.watched import script_file

    found = script_file(script, module)
    if found is None and module:
        raise UsageError(f"no module named {script!r} (python -m {script} would not find it either)")
    if found is None and not os.path.exists(script):
        raise UsageError(f"no such script: {script!r} (give the path of your training script, e.g. train.py)")
    if found is None:
        raise UsageError(f"{script!r} is not a file: give the path of your training script, e.g. train.py")
    return found
