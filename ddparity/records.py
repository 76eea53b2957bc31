"""What ranks leave in the side channel, and its codec: each record's writer beside its
reader.

Three records per rank and task (see :mod:`ddparity.harness.sidechannel` for the keys):

* the **progress** record, overwritten at every event: the rank's step, phase, the
  blocking collective it is inside (if any) and its most recent collectives;
* the **ledger**: one line per collective, appended;
* the **fingerprints**: one line per training step, appended.

The rank side (:mod:`ddparity.harness.recording.recorder`) writes them with the ``encode_*``
functions; the judging side (:mod:`ddparity.checks`) reads them with the ``parse_*``
ones. A leaf module: plain data, no torch, no harness.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PHASES = ("", "drawing the global batch", "build", "ddp", "fsdp", "forward", "backward", "optimizer", "compare",
          "fingerprint", "profile no_sync", "profile forward", "profile backward", "profile optimizer", "done",
          "hardware", "collectives", "compute", "transfers", "bandwidth", "stress", "pairwise", "training launch")
"""Phases of a training step in the order a rank passes them (for who is behind), then
``health``'s in the order of its gate: every phase a rank sets is here (tests/test_layout.py
reads the code's ``set_phase`` calls)."""


BUCKET_VIA = "DDP gradient bucket"
"""How an entry issued for one of DDP's gradient buckets says so: ``via`` is ``BUCKET_VIA i``."""


@dataclass(frozen=True, slots=True)
class RankRecords:
    """What one rank left in the side channel for one task (decoded text)."""

    progress: str = ""
    ledger: str = ""
    fingerprints: str = ""


# -- one collective ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One recorded collective."""

    group: str
    """``world``, another process group's name, or ``p2p`` (pairwise: not compared)."""
    seq: int
    """Its place in the group's sequence on this rank, from 0."""
    op: str
    key: str
    """What must agree across ranks (op, reduce op, root, shapes and dtypes)."""
    desc: str
    site: str
    """The caller's source line (the first frame outside torch and ddparity)."""
    via: str
    """What issued it on the caller's behalf, e.g. ``DDP gradient bucket 0``."""
    step: int
    phase: str
    t: float
    is_async: bool

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        return cls(d["g"], d["s"], d["op"], d["k"], d["d"], d["site"], d.get("via", ""), d.get("step", -1),
                   d.get("phase", ""), d.get("t", 0.0), d.get("async", False))

    @property
    def comparable(self) -> bool:
        return self.group != "p2p"

    def render(self) -> str:
        via = f" [{self.via}]" if self.via else ""
        return f"#{self.seq} {self.desc}{via} at {self.site}"


def encode_entry(group: str, seq: int, op: str, key: str, desc: str, site: str, via: str, step: int,
                 phase: str, t: float, is_async: bool) -> str:
    """One ledger line (the inverse of :meth:`Entry.from_json`). This runs at every
    collective of a rank: what a training loop repeats (the call, its site, its phase) is
    JSON-encoded once."""
    return (f'{{{_fixed(group, op, key, desc, site, via)},"s":{seq},"step":{step},"phase":{_string(phase)},'
            f'"t":{round(t, 6)!r},"async":{"true" if is_async else "false"}}}')


@functools.lru_cache(maxsize=4096)
def _fixed(group: str, op: str, key: str, desc: str, site: str, via: str) -> str:
    fields = {"g": group, "op": op, "k": key, "d": desc, "site": site, "via": via}
    return json.dumps(fields, separators=(",", ":"))[1:-1]


@functools.lru_cache(maxsize=256)
def _string(text: str) -> str:
    return json.dumps(text)


GATHERS = ("all_gather", "all_gather_into_tensor")
GATHERED_WITH_GRAD = " of a tensor that requires grad"
"""Said in an all-gather's description where its input requires grad: the copies it writes
carry no gradient back to the ranks they came from (a loss over them is the open_clip
signature of :func:`ddparity.checks.causes.gathered_without_grad`)."""


