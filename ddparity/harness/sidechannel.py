"""The side channel: per-task records of each rank, readable while the process group is
wedged (a rank stuck in ``all_reduce``, or one that died, still leaves what it wrote).

Two transports, one interface (written and read by the codec in :mod:`ddparity.records`):

* local worlds: files in a private directory of the controller (mode 0700, see
  :func:`private_root`): no other local user can read them, or write a record that
  would change a verdict (a store on a loopback port takes any client's keys);
* a launch (torchrun, srun), whose ranks are on several machines: keys in the launch's
  own store (:class:`RankChannel`, :class:`TaskChannel`).

Records of task ``T`` for rank ``r``:

* ``P<r>`` — progress: the rank's latest position (step, phase, recent collectives),
  overwritten at every event (in a local world a slot file, :mod:`ddparity.harness.slotfile`).
  The watchdog polls these.
* ``L<r>`` — ledger: one line per collective, appended.
* ``F<r>`` — fingerprints: one line per training step, appended.

A rank that runs simulated ranks (threads, :mod:`ddparity.harness.ranks.threaded`) writes theirs
beside its own, as ``P<r>.s<simulated rank>`` and so on, plus ``T`` (the thread's id) and
``E`` (the code it passed to ``os._exit``): the World reads them when that rank fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Protocol

from ddparity.harness.slotfile import SlotWriter, read_slot
from ddparity.records import RankRecords

KEY_LETTERS = ("P", "L", "F")
"""Progress, ledger, fingerprints: the letter of each record's key."""
SIMULATED = ".s"
"""Between a rank's number and a simulated rank's in the name of the latter's records."""


def task_prefix(world_prefix: str, task_id: int) -> str:
    return f"{world_prefix}/side/t{task_id}/"


def record_keys(rank: int, tasks: tuple[int, ...]) -> list[str]:
    """``rank``'s record keys of each of a launch's ``tasks`` (created before anyone reads
    them: :func:`ddparity.harness.store_keys.prepare`)."""
    return [f"{task_prefix('', t)}{kind}{rank}" for t in tasks for kind in KEY_LETTERS]


class RankEnd(Protocol):
    """A rank's end of the side channel, written by its recorder (:class:`RankChannel`: keys
    in a launch's store; :class:`FileRankChannel`: files in a local world's private folder).
    Writes only, and only while a task runs (between :meth:`begin` and :meth:`end`)."""

    def begin(self, task_id: int) -> None: ...

    def end(self) -> None: ...

    @property
    def active(self) -> bool:
        """Whether a task runs (records are written)."""

    def set_progress(self, value: str) -> None:
        """The rank's latest position (:func:`ddparity.records.encode_progress`), overwritten."""

    def append_ledger(self, line: str) -> None:
        """One collective, appended (:func:`ddparity.records.encode_entry`)."""

    def append_fingerprint(self, line: str) -> None:
        """One step's fingerprints, appended."""


class TaskEnd(Protocol):
    """The reader's end for one task (:class:`TaskChannel`, :class:`FileTaskChannel`): made
    ready before the task is sent, polled while it runs (by the controller, or a launch's
    watch), read once it ended, cleared."""

    def prepare(self) -> None: ...

    def progress(self) -> list[str]:
        """Every rank's latest position, by rank (``""``: none yet)."""

    def read(self) -> dict[int, RankRecords]: ...

    def clear(self) -> None: ...


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


class RingRankChannel(RankChannel):
    """A watched script's end (``ddparity watch``): a training run of days must not grow
    the launch's store without bound, so its ledger and fingerprints keys hold the last
    ``keep_ledger`` collectives and ``keep_prints`` steps, overwritten at most every
    :data:`RING_WRITE_S` (and when the task ends: the progress record, written at every
    collective, holds the latest entries meanwhile); the ledger's last ``history`` entries
    stay in this process (:attr:`ledger`: the Flight Recorder dump)."""

    def __init__(self, store: Any, world_prefix: str, rank: int, keep_ledger: int = 64, keep_prints: int = 32,
                 history: int = 4096) -> None:
        from collections import deque

        super().__init__(store, world_prefix, rank)
        self.ledger: deque[str] = deque(maxlen=history)
        self._tail: deque[str] = deque(maxlen=keep_ledger)
        self._prints: deque[str] = deque(maxlen=keep_prints)
        self._dirty: set[str] = set()
        self._written = 0.0

    def append_ledger(self, line: str) -> None:
        if self._prefix:
            lines = line.split("\n")
            self.ledger.extend(lines)
            self._tail.extend(lines)
            self._dirty.add("L")
            self._flush(due=True)

    def append_fingerprint(self, line: str) -> None:
        if self._prefix:
            self._prints.extend(line.split("\n"))
            self._dirty.add("F")
            self._flush(due=True)

    def end(self) -> None:
        self._flush(due=False)
        super().end()

    def _flush(self, due: bool) -> None:
        import time

        now = time.monotonic()
        if not self._prefix or (due and now - self._written < RING_WRITE_S):
            return
        self._written = now
        if "L" in self._dirty:
            self._store.set(f"{self._prefix}L{self._rank}", "\n".join(self._tail) + "\n")
        if "F" in self._dirty:
            self._store.set(f"{self._prefix}F{self._rank}", "\n".join(self._prints) + "\n")
        self._dirty.clear()


RING_WRITE_S = 0.5
"""How often a watched rank rewrites its ledger and fingerprint windows in the store."""


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


_ROOT: str | None = None


