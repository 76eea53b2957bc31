"""When a running task has failed, and how: one rule for a local
:class:`~ddparity.harness.world.world.World` (its ranks' pipes and process sentinels) and a
launch's watch thread (:class:`~ddparity.harness.launch.watchdog.LaunchWatch`: the launch's
store). Each gathers the evidence its own way; both ask :class:`TaskClock` the same
question at every poll, so a hang, a crash or a raise ends a task the same way wherever it
runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Ending(Enum):
    """How a task that did not complete ended, in the order :meth:`TaskClock.decide` weighs them."""

    STOPPED = "stopped"
    """Stopped on purpose: the live watch saw a mismatched collective, or the user or launcher."""
    CRASHED = "crashed"
    """A rank's process is gone."""
    FAILED = "failed"
    """A rank raised, and the others did not finish within the error grace."""
    TIMED_OUT = "timed out"
    """No rank made progress for the timeout (or the hard deadline passed)."""


@dataclass
class TaskClock:
    """The deadlines of one running task.

    ``timeout``: how long no rank may make progress (a hang); ``error_grace``: how long the
    others may run on after a rank raised (they usually wait for it in a collective, and
    then raise too); ``quiet_s``: after a raise, how long without progress is enough to end
    early; ``hard_deadline``: when a task that keeps progressing is ended all the same."""

    started: float
    timeout: float
    error_grace: float
    quiet_s: float = math.inf
    hard_deadline: float = math.inf
    last_progress: float = math.nan
    first_failure: float | None = None

    def __post_init__(self) -> None:
        if math.isnan(self.last_progress):
            self.last_progress = self.started

    def progressed(self, now: float) -> None:
        """Some rank moved (its progress record changed, or it finished)."""
        self.last_progress = now

    def raised(self, now: float) -> None:
        """A rank raised (the first time counts)."""
        if self.first_failure is None:
            self.first_failure = now

    def due(self, grace: float | None = None) -> float:
        """When the task ends if nothing else happens (``grace``: this poll's error grace,
        e.g. longer while the raises all look like a peer's death reaching the others)."""
        until = min(self.last_progress + self.timeout, self.hard_deadline)
        if self.first_failure is not None:
            quiet_since = max(self.first_failure, self.last_progress)
            error_grace = self.error_grace if grace is None else grace
            until = min(until, self.first_failure + error_grace, quiet_since + self.quiet_s)
        return until

    def decide(self, now: float, *, stopped: bool = False, dead: bool = False,
               grace: float | None = None) -> Ending | None:
        """How the task ended by ``now``, or None while it runs on. A stop on purpose comes
        first (its reason explains what follows), then a death, then a raise past its grace,
        then silence past the timeout."""
        if stopped:
            return Ending.STOPPED
        if dead:
            return Ending.CRASHED
        if now >= self.due(grace):
            return Ending.FAILED if self.first_failure is not None else Ending.TIMED_OUT
        return None
