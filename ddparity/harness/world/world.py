"""``World``: N real rank processes, started once and reused for many tasks.

The controller's only door to the ranks. Ranks are forked from this (torch-importing)
process, or from a forkserver that preloaded torch where forking is unsafe (CUDA, or more
than one intra-op thread: libgomp hangs in a forked child); starting them is
:mod:`ddparity.harness.world.spawn`, a failed task's evidence :mod:`ddparity.harness.world.outcomes`,
the records they leave (in the world's private folder) :mod:`ddparity.harness.sidechannel`.
Ranks die with their controller (``PR_SET_PDEATHSIG``); every wait here has a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ddparity.errors import UsageError, WorldFailure
from ddparity.harness.deadlines import Ending, TaskClock
from ddparity.harness.protocol import OUTPUT_END_MARK, RankSpec, RunName, RunTask, Shutdown, TaskDone, dumps, run_name
from ddparity.harness.sidechannel import FileTaskChannel, SimulatedRecords, private_root
from ddparity.harness.world import outcomes, rendezvous, spawn
from ddparity.harness.world import progress as progress_observers
from ddparity.harness.world.outcomes import RankOutcome
from ddparity.records import RankRecords
from ddparity.settings import PG_TIMEOUT_MARGIN_S, WorldSpec

log = logging.getLogger("ddparity")

POLL_S = 0.1
"""How often the controller reads the ranks' progress while a task runs."""

FAILURE_QUIET_S = 0.25
"""After a rank failed, the others are stopped once quiet this long (``error_grace`` at most)."""

HARD_LIMIT_FACTOR = 10
"""A task that keeps making progress is still stopped after this many timeouts."""


class PendingTask:
    """A task submitted to a :class:`World`; ``result()`` waits for every rank."""

    def __init__(self, world: World, task_id: int, limit: float, channel: FileTaskChannel | None,
                 watch: Callable[[list[str]], str | None] | None) -> None:
        self._world = world
        self._task_id = task_id
        self._limit = limit
        self._channel = channel
        self._watch = watch
        self._submitted = time.monotonic()
        self._collected = False
        self._name = RunName("task")

    def result(self) -> list[RankOutcome]:
        """Every rank's outcome; raises as :meth:`World.execute` does."""
        if self._collected:
            raise UsageError("this task's result was already collected")
        self._collected = True
        try:
            return self._world._collect(self)
        finally:
            self._world._pending = None


