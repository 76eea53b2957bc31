"""Every key of a launch's store, named once, with the codec of its value.

Under torchrun (or srun) the launched processes share one key-value store (torchrun's
TCPStore, or rank 0's), under a prefix of their own (``ddparity/<run id>/<restart>/``,
:func:`ddparity.harness.launch.torchrun.connect`). What each key holds and who writes it
is said here; the code that writes or reads a key names it through this module, never by
spelling it. A ``get`` of a missing key blocks, so a key read before its writer may have
written it is created first (:func:`prepare`).

Per-task side-channel records (progress, ledger, fingerprints) live under their own
prefix (:func:`ddparity.harness.sidechannel.task_prefix`), apart from these.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

# -- joining --------------------------------------------------------------------------------

JOINED = "joined"
"""A counter: the processes that reached the store and prepared their keys."""


def where(rank: int) -> str:
    """Where ``rank`` runs: :func:`encode_where`'s ``node\\npid``."""
    return f"I{rank}"


def encode_where(node: str, pid: int | None = None) -> str:
    return f"{node}\n{os.getpid() if pid is None else pid}"


def decode_where(value: bytes) -> list[str]:
    """``[node, pid]`` (as text) of a :func:`where` value."""
    return value.decode().split("\n")


# -- stages ---------------------------------------------------------------------------------

STAGE_ONE_DONE = "stage1-done"
"""Every-rank launches (profile, health): rank 0 finished its stage-1 task alone; every
rank may form the world."""

CHECK_PLAN = "check-plan"
"""The launched check: rank 0's reference is written; a :class:`CheckPlan` (JSON)."""


@dataclass(frozen=True)
class CheckPlan:
    """What rank 0 of a launched check tells every rank once its reference is written."""

    spool: str
    """Rank 0's spool (read in place on its node)."""
    nonce: str
    """Written in the spool: a rank that reads it there shares rank 0's filesystem."""
    node: str
    skipped: dict[str, tuple[str, str | None]]
    """The replicated modes that cannot run here: their status and reason."""
    run: list[str]
    """The replicated modes every rank runs, in order."""
    single: tuple[str | None, float] | None
    """The reference's own run (why it failed, None where it passed; its seconds), where
    ``single`` was asked for."""

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, value: bytes) -> CheckPlan:
        data = json.loads(value)
        single = data["single"]
        return cls(data["spool"], data["nonce"], data["node"],
                   {mode: (status, reason) for mode, (status, reason) in data["skipped"].items()},
                   list(data["run"]), (single[0], float(single[1])) if single else None)


def result(stage: int, rank: int) -> str:
    """Where ``rank`` publishes its result of the every-rank task of ``stage`` (the task's
    own codec: cloudpickle for check's and profile's, JSON for watch's summary)."""
    return f"R{stage}/{rank}"


def reference_read(rank: int) -> str:
    """How ``rank`` reads rank 0's reference in a launched check: :data:`SERVED` (over the
    network, from rank 0's server) or :data:`IN_PLACE` (its spool, on the same node)."""
    return f"Q{rank}"


SERVED = "served"
IN_PLACE = "spool"


def localise(index: int) -> str:
    """A launched check's ``index``-th ask, by rank 0 once it judged a diverging run, that
    every rank re-run that run's first differing step module by module (a JSON
    :class:`LocaliseAsk`, or ``null``: no more asks, wait for the verdict)."""
    return f"L{index}"


@dataclass(frozen=True)
class LocaliseAsk:
    """What every rank re-runs (see :func:`localise`): ``mode``'s step ``step`` of a global
    batch of ``size``; ``inside``: (module, call, tolerance) for the op pass."""

    mode: str
    shard_size: int
    step: int
    size: int
    inside: tuple[str, int, float] | None = None

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, value: bytes) -> LocaliseAsk | None:
        data = json.loads(value)
        if data is None:
            return None
        inside = data["inside"]
        return cls(data["mode"], int(data["shard_size"]), int(data["step"]), int(data["size"]),
                   (str(inside[0]), int(inside[1]), float(inside[2])) if inside else None)


NO_MORE_ASKS = "null"


# -- the watch thread -------------------------------------------------------------------------

def beat(rank: int) -> str:
    """A counter ``rank``'s watch thread raises while it lives (a stopped beat: a dead rank)."""
    return f"B{rank}"


def raised(rank: int) -> str:
    """The exception ``rank`` raised (cloudpickled with its traceback's text)."""
    return f"X{rank}"


FAILURES = "failures"
"""A counter of the ranks that raised (the reporter reads :func:`raised` only when set)."""

VERDICT = "V"
"""The launch's exit code, set by the reporter: every process exits with it."""

ACKED = "acked"
"""A counter of the processes that read :data:`VERDICT`."""

NEWS = "N"
"""A counter raised with every verdict and stack request: a rank's watch reads this one key
a beat, and the others only when it moved (each round trip wakes the store's process)."""


def terminated(rank: int) -> str:
    """Set when ``rank`` got SIGTERM from the launcher."""
    return f"T{rank}"


def encode_verdict(code: int) -> str:
    return str(int(code))


def decode_verdict(value: bytes) -> int:
    return int(value)


# -- a failure's evidence ---------------------------------------------------------------------

STACKS_ASKED = "D"
"""A counter of stack requests; each rank answers once per rise."""

NATIVE_ASKED = "Dh"
"""Set with a hang's request: the stacks with native frames, and each rank's Flight Recorder."""

STACKS_WRITTEN = "stacks"
"""A counter of the answers written."""


def stacks(rank: int) -> str:
    """``rank``'s stacks, as text."""
    return f"S{rank}"


def flight(rank: int) -> str:
    """``rank``'s own Flight Recorder state (JSON), in a hang."""
    return f"F{rank}"


def prepare(store: Any, rank: int, node: str, created: list[str]) -> None:
    """Create ``rank``'s keys that others read before it may write them (``created``: the
    side channel's, made alongside), so no reader blocks on a missing key."""
    keys = [*created, beat(rank), stacks(rank), where(rank)]
    values = [""] * len(created) + ["0", "", encode_where(node)]
    store.multi_set(keys, values)
