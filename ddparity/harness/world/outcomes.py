"""How a task ends: each rank's :class:`RankOutcome`, or, when it did not end well, the
:class:`~ddparity.errors.WorldFailure` that says why, with its evidence (every live
rank's stack) gathered before the ranks are killed.

The :class:`~ddparity.harness.world.world.World` decides *when* a task has failed; this module
turns that moment into evidence and an exception. ``kill`` is the World's: it ends the
generation of rank processes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ddparity.errors import Interrupted, RankCrashed, StillRunning, TaskFailed, TaskStopped, TaskTimeout, signal_name
from ddparity.harness.world import spawn
from ddparity.harness.world.stacks import py_spy_stacks
from ddparity.records import RankRecords

STACK_DUMP_WAIT_S = 1.0
"""How long to wait for ranks to print their stacks (SIGUSR1) before they are killed."""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """What one rank made of one task."""

    rank: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    output: str = ""
    seconds: float = 0.0
    records: RankRecords | None = None  # what the rank left in the side channel


def dump_stacks(ranks: spawn.Ranks, which: list[int], native: bool = True) -> dict[int, str]:
    """Every thread's stack of each live rank in ``which``: py-spy where it can attach,
    else the rank's own faulthandler dump on SIGUSR1. Native frames (where gloo or NCCL
    waits) for hangs; for the bystanders of a crash the Python stacks, which py-spy
    takes in milliseconds even from busy ranks (native unwinding of 7 busy ranks on
    2 cores took 1.4 s)."""
    pids = {r: p.pid for r in which if (p := ranks.procs[r]).is_alive() and p.pid}
    stacks = py_spy_stacks(pids, native=native)
    fallback = [r for r in which if not stacks.get(r)]
    if fallback:
        for rank in fallback:
            pid = pids.get(rank)
            if pid:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
        _await_quiet_output(ranks, fallback, STACK_DUMP_WAIT_S)
        for rank in fallback:
            text = ranks.readers[rank].take_all()
            stacks[rank] = f"(py-spy unavailable; faulthandler dump)\n{text}" if text.strip() else ""
    return stacks


def _await_quiet_output(ranks: spawn.Ranks, which: list[int], limit: float) -> None:
    """Until every rank printed something and then nothing more for 0.1 s (a
    faulthandler dump is written at once), or ``limit`` seconds."""
    deadline = time.monotonic() + limit
    sizes: list[int] = []
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = [ranks.readers[r].buffered for r in which]
        if all(now) and now == sizes:
            return
        sizes = now


def stopped(ranks: spawn.Ranks, kill: Callable[[], None], pending: list[int], task_id: int,
            reason: str) -> NoReturn:
    """A watcher stopped the task (ranks issued different collectives)."""
    stacks = dump_stacks(ranks, pending, native=False)
    kill()
    head = f"the run was stopped: {reason}; the world was rebuilt"
    raise TaskStopped(with_stacks(head, stacks), reason, pending, stacks)


def crashed(ranks: spawn.Ranks, kill: Callable[[], None], rank: int, task_id: int,
            outcomes: list[RankOutcome | None]) -> NoReturn:
    """Rank ``rank`` died: the others' stacks at that moment, its last output."""
    proc = ranks.procs[rank]
    proc.join(timeout=1)
    others = [r for r in range(len(outcomes)) if r != rank and outcomes[r] is None]
    stacks = dump_stacks(ranks, others, native=False)  # first: "at that moment"
    output = ranks.readers[rank].take_all(settle=1.0)
    kill()
    how = signal_name(proc.exitcode)
    lines = [f"rank {rank} died ({how}) during the run; the world will be rebuilt"]
    if output.strip():
        lines.append(f"--- rank {rank} output ---\n{output.rstrip()}")
    for r, text in stacks.items():
        if text.strip():
            lines.append(f"--- rank {r} at that moment ---\n{text.rstrip()}")
    raise RankCrashed("\n".join(lines), rank, proc.exitcode, output, stacks)


