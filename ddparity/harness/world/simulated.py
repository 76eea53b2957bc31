"""A simulated world's failure, told in its simulated ranks' terms (controller side).

Simulated ranks are threads of one rank process (:mod:`ddparity.harness.ranks.threaded`):
when that process hangs or dies, the World reports its one rank; what each thread left in
the side channel (:class:`~ddparity.harness.sidechannel.SimulatedRecords`) says which
simulated rank was behind, which called ``os._exit`` or crashed, and where each was.
"""

from __future__ import annotations

import re

from ddparity.errors import RankCrashed, TaskTimeout, WorldFailure
from ddparity.harness.ranks.threaded import THREAD_PREFIX
from ddparity.harness.sidechannel import SimulatedRecords


def as_simulated(exc: WorldFailure) -> WorldFailure:
    """A simulated world's failure told in its simulated ranks' terms: the process that ran
    them hung or died as a whole, so the World names that process's rank; the threads'
    records (:class:`~ddparity.harness.recording.threads.ThreadRecorder`) say which simulated rank was behind (a hang), which
    called ``os._exit`` or was the thread faulthandler caught crashing, and where each was."""
    from ddparity.errors import signal_name
    from ddparity.records import parse_progress

    sim = exc.simulated
    if not isinstance(sim, SimulatedRecords):
        return exc
    host = "\n".join(exc.stacks.values()) if isinstance(exc, TaskTimeout) else exc.output if isinstance(
        exc, RankCrashed) else ""
    stacks = thread_stacks(host, sim.threads)
    done = {r for r, rec in sim.records.items() if (p := parse_progress(rec.progress)) is not None and p.phase == "done"}
    pending = [r for r in sorted(sim.records) if r not in done]
    out: WorldFailure = exc
    if isinstance(exc, TaskTimeout):
        limit = f"{exc.limit_s:g} s" if exc.limit_s is not None else "the timeout"
        out = TaskTimeout(f"simulated ranks {pending} made no progress for {limit} (threads of one process, which "
                          "was replaced)", pending, {r: stacks.get(r, "") for r in pending}, limit_s=exc.limit_s)
    elif isinstance(exc, RankCrashed):
        how = signal_name(exc.exitcode)
        current = re.search(r"Current thread (0x[0-9a-fA-F]+)", exc.output)
        by_thread = {int(t, 16): r for r, t in sim.threads.items() if t}
        culprit = next(iter(sim.exits), None)
        if culprit is None and current is not None:
            culprit = by_thread.get(int(current.group(1), 16))
        if culprit is None:
            head = (f"the process running the simulated ranks died ({how}); no thread of it said which simulated "
                    "rank it was running")
            rank = exc.rank
        else:
            what = f"called os._exit({sim.exits[culprit]})" if culprit in sim.exits else f"died ({how})"
            head = f"simulated rank {culprit} {what}: the process running every simulated rank ended; it was replaced"
            rank = culprit
        others = {r: stacks.get(r, "") for r in pending if r != rank}
        # faulthandler's dump of the crashing thread, else what the process printed last
        output = stacks.get(rank, "") if culprit is not None and stacks.get(rank) else exc.output
        out = RankCrashed(head + (f"\n--- its output ---\n{output.rstrip()}" if output.strip() else ""),
                          rank, exc.exitcode, output, others)
    return out.with_evidence(sim.records, sim)


_THREAD_HEAD = re.compile(rf'(?:Current thread|Thread) (0x[0-9a-fA-F]+|\d+)\b(?:.*"{THREAD_PREFIX}(\d+)")?')
"""The first line of a thread's stack: faulthandler's (``Thread 0x...``) or py-spy's
(``Thread <tid> (idle): "<name>"``)."""


def thread_stacks(text: str, threads: dict[int, str]) -> dict[int, str]:
    """A process's stack dump (py-spy's or faulthandler's) cut into its simulated ranks'
    threads, by thread name or faulthandler's thread id."""
    by_ident = {int(t, 16): r for r, t in threads.items() if t}
    out: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        head = _THREAD_HEAD.match(line)
        if head:
            rank = int(head.group(2)) if head.group(2) else by_ident.get(int(head.group(1), 16)) if head.group(
                1).startswith("0x") else None
            current = out.setdefault(rank, []) if rank is not None else None
        if current is not None:
            current.append(line)
    return {r: "\n".join(lines) for r, lines in out.items()}
