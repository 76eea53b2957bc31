"""Collectives and who disagrees: the first place in a group's sequence where ranks
issued different collectives, and the minority ranks that differ from the rest.

Input is each rank's ledger (:mod:`ddparity.records`); :class:`LiveWatch` judges the
ranks' progress records while a task runs, so a mismatch stops the task before gloo
aborts a rank over it (or NCCL wedges for 30 minutes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddparity.records import Entry, parse_progress


def minority(groups: dict[str, list[int]], prefer_wrong: tuple[int, ...] = ()) -> list[int]:
    """The ranks outside the group that agrees, given ranks grouped by what they hold.

    A unique largest group of two or more ranks is the majority. Otherwise the ranks
    known to be wrong (``prefer_wrong``: they diverge from the single-device reference)
    decide: the one top group without such a rank is the majority; if every group has
    one, every rank is reported. Without that evidence, two ranks that disagree are
    judged against the lowest rank, and three or more that all disagree are all reported.
    """
    everyone = sorted(r for g in groups.values() for r in g)
    ranked = sorted(groups.values(), key=len, reverse=True)
    top = [g for g in ranked if len(g) == len(ranked[0])]
    if len(top) == 1 and len(top[0]) > 1:
        majority = top[0]
    elif prefer_wrong:
        clean = [g for g in top if not set(g) & set(prefer_wrong)]
        if len(clean) != 1:
            return everyone
        majority = clean[0]
    elif len(top[0]) == 1 and len(everyone) > 2:
        return everyone
    else:
        majority = min(top, key=min)
    return [r for r in everyone if r not in majority]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Ranks issued different collectives at the same place in a group's sequence."""

    group: str
    seq: int
    entries: dict[int, Entry]
    ranks: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return max(e.step for e in self.entries.values())

    def what(self) -> str:
        return f"collective #{self.seq} differs across ranks: " + "; ".join(
            f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r in self.ranks
        ) + " vs " + "; ".join(f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r not in self.ranks)


def slots(sequences: Mapping[int, Sequence[Entry]]) -> dict[tuple[str, int], dict[int, Entry]]:
    """The comparable entries by (group, sequence number), then by rank."""
    out: dict[tuple[str, int], dict[int, Entry]] = {}
    for rank, entries in sequences.items():
        for e in entries:
            if e.comparable:
                out.setdefault((e.group, e.seq), {})[rank] = e
    return out


def collective_mismatch(sequences: Mapping[int, Sequence[Entry]]) -> Mismatch | None:
    """The first slot (per group) where the ranks holding it issued different collectives."""
    for (group, seq), by_rank in sorted(slots(sequences).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        keys: dict[str, list[int]] = {}
        for rank, e in sorted(by_rank.items()):
            keys.setdefault(e.key, []).append(rank)
        if len(keys) > 1:
            return Mismatch(group, seq, by_rank, minority(keys))
    return None


class LiveWatch:
    """Called by the World with the ranks' progress while a task runs: returns a reason to
    stop the task when ranks issued different collectives at the same slot. Waits until
    every rank reached the slot (or ``settle`` seconds) so the minority is the right one."""

    def __init__(self, settle: float = 1.0) -> None:
        self.settle = settle
        self.found: Mismatch | None = None
        self._since: float | None = None

    def __call__(self, progress: list[str]) -> str | None:
        positions = {r: p for r, text in enumerate(progress) if (p := parse_progress(text)) is not None}
        mismatch = collective_mismatch({r: p.recent for r, p in positions.items()})
        if mismatch is None:
            self._since = None
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        everyone = len(mismatch.entries) == len(progress)
        if not everyone and now - self._since < self.settle:
            return None
        self.found = mismatch
        return "ranks issued different collectives: " + mismatch.what()
