"""Simulated world sizes: DDP (or FSDP2) ranks as threads in one process (``--backend threaded``).

The ranks run on PyTorch's threaded process group, a private API
(``torch.testing._internal.distributed.multi_threaded_pg``, used by PyTorch's own
``MultiThreadedTestCase``); this module is its only door, checks that it is there and
says clearly when it is not. Every rank builds its own DDP replica from the shared
initial state and draws its data from its own generator; the full DDP code path runs
(buckets, the reducer, comm hooks). The threads run inside a 1-rank World process, so a
hung thread is handled like a hung rank: its stack is taken and the process replaced
(:mod:`ddparity.harness.world.simulated` tells that failure in simulated ranks' terms);
each thread records with its own recorder (:mod:`ddparity.harness.recording.threads`).

What simulation cannot show: anything about transports (gloo, NCCL), and randomness in
forward — threads share torch's global CPU RNG. Runs are labelled ``simulated``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ddparity.case import Case
from ddparity.errors import SimulatedRankError, UsageError
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.recording.threads import ThreadRecorder
from ddparity.harness.sidechannel import FileRankChannel
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
    from ddparity.harness.ranks.training import build_model
    from ddparity.harness.recording import recorder

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
        from ddparity.harness.recording import recorder

        mine = recorder.active()
        if isinstance(mine, ThreadRecorder):
            mine.note_exit(code)
        return real_exit(code)

    return noted_exit
