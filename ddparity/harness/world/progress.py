"""What a World's running task is doing, for whoever watches from the controller (the CLI's
live line): the World hands every poll of its ranks' progress records to the observers
registered here. Nothing is computed when nobody observes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddparity.harness.protocol import RunName
from ddparity.records import Position, parse_progress


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One poll of a running task."""

    task: RunName
    """The task, as it declared it should be shown (:func:`ddparity.harness.protocol.names_run`)."""
    world_size: int
    backend: str
    progress: list[str]
    """The ranks' progress records (then those of any simulated ranks)."""
    quiet_s: float
    """Seconds since any rank last made progress."""
    limit_s: float
    """The task's timeout: no progress for this long is a hang."""

    def positions(self) -> list[Position]:
        return [p for p in (parse_progress(text) for text in self.progress) if p is not None]


OBSERVERS: list[Callable[[Snapshot], None]] = []
"""Called with every poll of every running task (in the thread that waits for it)."""


def notify(snapshot: Snapshot) -> None:
    for observe in list(OBSERVERS):
        try:
            observe(snapshot)
        except Exception:  # a display must never change a verdict
            pass
