"""The side channel: per-task keys in the world's rendezvous store, readable while the
process group is wedged.

The store server runs in the controller (a thread of the TCPStore), not behind any
collective, so a rank stuck in ``all_reduce`` or one that died still leaves what it wrote
here. This module is transport only: the values are written and read by the codec in
:mod:`ddparity.records`.

Keys of task ``T`` for rank ``r`` (all under ``<world prefix>/side/t<T>/``):

* ``P<r>`` — progress: the rank's latest position (step, phase, recent collectives),
  overwritten at every event. The watchdog polls these.
* ``L<r>`` — ledger: one line per collective, appended.
* ``F<r>`` — fingerprints: one line per training step, appended.
"""

from __future__ import annotations

from typing import Any

from ddparity.records import RankRecords

KEY_LETTERS = ("P", "L", "F")
"""Progress, ledger, fingerprints: the letter of each record's key."""


def task_prefix(world_prefix: str, task_id: int) -> str:
    return f"{world_prefix}/side/t{task_id}/"


class RankChannel:
    """The rank's end: writes only. One TCPStore round trip per call (microseconds)."""

    def __init__(self, store: Any, world_prefix: str, rank: int) -> None:
        self._store = store
        self._world_prefix = world_prefix
        self._rank = rank
        self._prefix = ""

    def begin(self, task_id: int) -> None:
        self._prefix = task_prefix(self._world_prefix, task_id)

    def end(self) -> None:
        self._prefix = ""

    @property
    def active(self) -> bool:
        return bool(self._prefix)

    def set_progress(self, value: str) -> None:
        if self._prefix:
            self._store.set(f"{self._prefix}P{self._rank}", value)

    def append_ledger(self, line: str) -> None:
        if self._prefix:
            self._store.append(f"{self._prefix}L{self._rank}", line + "\n")

    def append_fingerprint(self, line: str) -> None:
        if self._prefix:
            self._store.append(f"{self._prefix}F{self._rank}", line + "\n")


class TaskChannel:
    """The controller's end for one task: creates the keys before the task is sent (so
    reads never block on a missing key), polls progress, reads everything, clears."""

    def __init__(self, store: Any, world_prefix: str, task_id: int, world_size: int) -> None:
        self._store = store
        self._prefix = task_prefix(world_prefix, task_id)
        self._n = world_size
        self._keys = {kind: [f"{self._prefix}{kind}{r}" for r in range(world_size)] for kind in KEY_LETTERS}

    def prepare(self) -> None:
        keys = [k for kind in KEY_LETTERS for k in self._keys[kind]]
        self._store.multi_set(keys, [""] * len(keys))

    def progress(self) -> list[str]:
        return [v.decode("utf-8", "replace") for v in self._store.multi_get(self._keys["P"])]

    def read(self) -> dict[int, RankRecords]:
        keys = self._keys["P"] + self._keys["L"] + self._keys["F"]
        values = [v.decode("utf-8", "replace") for v in self._store.multi_get(keys)]
        n = self._n
        return {r: RankRecords(values[r], values[n + r], values[2 * n + r]) for r in range(n)}

    def clear(self) -> None:
        for kind in KEY_LETTERS:
            for key in self._keys[kind]:
                self._store.delete_key(key)
