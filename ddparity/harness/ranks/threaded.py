"""Simulated world sizes: DDP (or FSDP2) ranks as threads in one process (``--backend threaded``).

The ranks run on PyTorch's threaded process group, a private API
(``torch.testing._internal.distributed.multi_threaded_pg``, used by PyTorch's own
``MultiThreadedTestCase``); this module is its only door, checks that it is there and
says clearly when it is not. Every rank builds its own DDP replica from the shared
initial state and draws its data from its own generator; the full DDP code path runs
(buckets, the reducer, comm hooks). The threads run inside a 1-rank World process, so a
hung thread is handled like a hung rank: its stack is taken and the process replaced.

What simulation cannot show: anything about transports (gloo, NCCL), and randomness in
forward — threads share torch's global CPU RNG. Runs are labelled ``simulated``.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ddparity.case import Case
from ddparity.errors import RankCrashed, SimulatedRankError, TaskTimeout, UsageError, WorldFailure
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.sidechannel import FileRankChannel, SimulatedRecords
from ddparity.records import RankRecords
from ddparity.settings import needs_newer_torch

PRIVATE_API = "torch.testing._internal.distributed.multi_threaded_pg"
THREAD_PREFIX = "ddparity-simulated-rank"


def threaded_pg() -> Any:
    """The threaded process group module, or a UsageError that names the fix."""
    import torch

    needs_newer_torch("--backend threaded (simulated ranks)", "use --backend gloo (real processes)")

    try:
        from torch.testing._internal.distributed import multi_threaded_pg as module
    except Exception as exc:  # ImportError, or an import-time failure of a private module
        raise UsageError(
            f"--backend threaded needs PyTorch's threaded process group ({PRIVATE_API}), which "
            f"this torch {torch.__version__} does not provide ({type(exc).__name__}: {exc}); "
            "use --backend gloo (real processes) instead"
        ) from None
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if not (hasattr(module, "_install_threaded_pg") and hasattr(module, "ProcessLocalGroup")) or isolation is None:
        raise UsageError(
            f"this torch {torch.__version__} has a threaded process group ddparity does not know "
            "(no _install_threaded_pg / _set_thread_isolation_mode); use --backend gloo instead"
        )
    return module


class ThreadRecorder:
    """The recorder of one simulated rank (a thread): what a real rank's
    :class:`~ddparity.harness.ranks.recorder.Recorder` records — phases, every collective (the
    patched ``torch.distributed`` calls and DDP's gradient buckets), fingerprints — kept
    per thread, since the simulated ranks share one process. Each record is also written
    at once to the host rank's side-channel folder (``channel``): a simulated world that
    hangs or dies as a whole still says where each of its ranks was."""

    enabled = True

    def __init__(self, rank: int, channel: Any) -> None:
        from collections import deque

        from ddparity.harness.ranks.recorder import RECENT

        self.rank = rank
        self.lines: list[str] = []
        self.prints: list[str] = []
        self.step, self.phase, self.events = -1, "", 0
        self.inflight: int | None = None
        self.recent: deque[str] = deque(maxlen=RECENT)
        self._seq: dict[str, int] = {}
        self._depth = 0
        self._via = ""
        self._channel = channel
        channel.set_thread(threading.get_ident())

    def note_exit(self, code: int) -> None:
        """This thread called ``os._exit``: the host process ends, the record says who."""
        self._channel.note_exit(code)

    def records(self) -> RankRecords:
        return RankRecords(self._progress(), "\n".join(self.lines), "\n".join(self.prints))

    def _progress(self) -> str:
        from ddparity.records import encode_progress

        return encode_progress(self.events, self.step, self.phase, self.inflight, self.recent)

    def _changed(self) -> None:
        self.events += 1
        self._channel.set_progress(self._progress())

    # what training calls (the Recorder's interface)

    def tick(self) -> None:
        pass  # a simulated rank's progress is its phases and collectives

    def pause(self) -> None:
        pass

    def set_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self._changed()

    @contextmanager
    def via(self, label: str) -> Iterator[None]:
        previous, self._via = self._via, label
        try:
            yield
        finally:
            self._via = previous

    @contextmanager
    def tally(self) -> Iterator[None]:
        yield None

    def fingerprints(self, step: int, values: dict[str, int]) -> None:
        from ddparity.records import encode_fingerprints

        # One process, one global RNG shared by every thread: its state is not a rank's own.
        line = encode_fingerprints(step, {k: v for k, v in values.items() if not k.startswith("rng ")})
        self.prints.append(line)
        self._channel.append_fingerprint(line)

    def ddp_buckets(self, layout: list[Any]) -> None:
        from ddparity.harness.ranks.calls import call_site

        site = call_site(2)
        for index, bucket in enumerate(layout):
            self._enter("all_reduce", {"tensor": bucket}, False, site, f"DDP gradient bucket {index}")

    # what the patched collectives call

    def call(self, op: str, binder: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from ddparity.harness.ranks.calls import call_site

        if self._depth:  # a collective's own inner one (all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        try:
            bound = binder.bind(args, kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # torch raises its own error for bad arguments
        blocking = not bound.get("async_op", False) and op not in ("isend", "irecv")
        self._enter(op, bound, blocking, call_site(3), self._via)
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            if self.inflight is not None:
                self.inflight = None
                self._changed()

    def _enter(self, op: str, args: dict[str, Any], blocking: bool, site: str, via: str) -> None:
        from ddparity.harness.ranks.calls import ledger_entry

        line, self.inflight = ledger_entry(self._seq, op, args, blocking, site, via, self.step, self.phase)
        self.lines.append(line)
        self.recent.append(line)
        self._channel.append_ledger(line)
        self._changed()


@names_run("simulated ranks", sized=True, simulated=True)  # shown as the run's mode (tasks.replica_run_name)
def threaded_task(ctx: RankContext, task: Callable[..., Any], case: Case, spool: str, world_size: int,
                  *task_args: Any) -> tuple[list[Any], dict[int, Any]]:
    """``task(ctx, case, spool, *task_args, settle=...)`` on ``world_size`` simulated ranks
    (threads on the threaded process group): their results and their records (progress,
    ledger, fingerprints), by rank. ``settle`` is called by each once its replica is built:
    no thread trains while another still builds its own."""
    import torch
    import torch.distributed as dist

    from ddparity.case import make_optimizer
    from ddparity.harness.ranks import recorder
    from ddparity.harness.ranks.training import build_model

    module = threaded_pg()
    # The model factory and the optimizer once here first: neither the imports a factory
    # does on first use (transformers' lazy modules) nor torch's first optimizer of a class
    # (it patches the class's step(): two threads doing it at once wrapped it twice, every
    # step hook ran twice, and a clean case "called optimizer.step() 2 times") are safe to
    # race from many threads.
    make_optimizer(case, build_model(case).parameters())
    host = recorder.active()
    channel = getattr(host, "channel", None) or FileRankChannel("", "", 0)
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode")  # noqa: B009 - private
    isolation(True)
    module._install_threaded_pg()
    module.ProcessLocalGroup.reset()  # a previous run's failure leaves its termination flag set
    store = dist.HashStore()
    runs: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []  # in the order they happened
    lock = threading.Lock()
    # No thread trains while another still builds its DDP replica: DDP's construction
    # (reducer, buckets) racing another thread's forward once took the process down
    # (SIGSEGV). A failing thread breaks the barrier, so nobody waits for it.
    built = threading.Barrier(world_size)
    recorders: list[ThreadRecorder | None] = [None] * world_size

    def rank_thread(rank: int) -> None:
        recorders[rank] = mine = ThreadRecorder(rank, channel.simulated(rank))
        recorder.set_thread_recorder(mine)
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                runs[rank] = task(RankContext(rank, world_size, "threaded", "cpu"), case, spool, *task_args,
                                  settle=built.wait)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:
            with lock:
                errors.append((rank, exc))
            built.abort()  # wake the ranks waiting to start training
            module.ProcessLocalGroup.exception_handle(exc)  # and those waiting in a collective

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"{THREAD_PREFIX}{r}", daemon=True)
               for r in range(world_size)]
    real_exit = os._exit
    os._exit = _noted_exit(real_exit)  # type: ignore[assignment] # a thread's exit takes the process: say whose
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # the World's timeout bounds this: a hung thread gets the process replaced
    finally:
        os._exit = real_exit
        module._uninstall_threaded_pg()
        isolation(False)
    if errors:
        causes = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)] or errors
        rank, exc = causes[0]  # the first to fail; the others were woken by it
        raise SimulatedRankError(rank, f"{type(exc).__name__}: {exc}") from exc
    return runs, {r: rec.records() for r, rec in enumerate(recorders) if rec is not None}


def _noted_exit(real_exit: Any) -> Any:
    def noted_exit(code: int) -> Any:
        from ddparity.harness.ranks import recorder

        mine = recorder.active()
        if isinstance(mine, ThreadRecorder):
            mine.note_exit(code)
        return real_exit(code)

    return noted_exit



def as_simulated(exc: WorldFailure) -> WorldFailure:
    """A simulated world's failure told in its simulated ranks' terms: the process that ran
    them hung or died as a whole, so the World names that process's rank; the threads'
    records (:class:`ThreadRecorder`) say which simulated rank was behind (a hang), which
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
    out.records, out.simulated = sim.records, sim
    return out


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