def stuck(ranks: spawn.Ranks, kill: Callable[[], None], pending: list[int], task_id: int,
          outcomes: list[RankOutcome | None], limit: float, timed_out: bool, error_grace: float,
          progress: list[str] | None = None) -> None:
    """Ranks still running at the deadline: a hang (``timed_out``, raises, naming the ranks
    behind in the collective sequence from each rank's ``progress`` record), or bystanders
    of a failed rank, whose outcomes become :class:`StillRunning` with their stacks."""
    stacks = dump_stacks(ranks, pending, native=timed_out)
    kill()
    if timed_out:
        head = f"rank(s) {pending} made no progress for {limit:g} s; the world was rebuilt"
        suspects, why = behind(progress or [], pending)
        if suspects:
            head += f"\nsuspect rank(s) {suspects}: {why}"
        raise TaskTimeout(with_stacks(head, stacks), pending, stacks, suspects, limit_s=limit)
    failed = [o.rank for o in outcomes if o is not None and not o.ok]
    for r in pending:
        outcomes[r] = RankOutcome(
            r,
            False,
            error=StillRunning(
                f"rank {r} was still running {error_grace:g} s after rank(s) "
                f"{failed} failed (most likely waiting for them in a collective)"
            ),
            output=stacks.get(r, ""),
        )


def behind(progress: list[str], pending: list[int]) -> tuple[list[int], str]:
    """The pending ranks that issued fewer collectives than another rank (it waits for them),
    and why, from each rank's progress record; none when all issued as many."""
    from ddparity.records import parse_progress

    issued = {}
    for rank, text in enumerate(progress):
        pos = parse_progress(text)
        issued[rank] = pos.seq + 1 if pos is not None else 0
    if not issued or len(set(issued.values())) < 2:
        return [], ""
    most = max(issued.values())
    ahead = sorted(r for r, n in issued.items() if n == most)
    suspects = sorted(r for r, n in issued.items() if n < most and r in pending)
    counts = ", ".join(f"rank {r}: {issued[r]}" for r in sorted(issued))
    return suspects, (f"behind in the collective sequence: rank(s) {ahead} issued collective #{most - 1} and wait "
                      f"for them (collectives issued, {counts})")


def died_after_task(ranks: spawn.Ranks) -> bool:
    """Whether a rank died after its last task finished (a crash in teardown, a background
    thread, the OOM killer): logged with how it died and its last output."""
    dead = [(r, p.exitcode) for r, p in enumerate(ranks.procs) if not p.is_alive()]
    if not dead:
        return False
    rank, code = dead[0]
    output = ranks.readers[rank].take_all(settle=0.5)
    logging.getLogger("ddparity").warning(
        "rank %d died after its last task finished (%s); the world is rebuilt.%s", rank, signal_name(code),
        f"\nIts last output:\n{output.rstrip()}" if output.strip() else "")
    return True


def interrupted(progress: list[str], kill: Callable[[], None]) -> Interrupted:
    """Ctrl-C while a task ran: each rank's place (from its progress record), the ranks
    stopped."""
    from ddparity.records import parse_progress

    kill()
    places = []
    for rank, text in enumerate(progress):
        pos = parse_progress(text)
        places.append(f"rank {rank}: {pos.describe() if pos is not None else 'had not started the task'}")
    return Interrupted(places=places)


def raise_if_failed(final: list[RankOutcome]) -> None:
    """:class:`TaskFailed` when the task raised on any rank."""
    bad = [o for o in final if not o.ok]
    if not bad:
        return
    head = bad[0]
    ranks = ", ".join(str(o.rank) for o in bad)
    text = f"task failed on rank(s) {ranks}: {type(head.error).__name__}: {head.error}"
    if head.traceback:
        text += f"\n--- rank {head.rank} traceback ---\n{head.traceback.rstrip()}"
    raise TaskFailed(text, final)


def with_stacks(head: str, stacks: dict[int, str]) -> str:
    return "\n".join([head] + [f"--- rank {r} stack ---\n{t.rstrip() or '(no stack printed)'}"
                                for r, t in stacks.items()])
