"""A hook that times every collective this process issues (``ddparity profile``'s sharded
modes), called by the recorded collectives of :mod:`ddparity.harness.recording.recorder`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class CollectiveTimer(Protocol):
    """Times every collective this process issues: ``call(op, bound arguments, run)`` runs
    the collective and returns what it returns."""

    def call(self, op: str, arguments: dict[str, Any], run: Callable[[], Any]) -> Any: ...


timer: CollectiveTimer | None = None


def set_collective_timer(own: CollectiveTimer | None) -> None:
    """While set, every collective of this process, from any thread (a GPU's backward runs
    on the autograd engine's own), goes through ``own`` (the outer call only:
    ``all_gather_into_tensor`` calling ``all_gather_single`` is timed once)."""
    global timer
    timer = own