class World:
    """A warm world of ``world_size`` rank processes with a process group.

    ``world.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank and returns the
    results by rank. A task that raises leaves the world usable (or rebuilds it if the
    other ranks got stuck waiting for the failed one); a rank that dies gets the world
    rebuilt before the next task.
    """

    _task_ids = itertools.count(1)

    def __init__(self, world_size: int, backend: str = "gloo", **options: Any) -> None:
        self.spec = WorldSpec(world_size=world_size, backend=backend, **options)
        self._backend: str | None = None
        self._side: str | None = None
        self._ranks = spawn.Ranks()
        self._generation = 0
        self._live = False
        self._closed = False
        self._pending: PendingTask | None = None
        self._finalizer = weakref.finalize(self, spawn.Ranks.kill, self._ranks)
        self.start_seconds: float | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def backend(self) -> str:
        if self._backend is None:
            self._backend = rendezvous.resolve_backend(self.spec.backend, self.spec.world_size)
        return self._backend

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._ranks.procs if p.pid is not None]

    @property
    def busy(self) -> bool:
        """A task was submitted and its result not yet collected."""
        return self._pending is not None

    def interrupt(self) -> tuple[str, list[str]]:
        """Ctrl-C elsewhere while this world runs a task: the run, where each of its ranks
        was; the ranks stopped (the world rebuilt before its next task). ``("", [])``: none."""
        task, self._pending = self._pending, None
        if task is None:
            return "", []
        places = outcomes.interrupted(self._progress(task) or [], self._kill).places
        return task._name.shown(self.spec.world_size, self.backend), places

    @property
    def generation(self) -> int:
        return self._generation

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> World:
        """Start the ranks if they are not running (idempotent)."""
        if self._closed:
            raise UsageError("this World was closed; create a new one")
        if not self._live:
            self._launch()
        return self

    def restart(self) -> None:
        """Kill the ranks and start a fresh generation (a new rendezvous file)."""
        self._pending = None
        self._ranks.kill()
        self._live = False
        self._launch()

    def close(self) -> None:
        """Stop every rank (politely, then by SIGKILL) and remove the world's private folder."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        for conn in self._ranks.controls:
            try:
                conn.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._ranks.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._ranks.kill()
        self._live = False
        if self._side is not None:
            shutil.rmtree(self._side, ignore_errors=True)
            self._side = None

    def _side_dir(self) -> str:
        if self._side is None:
            self._side = tempfile.mkdtemp(prefix="world-", dir=private_root())
        return self._side

    def _rendezvous(self) -> str:
        """This generation's rendezvous: a FileStore in the world's private folder."""
        return os.path.join(self._side_dir(), f"rendezvous-gen{self._generation}")

    @property
    def _store_prefix(self) -> str:
        return f"ddparity/gen{self._generation}"

    def _device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.backend == "nccl" else "cpu"

    def _start_ranks(self, method: str, join_timeout: float) -> None:
        previous = self._rendezvous()
        self._generation += 1
        with contextlib.suppress(OSError):
            os.unlink(previous)  # that generation's ranks are gone
        n = self.spec.world_size
        ifname = rendezvous.loopback_ifname()
        specs = [
            RankSpec(
                rank=rank, world_size=n, backend=self.backend, device=self._device(rank),
                rendezvous=self._rendezvous(), store_prefix=self._store_prefix,
                pg_timeout_s=self.spec.timeout + PG_TIMEOUT_MARGIN_S, threads=self.spec.threads_per_rank,
                loopback_ifname=ifname, controller_pid=os.getpid(), side_dir=self._side_dir(),
                env=self.spec.env,
            )
            for rank in range(n)
        ]
        spawn.start_ranks(self._ranks, specs, method)
        spawn.await_ready(self._ranks, join_timeout, f"a {self.spec.backend} world of {n}",
                           retry_possible=method == "fork")

    def _launch(self) -> None:
        started = time.perf_counter()
        spawn.preload()
        method = spawn.start_method(self.backend, self.spec.threads_per_rank, self.spec.clean_start)
        if method == "fork":
            try:
                self._start_ranks("fork", min(self.spec.start_timeout, spawn.FORK_JOIN_S))
            except spawn.JoinTimeout as stuck:
                # A forked child can inherit a lock a controller thread held at fork (seen
                # before the FileStore rendezvous: torch's TCPStore client stuck in a reverse
                # DNS lookup). Start this generation again from the forkserver rather than wait.
                stacks = outcomes.dump_stacks(self._ranks, stuck.ranks)
                text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in stacks.items())
                log.warning(
                    "forked ranks %s of a %d-rank world did not join within %g s; starting them "
                    "from the forkserver instead. Their stacks:\n%s", stuck.ranks, self.spec.world_size,
                    spawn.FORK_JOIN_S, text)
                self._ranks.kill()
                self._start_ranks("forkserver", self.spec.start_timeout)
        else:
            self._start_ranks(method, self.spec.start_timeout)
        self._live = True
        self.start_seconds = time.perf_counter() - started

    # -- tasks -----------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(ctx, *args, **kwargs)`` on every rank; return the values by rank."""
        return [o.value for o in self.execute(fn, *args, timeout=timeout, **kwargs)]

    def execute(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[RankOutcome]:
        """Like :meth:`run`, returning each rank's :class:`RankOutcome` (value and output).

        Raises :class:`TaskFailed` if the task raised on any rank, :class:`TaskTimeout`
        if ranks did not answer in time, :class:`RankCrashed` if a rank process died.
        """
        return self.submit(fn, *args, timeout=timeout, **kwargs).result()

    def submit(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
               watch: Callable[[list[str]], str | None] | None = None, shown_as: RunName | None = None,
               **kwargs: Any) -> PendingTask:
        """Start ``fn(ctx, *args, **kwargs)`` on every rank and return at once.

        The world runs one task at a time; other worlds can run theirs meanwhile.
        ``timeout``: the task is declared hung when no rank has made progress (a step,
        a phase, a collective, a finished rank) for that long; a task that keeps
        progressing is stopped after ``HARD_LIMIT_FACTOR`` timeouts. ``watch`` is called
        with the ranks' progress records while the task runs; a string it returns stops
        the task (:class:`TaskStopped`). ``shown_as``: how the run is shown while it runs,
        where not as the task declares (:func:`~ddparity.harness.protocol.names_run`).
        ``PendingTask.result()`` collects the outcomes.
        """
        if self._pending is not None:
            raise UsageError("this World is already running a task; call result() on it before submitting another")
        self.start()
        self._replace_dead_ranks()
        try:
            payload = dumps((fn, args, kwargs))
        except Exception as exc:
            raise UsageError(
                f"the task {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be "
                f"pickled ({type(exc).__name__}: {exc}); pass plain data, functions or classes"
            ) from None
        task_id = next(self._task_ids)
        limit = self.spec.timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise UsageError(f"timeout must be positive, got {timeout!r}")
        ranks = self._ranks
        channel = FileTaskChannel(self._side_dir(), self._store_prefix, task_id, self.spec.world_size)
        channel.prepare()
        msg = RunTask(task_id, payload, tuple(sys.path), limit + PG_TIMEOUT_MARGIN_S)
        for conn in ranks.controls:
            with contextlib.suppress(OSError):  # the rank died; its sentinel reports it below
                conn.send(msg)
        self._pending = PendingTask(self, task_id, limit, channel, watch)
        self._pending._name = shown_as or run_name(fn)
        return self._pending

    def _collect(self, task: PendingTask) -> list[RankOutcome]:
        try:
            done = self._wait_for(task)
        except WorldFailure as exc:
            exc.with_evidence(*self._records(task))
            raise
        except KeyboardInterrupt:  # Ctrl-C: where every rank was, then they are stopped
            raise outcomes.interrupted(self._progress(task) or [], self._kill) from None
        records, _ = self._records(task)
        return [dataclasses.replace(o, records=records.get(o.rank)) for o in done]

    def _records(self, task: PendingTask) -> tuple[dict[int, RankRecords], SimulatedRecords | None]:
        if task._channel is None:  # read (then drop) what the ranks (and simulated ranks) left
            return {}, None
        try:
            records, simulated = task._channel.read(), task._channel.read_simulated()
            task._channel.clear()
        except Exception:  # the folder is gone (world closed meanwhile): nothing to read
            return {}, None
        finally:
            task._channel = None  # holds the store; a failed task's traceback may live on
        return records, simulated

    def _wait_for(self, task: PendingTask) -> list[RankOutcome]:
        ranks = self._ranks
        n = self.spec.world_size
        task_id, limit = task._task_id, task._limit
        results: list[RankOutcome | None] = [None] * n
        pending = set(range(n))
        clock = TaskClock(time.monotonic(), limit, self.spec.error_grace, quiet_s=FAILURE_QUIET_S,
                          hard_deadline=task._submitted + HARD_LIMIT_FACTOR * limit)
        seen: list[str] | None = None
        stop_reason: str | None = None
        ending: Ending | None = None
        died = -1
        next_poll = time.monotonic() + POLL_S  # most tasks are done before the first poll
        while pending and ending is None:
            now = time.monotonic()
            progress = None
            if now >= next_poll:
                progress, next_poll = self._progress(task), now + POLL_S
            if progress is not None and progress != seen:
                seen = progress
                clock.progressed(now)
                if task._watch is not None and clock.first_failure is None:
                    stop_reason = task._watch(progress)
            ending = clock.decide(now, stopped=bool(stop_reason))
            if ending is not None:
                break
            if progress is not None and progress_observers.OBSERVERS:
                progress_observers.notify(progress_observers.Snapshot(
                    task._name, n, self.backend, progress, now - clock.last_progress, limit))
            watched: dict[Any, int] = {ranks.controls[r]: r for r in pending}
            watched.update({ranks.procs[r].sentinel: r for r in pending})
            for obj in wait(list(watched), timeout=min(POLL_S, clock.due() - now)):
                rank = watched[obj]
                if rank not in pending:
                    continue
                # A message can still be queued behind a rank's death: read it first.
                for done in spawn.queued(ranks.controls[rank]):
                    if isinstance(done, TaskDone) and done.task_id == task_id and rank in pending:
                        results[rank] = self._decode(done)
                        pending.discard(rank)
                        clock.progressed(time.monotonic())
                        if not done.ok:
                            clock.raised(time.monotonic())
                if rank in pending and not isinstance(obj, Connection):
                    ending, died = clock.decide(now, dead=True), rank
                    break
        if ending is Ending.CRASHED:
            outcomes.crashed(ranks, self._kill, died, task_id, results)
        if ending is Ending.STOPPED:
            outcomes.stopped(ranks, self._kill, sorted(pending), task_id, stop_reason or "")
        if pending:
            outcomes.stuck(ranks, self._kill, sorted(pending), task_id, results, limit,
                           timed_out=ending is Ending.TIMED_OUT, error_grace=self.spec.error_grace,
                           progress=self._progress(task) if ending is Ending.TIMED_OUT else None)
        final = [o for o in results if o is not None]
        outcomes.raise_if_failed(final)
        return final

    def _progress(self, task: PendingTask) -> list[str] | None:
        if task._channel is None:
            return None
        try:
            return task._channel.progress()
        except Exception:
            return None

    def _decode(self, done: TaskDone) -> RankOutcome:
        import cloudpickle

        output = self._ranks.readers[done.rank].take_until(OUTPUT_END_MARK % done.task_id, 5.0)
        value = cloudpickle.loads(done.payload)
        if done.ok:
            return RankOutcome(done.rank, True, value, None, "", output, done.seconds)
        return RankOutcome(done.rank, False, None, value, done.traceback, output, done.seconds)

    def _kill(self) -> None:
        self._ranks.kill()
        self._live = False

    def _replace_dead_ranks(self) -> None:
        """A rank that died after its last task finished is reported and the world rebuilt:
        every rank is judged, not only rank 0, and never handed a task it cannot run."""
        if outcomes.died_after_task(self._ranks):
            self.restart()

