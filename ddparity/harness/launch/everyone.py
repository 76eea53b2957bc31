"""A launch in which every process is a rank running one task (``profile``'s timed steps,
``health``'s measurements, ``check``'s replica); rank 0 may first run one alone (stage 1).
The launch's watch threads (:mod:`.watch`) report a hang, crash or collective mismatch
anywhere; ``failed`` turns one into the verb's report and exit code."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ddparity.errors import Exit, WorldFailure
from ddparity.harness import store_keys
from ddparity.harness.launch import torchrun
from ddparity.harness.launch.watchdog import LaunchWatch
from ddparity.harness.recording.recorder import install_recorder
from ddparity.harness.sidechannel import RankChannel


class Everyone:
    """A launch in which every rank runs one task (``profile``'s timed steps, ``health``'s
    measurements); rank 0 may first run one alone (stage 1)."""

    def __init__(self, backend: str, timeout: float, failed: Callable[[WorldFailure, int], int],
                 live: Any, stages: int = 2) -> None:
        self.timeout = timeout
        self.launch = torchrun.connect(backend, timeout, tasks=tuple(range(1, stages + 1)))
        self.ctx, self.store = self.launch.ctx, self.launch.store
        self.recorder = install_recorder(RankChannel(self.store, "", self.ctx.rank))
        self.watch = LaunchWatch(self.store, self.ctx.rank, self.ctx.world_size, timeout, failed, live)

    def alone(self, task: Callable[..., Any], *args: Any) -> Any:
        """Rank 0: ``task`` in a process group of its own (world size 1)."""
        import dataclasses

        with torchrun.alone(self.ctx.backend):
            self.recorder.begin_task(1)
            value = task(dataclasses.replace(self.ctx, world_size=1), *args)
            self.recorder.end_task()
        return value

    def run(self, first: Callable[[], None] | None, task: Callable[..., Any], *args: Any) -> list[Any]:
        """``first()`` on rank 0 (stage 1, e.g. :meth:`alone`), then ``task(ctx, *args)`` on
        every rank; rank 0 gets every rank's value (see :meth:`gather`)."""
        ctx, store = self.ctx, self.store
        try:
            if ctx.rank == 0:
                if first is not None:
                    first()
                store.set(store_keys.STAGE_ONE_DONE, "1")
            while not store.check([store_keys.STAGE_ONE_DONE]):
                time.sleep(0.05)
            self.watch.stage = 2
            torchrun.form_world(self.launch, self.timeout)
            self.recorder.begin_task(2)
            value = task(ctx, *args)
            self.recorder.end_task()
            self.publish(value)
        except KeyboardInterrupt:
            os._exit(Exit.INTERRUPTED)
        except BaseException as exc:
            self.watch.fail(exc)
        return self.gather()

    def publish(self, value: Any) -> None:
        """This rank's result of the every-rank task of the stage it is in."""
        import cloudpickle

        self.store.set(store_keys.result(self.watch.stage, self.ctx.rank), cloudpickle.dumps(value))

    def gather(self) -> list[Any]:
        """Rank 0: every rank's published result of the stage they are in, once it holds
        the right to report; the others, and rank 0 without that right, wait here for the
        verdict (and exit with it). Earlier stages' results: :meth:`collect`."""
        n, stage = self.ctx.world_size, self.watch.stage
        if self.ctx.rank != 0:
            self.watch.idle()
        while not self.store.check([store_keys.result(stage, r) for r in range(n)]):  # one round trip: all there?
            time.sleep(0.05)
        if not self.watch.claim():
            self.watch.idle()
        return self.collect(stage)

    def collect(self, stage: int) -> list[Any]:
        """Every rank's result of ``stage``, published before the stage in progress began."""
        import cloudpickle

        return [cloudpickle.loads(self.store.get(store_keys.result(stage, r))) for r in range(self.ctx.world_size)]