def private_root() -> str:
    """This process's private directory for its worlds' side channels (0700, created once,
    removed by a janitor when the process is gone)."""
    global _ROOT
    if _ROOT is None or not os.path.isdir(_ROOT):
        from ddparity.harness.janitor import remove_when_gone

        _ROOT = tempfile.mkdtemp(prefix=f"ddparity-side-{os.getpid()}-")
        remove_when_gone(_ROOT)
    return _ROOT


def _task_dir(directory: str, generation: str, task_id: int) -> str:
    return os.path.join(directory, generation.replace("/", "_"), f"t{task_id}")


class FileRankChannel:
    """The rank's end of a local world's side channel: writes only, into the task's folder
    (created by the controller before the task is sent)."""

    def __init__(self, directory: str, generation: str, rank: int) -> None:
        self._directory, self._generation, self._name = directory, generation, str(rank)
        self._folder = ""
        self._progress: SlotWriter | None = None  # open while the task runs
        self._appends: dict[str, int] = {}  # the same, for the appended records
        self._children: list[FileRankChannel] = []

    def begin(self, task_id: int) -> None:
        self._close()
        self._folder = _task_dir(self._directory, self._generation, task_id)

    def end(self) -> None:
        self._close()
        self._folder = ""

    def _close(self) -> None:
        for channel in [self, *self._children]:
            if channel._progress is not None:
                channel._progress.close()
                channel._progress = None
            for fd in channel._appends.values():
                os.close(fd)
            channel._appends = {}
        for child in self._children:
            child._folder = ""  # the task ended: a simulated rank still writing writes nothing
        self._children = []

    @property
    def active(self) -> bool:
        return bool(self._folder)

    def simulated(self, rank: int) -> FileRankChannel:
        """The channel of simulated rank ``rank``, a thread of this rank's process (its
        records sit beside this rank's, as ``P<rank>.s<simulated rank>``...)."""
        other = FileRankChannel(self._directory, self._generation, 0)
        other._name, other._folder = f"{self._name}{SIMULATED}{rank}", self._folder
        self._children.append(other)  # its files close with this task's
        return other

    def set_progress(self, value: str) -> None:
        """Overwritten in place (:mod:`ddparity.harness.slotfile`): this runs at every
        collective, on the training step's path."""
        if self._folder:
            if self._progress is None:
                self._progress = SlotWriter(os.path.join(self._folder, f"P{self._name}"))
            self._progress.write(value)

    def append_ledger(self, line: str) -> None:
        self._append("L", line)

    def append_fingerprint(self, line: str) -> None:
        self._append("F", line)

    def set_thread(self, ident: int) -> None:
        """A simulated rank's thread (as faulthandler names it: ``0x...``)."""
        self._write("T", f"0x{ident:016x}")

    def note_exit(self, code: int) -> None:
        """A simulated rank called ``os._exit(code)``."""
        self._write("E", str(code))

    def _write(self, kind: str, value: str) -> None:
        if self._folder:
            path = os.path.join(self._folder, f"{kind}{self._name}")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(value)
            os.replace(path + ".tmp", path)  # a reader sees the old record or the new, never half

    def _append(self, kind: str, line: str) -> None:
        if self._folder:
            fd = self._appends.get(kind)
            if fd is None:
                path = os.path.join(self._folder, f"{kind}{self._name}")
                fd = self._appends[kind] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, (line + "\n").encode("utf-8"))


@dataclass
class SimulatedRecords:
    """What the simulated ranks (threads) of a rank's process left for one task."""

    records: dict[int, RankRecords]
    threads: dict[int, str]
    """Each simulated rank's thread, as faulthandler names it (``0x...``)."""
    exits: dict[int, int]
    """The simulated ranks that called ``os._exit``, and with which code."""


class FileTaskChannel:
    """The controller's end for one task of a local world (see :class:`TaskChannel`)."""

    def __init__(self, directory: str, generation: str, task_id: int, world_size: int) -> None:
        self._folder = _task_dir(directory, generation, task_id)
        self._n = world_size

    def prepare(self) -> None:
        os.makedirs(self._folder, mode=0o700, exist_ok=True)

    def _text(self, name: str) -> str:
        try:
            with open(os.path.join(self._folder, name), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def progress(self) -> list[str]:
        """Each rank's progress record, by rank, then those of any simulated ranks (a
        simulated world's progress is its threads')."""
        own = [self._position(f"P{r}") for r in range(self._n)]
        try:
            names = sorted(n for n in os.listdir(self._folder) if n.startswith("P") and SIMULATED in n)
        except OSError:
            return own
        return own + [self._position(n) for n in names]

    def read(self) -> dict[int, RankRecords]:
        return {r: self._records(str(r)) for r in range(self._n)}

    def _records(self, name: str) -> RankRecords:
        return RankRecords(self._position(f"P{name}"), self._text(f"L{name}"), self._text(f"F{name}"))

    def _position(self, name: str) -> str:
        return read_slot(os.path.join(self._folder, name))

    def read_simulated(self, rank: int = 0) -> SimulatedRecords | None:
        """What rank ``rank``'s simulated ranks left, or None where it ran none."""
        try:
            names = os.listdir(self._folder)
        except OSError:
            return None
        head = f"P{rank}{SIMULATED}"
        ranks = sorted(int(n[len(head):]) for n in names if n.startswith(head) and n[len(head):].isdigit())
        if not ranks:
            return None
        name = {r: f"{rank}{SIMULATED}{r}" for r in ranks}
        exits = {r: self._text(f"E{name[r]}") for r in ranks}
        return SimulatedRecords({r: self._records(name[r]) for r in ranks},
                                {r: self._text(f"T{name[r]}") for r in ranks},
                                {r: int(code) for r, code in exits.items() if code.strip().lstrip("-").isdigit()})

    def clear(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)
