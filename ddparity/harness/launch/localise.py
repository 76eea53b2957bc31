"""A launched check's first differing module: the re-run of a diverging run's first differing
step, module by module, by every process of the launch after rank 0 judged it.

Rank 0 holds the right to report by then (its watch no longer judges), so every wait here
is bounded by the check's own timeout, and a re-run that fails or does not finish in time is
a note of the report, never a finding:

1. rank 0 records the reference's step in a world of one process of its own beside the
   launch (:func:`~ddparity.harness.ranks.probes.reference_trace_task`; the launch's process
   group is formed by then, and a collective the user's step issues must be one rank's, as
   in the reference's own run) into its spool;
2. it asks (:func:`~ddparity.harness.store_keys.localise`) and every rank re-runs the step
   in the launch's process group, comparing its record with the reference's: in place on
   rank 0's node; a rank on another node first fetches the initial state and that record
   from rank 0 (:mod:`~ddparity.harness.launch.refserve`, a server per ask) into a spool of
   its own, removed after the re-run;
3. rank 0 takes every rank's answer from the store; the others wait for the next ask, or
   for ``null`` (then for the verdict).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ddparity.case import Case
from ddparity.errors import WorldFailure, WorldStartError
from ddparity.harness import store_keys
from ddparity.harness.launch.torchrun import Launch
from ddparity.harness.protocol import RankContext

OK, FAILED = "ok", "failed"


def _rerun(ctx: RankContext, case: Case, spool: str, ask: store_keys.LocaliseAsk) -> tuple[str, Any]:
    """This rank's part of ``ask``: (:data:`OK`, what the trace says) or (:data:`FAILED`, why)."""
    from ddparity.harness.ranks.probes import replica_trace_task

    try:
        return OK, replica_trace_task(ctx, case, spool, ask.mode, ask.shard_size, ask.step, ask.size, ask.inside)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return FAILED, f"rank {ctx.rank}: {type(exc).__name__}{': ' + first if first else ''}"


def answer_asks(launch: Launch, case: Case, spool: str, first_stage: int, served: bool = False) -> None:
    """Every rank but 0, once it published its last run: each ask rank 0 makes, re-run and
    answered, until it says there are no more (rank 0's death meanwhile is the watch's to
    report); ``served``: this rank cannot read ``spool`` (another node), it fetches what the
    re-run reads."""
    import cloudpickle

    store, index = launch.store, 0
    while True:
        while not store.check([store_keys.localise(index)]):
            time.sleep(0.05)
        ask = store_keys.LocaliseAsk.decode(store.get(store_keys.localise(index)))
        if ask is None:
            return
        answer = _served_rerun(launch, case, ask) if served else _rerun(launch.ctx, case, spool, ask)
        store.set(store_keys.result(first_stage + index, launch.ctx.rank), cloudpickle.dumps(answer))
        index += 1


def _served_rerun(launch: Launch, case: Case, ask: store_keys.LocaliseAsk) -> tuple[str, Any]:
    """:func:`_rerun` on a rank of another node: the initial state and the reference's record
    of the step fetched from rank 0 into a spool of this rank's own (removed after)."""
    from ddparity.harness.launch.refserve import RemoteReference
    from ddparity.harness.ranks.probes import trace_name
    from ddparity.harness.spool_files import Spool

    call = (ask.inside[0], ask.inside[1]) if ask.inside is not None else None
    with Spool(janitor=True) as own:  # removed should this rank die in the re-run
        remote = RemoteReference(launch.serve)
        try:
            remote.fetch_state(own.path)
            remote.fetch_file(own.path, trace_name(ask.step, call))
        except Exception as exc:
            return FAILED, f"rank {launch.ctx.rank}: could not fetch the reference's record: {type(exc).__name__}"
        finally:
            remote.close()
        return _rerun(launch.ctx, case, own.path, ask)