def parse_ledger(text: str) -> list[Entry]:
    entries = []
    for line in text.splitlines():
        if line.strip():
            try:
                entries.append(Entry.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a dying rank
    return entries


# -- where a rank is ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Position:
    """Where a rank is: its step and phase, the blocking collective it is inside (if
    any), and its most recent collectives."""

    step: int = -1
    phase: str = ""
    inflight: int | None = None
    recent: tuple[Entry, ...] = ()
    events: int = 0

    @property
    def last(self) -> Entry | None:
        world = [e for e in self.recent if e.group == "world"]
        return world[-1] if world else None

    @property
    def seq(self) -> int:
        last = self.last
        return last.seq if last is not None else -1

    def describe(self) -> str:
        """Step, phase and the last collective, as a report says them."""
        last = self.last
        state = "inside" if last is not None and self.inflight == last.seq else "last issued"
        collective = f"; collective {state}: {last.render()}" if last is not None else "; no collective yet"
        return f"step {self.step}, {self.phase or 'starting'}{collective}"

    def order(self) -> tuple[int, int, int]:
        """Sortable progress: collectives issued on the world group first (ranks issue them in
        lockstep, so fewer is behind, whatever a phase is called: a watched script's phases
        are read from its optimizer and DDP's forward, and a rank stalled before its next
        forward still shows the phase it last set), then step, then phase."""
        phase = PHASES.index(self.phase) if self.phase in PHASES else 0
        return (self.seq, self.step, phase)


def encode_progress(events: int, step: int, phase: str, inflight: int | None, recent: Iterable[str]) -> str:
    """The progress record; ``recent`` are ledger lines from :func:`encode_entry`, embedded
    as they are (this runs at every event of a rank: no re-encoding)."""
    flight = "null" if inflight is None else str(inflight)
    return (f'{{"n":{events},"step":{step},"phase":{json.dumps(phase)},'
            f'"inflight":{flight},"recent":[{",".join(recent)}]}}')


def parse_progress(text: str) -> Position | None:
    if not text:
        return None
    try:
        d = json.loads(text)
        return Position(d["step"], d["phase"], d["inflight"], tuple(Entry.from_json(e) for e in d["recent"]), d["n"])
    except (ValueError, KeyError, TypeError):
        return None


# -- a replica's fingerprints after a step ---------------------------------------------


SHARD_TAG = " [shard "
"""In a fingerprint's name (``param w [shard 1]``): the tensor is one shard of an HSDP
replica, compared only among the ranks that hold the same shard."""


SETTING = "setting "
"""How a fingerprint of one of the optimizer's settings is named (``setting lr (group 0)``)."""


STEPPED = "stepped "
"""How a fingerprint naming the optimizer a step stepped is named (``stepped the optimizer of
Generator.0.weight``): ranks whose optimizer steps are out of step differ in it."""


IN_BACKWARD = "stepped inside backward"
"""Not a tensor's fingerprint: the step's optimizer stepped parameters of a DDP module while
a backward ran (an optimizer in backward: a post-accumulate-grad hook), before DDP's
all-reduce gave them the ranks' average. Never compared; the evidence of a desync's cause."""


NONFINITE = "nonfinite params"
"""Not a tensor's fingerprint: how many of the rank's parameters hold a NaN or inf in the
part fingerprinted, the evidence of which of two ranks that disagree went wrong."""


def encode_fingerprints(step: int, values: dict[str, int]) -> str:
    return json.dumps({"step": step, "fp": values}, separators=(",", ":"))


_STEP_HEAD = '{"step":'
"""How :func:`encode_fingerprints` begins a line: read without parsing the whole window."""


def last_fingerprint_step(text: str) -> int | None:
    """The step of the last line of a fingerprints record (the live watch reads a rank's
    window at every poll; None while it holds none)."""
    line = text.rstrip("\n").rsplit("\n", 1)[-1]
    if not line.startswith(_STEP_HEAD):
        return None
    return int(line[len(_STEP_HEAD):line.index(",")])


def fingerprint_line(text: str, step: int) -> str:
    """The line of a fingerprints record for ``step``, as encoded ("" if it holds none)."""
    head = f"{_STEP_HEAD}{step},"
    return next((line for line in text.splitlines() if line.startswith(head)), "")


def parse_fingerprints(text: str) -> dict[int, dict[str, int]]:
    steps: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        try:
            d = json.loads(line)
            steps[int(d["step"])] = d["fp"]
        except (ValueError, KeyError, TypeError):
            continue
    return steps
