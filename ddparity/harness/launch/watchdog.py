"""Hangs, crashes and collective mismatches inside a torchrun (or Slurm) launch.

In a local World the controller watches its ranks from outside. In a launch there is no
outside: the launched processes are the world, possibly on many machines. So every
process runs a :class:`LaunchWatch` thread, and they talk through the launch's own store
(the TCPStore that ``init_process_group`` joined: it answers while the process group is
wedged, and under torchrun it lives in the agent, so it outlives a dead rank):

* ``B<r>`` — every process beats every :data:`BEAT_S`; a rank whose beat stops for
  :data:`DEAD_S` died (or is frozen);
* the side channel of :mod:`ddparity.harness.sidechannel` (progress, ledger, fingerprints;
  the same recorder as local ranks) — no progress for ``timeout`` is a hang; ranks that
  issued different collectives are a desync, judged live by
  :class:`~ddparity.checks.collectives.LiveWatch`;
* ``X<r>`` — a rank whose task raised says what and where;
* ``D``/``S<r>``/``F<r>`` — a stack request and each rank's answer (its stacks; in a hang
  native ones and its Flight Recorder's state: :mod:`ddparity.harness.launch.evidence`);
* ``V`` — the verdict's exit code; every process exits with it;
* ``N`` — counted up with each verdict or stack request: the one key a rank reads a beat.

The *reporter* is the lowest rank still beating (rank 0 unless it died). It alone judges;
when it finds a failure it asks every rank for its stack, builds the same
:class:`~ddparity.errors.WorldFailure` a World would raise, hands it to the verb's
``report`` (which prints the report and writes the JSON) and publishes the exit code.
A rank stuck in NCCL or gloo is ended by its own watch thread (``os._exit``): the launch
ends in seconds, not at the process group's 30-minute timeout.

torchrun stops the other workers (SIGTERM) as soon as one exits; a watched process takes
SIGTERM as news, not as an order, for up to :data:`TERM_GRACE_S` (torchrun waits 30 s
before SIGKILL), so the dead rank is still found and reported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ddparity import errors
from ddparity.errors import Exit, RankCrashed, StillRunning, TaskFailed, TaskStopped, TaskTimeout, WorldFailure
from ddparity.frames import own_stacks
from ddparity.harness import store_keys
from ddparity.harness.deadlines import Ending, TaskClock
from ddparity.harness.launch import evidence
from ddparity.harness.sidechannel import TaskChannel, TaskEnd
from ddparity.harness.world.outcomes import RankOutcome, with_stacks
from ddparity.records import RankRecords

BEAT_S = 0.5
DEAD_S = 5.0
"""A rank whose beat has not moved for this long is gone (its watch thread beats even while
its main thread waits in a collective)."""
ERROR_GRACE_S = 2.0
"""After a rank raised, how long others may still report their own errors."""
TERM_GRACE_S = 20.0
ACK_WAIT_S = 10.0
"""How long the reporter waits for every live rank to read the verdict before it exits
(under ``srun`` the store lives in rank 0: it must outlast their reading)."""


class LaunchWatch:
    """This process's watch thread (see the module docstring). ``report(exc, stage)``
    renders a failure and returns the exit code; ``stage`` is the task the ranks were in
    (1: rank 0 builds and trains the reference; 2 and up: every rank trains, one stage a
    mode). ``live`` judges the ranks' progress records while every rank trains (a reason
    to stop, or None)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float,
                 report: Callable[[WorldFailure, int], int], live: Callable[[list[str]], str | None]) -> None:
        self.store, self.rank, self.n, self.timeout, self._report = store, rank, world_size, timeout, report
        self.stage = 1
        self._last_dead: list[int] = []
        self._finishing = False
        self._progress = [""] * world_size
        self.on_exit: list[Callable[[], None]] = []
        """Run before the process exits (the spools' removal: ``os._exit`` skips finalizers)."""
        self._claim = threading.Lock()
        self._claimed = False
        self._stopped = threading.Event()
        self._news = 0
        self.main_exits = False
        """A passing verdict is the main thread's (:meth:`await_verdict`): a watched script ends as it would."""
        self._beats: dict[int, tuple[str, float]] = {}
        self._seen: list[str] | None = None
        self._clock = TaskClock(time.monotonic(), timeout, ERROR_GRACE_S)
        self._term_at: float | None = None
        self._answered = 0
        self._live = live
        self._where = [store_keys.decode_where(v) for v in store.multi_get([store_keys.where(r) for r in range(world_size)])]
        self._wake = self._catch_sigterm()
        self._thread = threading.Thread(target=self._loop, name="ddparity-watch", daemon=True)
        self._thread.start()

    # -- what the verb calls ---------------------------------------------------------

    def claim(self) -> bool:
        """The right to end the launch (once: the verb's report or the watch's)."""
        with self._claim:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def fail(self, exc: BaseException) -> NoReturn:
        """This rank's task raised: tell the reporter, then wait for the verdict."""
        import cloudpickle

        from ddparity.harness.ranks.rank import encode_exception

        text = "".join(traceback.format_exception(exc))
        if errors.peer_gone(exc):  # a peer aborted or is gone: read where every rank was while the store still answers
            try:  # (its node's agent may take the store down next: the report comes from what was seen)
                seen = TaskChannel(self.store, "", self.stage, self.n).progress()
                self._progress = [seen[r] if r in self._participants() else "" for r in range(self.n)]
            except Exception:
                pass
        self.store.set(store_keys.raised(self.rank), cloudpickle.dumps((cloudpickle.loads(encode_exception(exc)), text)))
        self.store.add(store_keys.FAILURES, 1)
        self.idle()

    def finish(self, code: int) -> NoReturn:
        """Publish the verdict, give the others a moment to read it, exit with it."""
        self._finishing = True
        self.store.set(store_keys.VERDICT, store_keys.encode_verdict(code))
        self.store.add(store_keys.NEWS, 1)
        self._exit(code, wait_for_others=True)

    def await_verdict(self) -> int:
        """The main thread: wait for the verdict and return it when it passes (a failing one
        ends the process from the watch thread meanwhile)."""
        self.main_exits = True
        while not self.store.check([store_keys.VERDICT]):
            time.sleep(0.05)
        code = store_keys.decode_verdict(self.store.get(store_keys.VERDICT))
        if code != 0:
            self.idle()
        self.store.add(store_keys.ACKED, 1)
        self._stop()
        return code

    def publish_verdict(self, code: int) -> None:
        """The reporter: publish a passing verdict and wait (briefly) until every rank read it."""
        self._finishing = True
        self.store.set(store_keys.VERDICT, store_keys.encode_verdict(code))
        self.store.add(store_keys.NEWS, 1)
        self._wait_for_acks()
        self._stop()

    def _stop(self) -> None:
        """End the watch thread first: one inside the store's C++ at exit aborts the process."""
        self._stopped.set()
        self._thread.join(timeout=4 * BEAT_S)

    def idle(self) -> NoReturn:
        """Nothing left to do here but wait for the verdict (the watch thread exits)."""
        while True:
            time.sleep(3600)

    # -- the thread ------------------------------------------------------------------

    def _catch_sigterm(self) -> int | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.signal(signal.SIGTERM, lambda *_: None)  # news, read by the watch thread below
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        return read

    def _loop(self) -> None:
        try:
            while not self._stopped.wait(BEAT_S):
                self.store.add(store_keys.beat(self.rank), 1)
                if self._finishing:
                    continue  # this process publishes the verdict and waits for the others to read it
                news = int(self.store.add(store_keys.NEWS, 0))
                if news != self._news and self.store.check([store_keys.VERDICT]):
                    code = store_keys.decode_verdict(self.store.get(store_keys.VERDICT))
                    if code == 0 and self.main_exits:
                        return  # the main thread reads it and ends the process as the script would
                    self.store.add(store_keys.ACKED, 1)
                    self._exit(code)
                self._signals()
                if news != self._news:
                    self._news = news
                    self._answered = evidence.answer(self.store, self.rank, self._answered)
                below = self._below_on_node()
                dead_below = self._dead(below)
                if dead_below != below:
                    continue  # a lower rank on this node is alive: it watches
                ranks = self._participants()
                seen = TaskChannel(self.store, "", self.stage, self.n).progress()
                self._progress = [seen[r] if r in ranks else "" for r in range(self.n)]
                dead = self._last_dead = sorted(dead_below + self._dead([r for r in range(self.n) if r not in below]))
                if min(r for r in range(self.n) if r not in dead or r == self.rank) == self.rank:
                    self._judge(dead)  # the lowest rank still beating is the reporter
        except Exception as exc:  # the store is gone: the node that held it is
            if self._claimed:
                return
            self._lost_store(exc)

    def _lost_store(self, exc: BaseException) -> NoReturn:
        """The store's node is gone (under torchrun its agent exits once its own workers
        died). The lowest rank still running on each node reports what it last saw: a
        collective mismatch if the ranks' last positions show one, else the loss itself."""
        lost = (f"lost the launch's store ({type(exc).__name__}: {exc}): the process that held it (torchrun's "
                f"agent on another node, or rank 0) is gone")
        mine = self._where[self.rank][0]
        here = [r for r in range(self.n) if self._where[r][0] == mine and self._running_here(r)]  # no store now
        if self.rank != min(here, default=self.rank) or not self.claim():
            sys.stderr.write(f"ddparity: rank {self.rank}: {lost}. This rank's stacks:\n{own_stacks()}\n")
            self._exit(Exit.HANG_OR_CRASH)
        ranks = self._participants()
        reason = self._live(self._progress) if self.stage >= 2 else None
        elsewhere = [r for r in ranks if self._where[r][0] != mine] or [r for r in ranks if r != self.rank] or [0]
        failure: WorldFailure = (TaskStopped(f"the run was stopped: {reason}", reason, ranks) if reason else
                                 RankCrashed(f"rank {elsewhere[0]}'s node is gone or unreachable: {lost} "
                                             f"(rank {self.rank}'s own view)", elsewhere[0], None))
        failure.with_evidence(records={r: RankRecords(self._progress[r]) for r in ranks},
                              stacks={self.rank: own_stacks()})
        self._exit(self._reported(failure))

    def _reported(self, failure: WorldFailure) -> int:
        """The verb's report of ``failure`` (printed, the JSON written): its exit code, or
        4 where the report itself failed (its traceback printed)."""
        try:
            return self._report(failure, self.stage)
        except BaseException:
            traceback.print_exc()
            return Exit.INTERNAL

    def _signals(self) -> None:
        if self._wake is None:
            return
        try:
            got = os.read(self._wake, 64)
        except BlockingIOError:
            got = b""
        if signal.SIGTERM in got and self._term_at is None:
            self._term_at = time.monotonic()
            self.store.set(store_keys.terminated(self.rank), "1")
        if self._term_at is not None and time.monotonic() - self._term_at > TERM_GRACE_S:
            sys.stderr.write(f"ddparity: rank {self.rank}: stopped by the launcher (SIGTERM) and no verdict came in "
                             f"{TERM_GRACE_S:g} s; this rank's stacks:\n{own_stacks()}\n")
            self._exit(Exit.HANG_OR_CRASH)

    def _dead(self, among: list[int] | None = None) -> list[int]:
        """Ranks (of ``among``, default all) whose process is gone from this node, or whose
        beat stopped for :data:`DEAD_S`."""
        now = time.monotonic()
        among = list(range(self.n)) if among is None else among
        values = [v.decode() for v in self.store.multi_get([store_keys.beat(r) for r in among])] if among else []
        dead = []
        for r, value in zip(among, values):
            last = self._beats.get(r)
            if last is None or last[0] != value:
                self._beats[r] = (value, now)
            if (last is not None and last[0] == value and now - last[1] > DEAD_S) or not self._running_here(r):
                dead.append(r)
        return dead

    def _below_on_node(self) -> list[int]:
        """The ranks below this one on its node: when all are dead this one watches the
        launch (the others of a node leave it to their lowest: store reads grow with nodes,
        not ranks)."""
        mine = self._where[self.rank][0]
        return [r for r in range(self.rank) if self._where[r][0] == mine]

    def gone(self, rank: int) -> bool:
        """``rank`` ran on this node and its process is gone."""
        return not self._running_here(rank)

    def _running_here(self, rank: int) -> bool:
        """False when ``rank`` ran on this node and its process is gone (at once, not after a stalled beat)."""
        import psutil

        node, pid = self._where[rank]
        if node != self._where[self.rank][0] or rank == self.rank:
            return True
        try:
            return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _death(self, rank: int) -> str:
        node, pid = self._where[rank]
        if not self._running_here(rank):
            return f"rank {rank} (pid {pid} on {node}) died; torchrun's summary says how it ended"
        return (f"rank {rank} (pid {pid} on {node}) stopped beating for {DEAD_S:g} s: it died, or its node is "
                f"frozen or unreachable")

    def _participants(self) -> list[int]:
        return [0] if self.stage == 1 else list(range(self.n))

    def _judge(self, dead: list[int]) -> None:
        if self._claimed:
            return
        now = time.monotonic()
        ranks = self._participants()
        channel: TaskEnd = TaskChannel(self.store, "", self.stage, self.n)
        progress = self._progress
        failure: WorldFailure | None = None
        if progress != self._seen:
            self._seen = progress
            self._clock.progressed(now)
            if self.stage >= 2:
                reason = self._live(progress)
                if reason:
                    failure = TaskStopped(f"the run was stopped: {reason}", reason, self._pending(ranks))
        raised = self._raised() if int(self.store.add(store_keys.FAILURES, 0)) else {}
        if raised:
            self._clock.raised(now)
        # a peer's death reaches the others as their own errors first: give it time to show
        grace = DEAD_S + 1 if raised and all(errors.peer_gone(e) for e, _ in raised.values()) else ERROR_GRACE_S
        dead = [r for r in dead if r not in raised]
        ending = self._clock.decide(now, stopped=failure is not None, dead=bool(dead), grace=grace)
        if ending is Ending.CRASHED:
            failure = RankCrashed(self._death(dead[0]), dead[0], None)
        elif ending is Ending.FAILED:
            failure = self._task_failed(raised, ranks)
        elif ending is Ending.TIMED_OUT:
            pending = self._pending(ranks)
            failure = TaskTimeout(f"ranks {pending} made no progress for {self.timeout:g} s", pending,
                                  limit_s=self.timeout)
        elif ending is None and self._term_at is not None and now - self._term_at > DEAD_S + 1:
            failure = TaskStopped("the launcher stopped every rank (SIGTERM) before the check ended",
                                  "stopped by the launcher", ranks)
        if failure is not None and self.claim():
            self._conclude(failure, channel, ranks, dead)

    def _pending(self, ranks: list[int]) -> list[int]:
        """The ranks that have not published their result of this stage."""
        return [r for r in ranks if not self.store.check([store_keys.result(self.stage, r)])]

    def _raised(self) -> dict[int, tuple[BaseException, str]]:
        import cloudpickle

        return {r: cloudpickle.loads(self.store.get(store_keys.raised(r))) for r in range(self.n)
                if self.store.check([store_keys.raised(r)])}

    def _task_failed(self, raised: dict[int, tuple[BaseException, str]], ranks: list[int]) -> TaskFailed:
        outcomes = [RankOutcome(r, False, error=e, traceback=tb) for r, (e, tb) in sorted(raised.items())]
        outcomes += [RankOutcome(r, False, error=StillRunning(f"rank {r} was still running {ERROR_GRACE_S:g} s "
                                                              f"after rank(s) {sorted(raised)} failed (most likely "
                                                              f"waiting for them in a collective)"))
                     for r in ranks if r not in raised and not self.store.check([store_keys.result(self.stage, r)])]
        head = outcomes[0]
        return TaskFailed(f"task failed on rank(s) {', '.join(map(str, sorted(raised)))}: "
                          f"{type(head.error).__name__}: {head.error}\n--- rank {head.rank} traceback ---\n{head.traceback.rstrip()}", outcomes)

    def _conclude(self, failure: WorldFailure, channel: TaskEnd, ranks: list[int], dead: list[int]) -> None:
        hang = isinstance(failure, TaskTimeout)
        self._answered, stacks, flight = evidence.gather(
            self.store, self.rank, self._answered, [r for r in range(self.n) if r not in dead], hang)
        failure.with_evidence(stacks={r: stacks.get(r, "") for r in ranks if r not in dead}, flight=flight)
        if isinstance(failure, TaskFailed):  # the bystanders' stacks, where a World keeps them
            failure.outcomes = [o if not isinstance(o.error, StillRunning) else
                                RankOutcome(o.rank, False, error=o.error, output=stacks.get(o.rank, ""))
                                for o in failure.outcomes]
        if isinstance(failure, TaskTimeout):
            failure.args = (with_stacks(str(failure), failure.stacks),)
        records = channel.read()
        failure.with_evidence(records={r: records[r] for r in ranks})
        self.finish(self._reported(failure))

    def _exit(self, code: int, wait_for_others: bool = False) -> NoReturn:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            for cleanup in self.on_exit:
                cleanup()
        finally:
            if wait_for_others:  # rank 0 may hold the store (a launch without torchrun's agent)
                self._wait_for_acks()
            os._exit(code)

    def _wait_for_acks(self) -> None:
        others = self.n - 1 - len([r for r in self._last_dead if r != self.rank])
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline:
            try:
                if int(self.store.add(store_keys.ACKED, 0)) >= others:
                    break
            except Exception:
                break
            time.sleep(0.05)
