"""Simulated world sizes: DDP ranks as threads in one process (``--backend threaded``).

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

import threading
from typing import Any

from ddparity.case import Case
from ddparity.errors import SimulatedRankError, UsageError
from ddparity.harness.protocol import RankContext

PRIVATE_API = "torch.testing._internal.distributed.multi_threaded_pg"


def threaded_pg() -> Any:
    """The threaded process group module, or a UsageError that names the fix."""
    import torch

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


class ThreadLedger:
    """The collectives one simulated rank (a thread) issues, in order, recorded as a real
    rank's are (:mod:`ddparity.records` lines): the simulated ranks share one process and one
    recorder, so each thread keeps its own (its collective sequence, its call sites)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seq: dict[str, int] = {}
        self._depth = 0

    def call(self, op: str, signature: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import time

        from ddparity.harness.recorder import P2P, call_site, describe, group_name
        from ddparity.records import encode_entry

        if not self._depth:  # not a collective's own inner one (all_gather_object -> all_gather)
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return fn(*args, **kwargs)  # torch raises its own error for bad arguments
            key, desc, _ = describe(op, bound)
            group = "p2p" if op in P2P else group_name(bound.get("group"))
            seq = self._seq[group] = self._seq.get(group, -1) + 1
            self.lines.append(encode_entry(group, seq, op, key, desc, call_site(3), "", -1, "", time.time(), False))
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1


def threaded_ddp_task(ctx: RankContext, case: Case, spool: str, world_size: int) -> list[Any]:
    """Mode ``ddp`` at ``world_size`` simulated ranks; their distances to the reference, by rank."""
    import torch
    import torch.distributed as dist

    from ddparity.harness.recorder import set_thread_ledger
    from ddparity.harness.tasks import ddp_task
    from ddparity.harness.training import build_model

    module = threaded_pg()
    # The model factory once here first: the imports it does on first use (transformers'
    # lazy modules) are not safe to race from many threads.
    build_model(case)
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

    ledgers = [ThreadLedger() for _ in range(world_size)]

    def rank_thread(rank: int) -> None:
        set_thread_ledger(ledgers[rank])
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                runs[rank] = ddp_task(RankContext(rank, world_size, "threaded", "cpu"), case, spool, detect=False,
                                      settle=built.wait)
                runs[rank].ledger = "\n".join(ledgers[rank].lines)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:
            with lock:
                errors.append((rank, exc))
            built.abort()  # wake the ranks waiting to start training
            module.ProcessLocalGroup.exception_handle(exc)  # and those waiting in a collective

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"ddparity-simulated-rank{r}", daemon=True)
               for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # the World's timeout bounds this: a hung thread gets the process replaced
    finally:
        module._uninstall_threaded_pg()
        isolation(False)
    if errors:
        causes = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)] or errors
        rank, exc = causes[0]  # the first to fail; the others were woken by it
        failed = SimulatedRankError(rank, f"{type(exc).__name__}: {exc}")
        failed.ledgers = {r: "\n".join(ledger.lines) for r, ledger in enumerate(ledgers)}
        raise failed from exc
    return runs