class LaunchLocator:
    """Rank 0's locator for :class:`~ddparity.verbs.checking.Checking` in a launch (see the
    module docstring); ``served``: the ranks that read the reference over the network (each
    ask serves them what their re-run reads); ``first_stage``: where the asks' results go in
    the store."""

    def __init__(self, launch: Launch, case: Case, spool: str, timeout: float, served: list[int],
                 first_stage: int) -> None:
        self.launch, self.case, self.spool, self.timeout = launch, case, spool, timeout
        self.served, self.first_stage = served, first_stage
        self.asked = 0
        self.broken = ""
        """Why the last ask failed (a rank's part of it may still wait in a collective: none follows)."""
        self._alone: Any = None

    def __call__(self, mode: str, shard_size: int, step: int, size: int,
                 inside: tuple[str, int, float] | None = None) -> list[Any] | str:
        """Every rank's answer for ``mode``'s step ``step`` (``inside``: that module call's aten
        ops), or why there is none."""
        why = self._reference(step, size, (inside[0], inside[1]) if inside is not None else None)
        if why:
            return why
        return self._ask(store_keys.LocaliseAsk(mode, shard_size, step, size, inside))

    def close(self) -> None:
        """No more asks: the other ranks go on to wait for the verdict (the reference's world ends)."""
        self.launch.store.set(store_keys.localise(self.asked), store_keys.NO_MORE_ASKS)
        if self._alone is not None:
            self._alone.close()

    def _reference(self, step: int, size: int, call: tuple[str, int] | None) -> str:
        from ddparity.harness.ranks.probes import reference_trace_task
        from ddparity.harness.world.world import World

        try:
            if self._alone is None:  # one for every ask (the op pass's too); started clean, not forked from a rank
                self._alone = World(1, self.launch.ctx.backend, clean_start=True)
            self._alone.run(reference_trace_task, self.case, self.spool, step, size, call, timeout=self.timeout)
        except (WorldFailure, WorldStartError) as exc:
            return f"the reference's re-run of step {step} failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        return ""

    def _ask(self, ask: store_keys.LocaliseAsk) -> list[Any] | str:
        """Every rank's answer to ``ask``; the first failure, or the ranks not done within the
        timeout, instead. Rank 0's own re-run runs in a thread: should another rank fail, rank
        0's part may wait in a collective that never completes, and the report must not
        (the process ends with the verdict, that thread with it); no ask follows one that failed."""
        import cloudpickle

        if self.broken:
            return self.broken
        store, n, stage = self.launch.store, self.launch.ctx.world_size, self.first_stage + self.asked
        if self.served:  # a thread a served rank, until it has what its re-run reads
            from ddparity.harness.launch.refserve import ReferenceServer
            from ddparity.harness.ranks.tasks import WAIT_LIMIT_S

            ReferenceServer(self.launch.serve, self.spool, self.served, WAIT_LIMIT_S)
        store.set(store_keys.localise(self.asked), ask.encode())
        self.asked += 1
        answers: dict[int, tuple[str, Any]] = {}
        mine = threading.Thread(target=lambda: answers.setdefault(0, _rerun(self.launch.ctx, self.case, self.spool,
                                                                            ask)),
                                name="ddparity-rerun", daemon=True)
        mine.start()
        deadline = time.monotonic() + self.timeout
        while len(answers) < n:
            for r in range(1, n):
                if r not in answers and store.check([store_keys.result(stage, r)]):
                    answers[r] = cloudpickle.loads(store.get(store_keys.result(stage, r)))
            failed = [text for _, (status, text) in sorted(answers.items()) if status == FAILED]
            if failed:
                self.broken = f"the re-run of step {ask.step} failed: {failed[0]}"
                return self.broken
            if len(answers) < n and time.monotonic() > deadline:
                self.broken = (f"rank(s) {[r for r in range(n) if r not in answers]} did not finish the re-run of step "
                               f"{ask.step} in {self.timeout:g} s")
                return self.broken
            time.sleep(0.05)
        return [value for _, (_, value) in sorted(answers.items())]


__all__ = ["LaunchLocator", "answer_asks"]
