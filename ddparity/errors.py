"""The one error hierarchy of ddparity.

Every message says what was observed, what was expected, and how to fix it. The exit
codes are :class:`Exit`: a :class:`UsageError` ends the command with ``Exit.USAGE``; a
report's verdict (a hang or crash among its runs: ``Exit.HANG_OR_CRASH``) decides the rest.
"""

from __future__ import annotations

import signal
from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    """The exit codes of every ddparity command and rank process (docs/cli.md lists them), in one place."""

    OK = 0
    """equivalent, healthy, profiled"""
    FAILED = 1
    """a divergence or desync found, a health check failed"""
    USAGE = 2
    """bad input: a message names the problem and the fix"""
    HANG_OR_CRASH = 3
    """a hang, a rank crash, or a world that could not start"""
    INTERNAL = 4
    """a bug in ddparity itself"""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT)"""


def signal_name(exitcode: int | None) -> str:
    """How a process ended, as reports say it: ``exit code N``, or ``signal SIGKILL`` for a
    negative ``Popen``/``multiprocessing`` exit code."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


class DdparityError(Exception):
    """Root of every error ddparity raises on purpose."""


class UsageError(DdparityError, ValueError):
    """The input cannot be run as given (bad target, bad option, bad Case). A ``ValueError``
    too, so that code catching bad arguments the built-in way (Hypothesis, argparse-style
    wrappers, ``except ValueError``) catches ddparity's."""


class CaseError(UsageError):
    """The case itself cannot be run (its factory, data or loss raised)."""


class ParityError(DdparityError):
    """A check found a divergence or desync; the message is the readable report."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class WorldFailure(DdparityError):
    """A World could not run a task to completion on every rank.

    ``records`` holds what each rank left in the side channel (progress, collective
    ledger, fingerprints), ``simulated`` what the simulated ranks (threads) of a rank left
    there, ``stacks`` the stacks taken before ranks were stopped, and ``flight`` (in a launch's
    hang) each rank's own Flight Recorder state.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.records: dict = {}
        self.simulated: object = None
        self.stacks: dict = {}
        self.flight: dict = {}

    def with_evidence(self, records: dict | None = None, simulated: object = None, stacks: dict | None = None,
                      flight: dict | None = None) -> WorldFailure:
        """This failure with the evidence gathered once it was decided (the ranks' records,
        read after they were stopped; stacks; Flight Recorder states), before it is raised."""
        if records is not None:
            self.records = records
        if simulated is not None:
            self.simulated = simulated
        if stacks is not None:
            self.stacks = stacks
        if flight is not None:
            self.flight = flight
        return self


class WorldStartError(WorldFailure):
    """Rank processes could not be started or could not form a process group."""


class TaskTimeout(WorldFailure):
    """Some ranks did not answer within the task's timeout; the world was rebuilt."""

    def __init__(self, message: str, pending_ranks: list[int], stacks: dict[int, str] | None = None,
                 suspect_ranks: list[int] | None = None, limit_s: float | None = None) -> None:
        super().__init__(message)
        self.pending_ranks = pending_ranks
        self.stacks = stacks or {}
        self.suspect_ranks = suspect_ranks or []
        """The ranks behind the others in the collective sequence (the others wait for them);
        empty when every rank is at the same place."""
        self.limit_s = limit_s
        """How long no rank made progress before the task was declared hung."""

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.pending_ranks, self.stacks, self.suspect_ranks, self.limit_s),
                self.__dict__)


class TaskStopped(WorldFailure):
    """A watcher stopped the task before it could deadlock (e.g. ranks issued different
    collectives at the same place in the sequence); the world was rebuilt."""

    def __init__(self, message: str, reason: str, pending_ranks: list[int], stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.pending_ranks = pending_ranks
        self.stacks = stacks or {}


class RankCrashed(WorldFailure):
    """A rank process died (exit, signal) while running a task."""

    def __init__(self, message: str, rank: int, exitcode: int | None, output: str = "",
                 stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.output = output
        self.stacks = stacks or {}


class TaskFailed(WorldFailure):
    """The task raised on at least one rank. ``outcomes`` holds every rank's outcome."""

    def __init__(self, message: str, outcomes: list) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes if o is not None and not o.ok]


class SimulatedRankError(RuntimeError):
    """A simulated rank (a thread) raised; ``rank`` says which."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"simulated rank {rank}: {message}")
        self.rank = rank

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (SimulatedRankError, (self.rank, str(self).split(": ", 1)[1]))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a check (a KeyboardInterrupt still): ``places`` says where each rank of
    the task in progress was; ``report`` (set by ``check``) holds the runs finished so far
    and ``during`` the run in progress."""

    def __init__(self, places: list[str] | None = None, report: object = None, during: str = "") -> None:
        super().__init__("interrupted")
        self.places = places or []
        self.report = report
        self.during = during


class StillRunning(DdparityError):
    """Stands in for the outcome of a rank that was still running (most likely waiting
    for a failed peer in a collective) when the World stopped it."""


class RemoteError(Exception):
    """Stands in for an exception raised in a rank that could not be pickled back."""

    def __init__(self, type_name: str, message: str, traceback: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback = traceback

    def __reduce__(self):  # keep it picklable with its three fields
        return (RemoteError, (self.type_name, self.message, self.traceback))


def peer_gone(exc: BaseException) -> bool:
    """An error a rank gets because a peer is gone (the peer is the news, not this rank)."""
    text = str(exc)
    return type(exc).__name__ in ("DistError", "DistBackendError", "DistNetworkError") or any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL error"))
