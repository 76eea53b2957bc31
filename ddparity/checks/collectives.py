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
    judged against each other (both reported), and three or more that all disagree are
    all reported.
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
    else:
        return everyone
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
        odd = [f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r in self.ranks]
        rest = [f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r not in self.ranks]
        sides = ["; ".join(odd), "; ".join(rest)] if rest else odd
        return f"collective #{self.seq} differs across ranks: " + " vs ".join(sides)


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
            ranks = minority(keys)
            if len(ranks) == len(by_rank):  # no majority: what else was recorded may tell
                ranks = _odd_one_out(sequences, by_rank) or ranks
            return Mismatch(group, seq, by_rank, ranks)
    return None


def _odd_one_out(sequences: Mapping[int, Sequence[Entry]], by_rank: dict[int, Entry]) -> list[int] | None:
    """The one rank that the ranks' ledgers show to be wrong at a slot without a majority
    (two ranks, or every rank different), or None where they do not tell.

    Two kinds of evidence, each decisive only when it singles out exactly one rank:
    a call the user's code issued there from a source line (and with a signature) that no
    other rank ever issued — ``if rank == 0: dist.all_reduce(metric)``; and a rank whose
    call at that place in the step differs from its own call at the same place one step
    earlier, while every other rank repeats its previous step — a collective skipped, or
    issued with another shape, op or root, from some step on.
    """
    elsewhere: dict[int, set[tuple[str, str]]] = {
        r: {(e.site, e.key) for e in seq if e.comparable} for r, seq in sequences.items()}
    unique = [r for r, e in by_rank.items()
              if not e.via and e.site and all((e.site, e.key) not in elsewhere[o] for o in by_rank if o != r)]
    if len(unique) == 1:
        return unique
    changed: list[int] = []
    for r, e in by_rank.items():
        same_step = [x for x in sequences[r] if x.comparable and x.group == e.group and x.step == e.step]
        before = [x for x in sequences[r] if x.comparable and x.group == e.group and x.step == e.step - 1]
        place = next((i for i, x in enumerate(same_step) if x.seq == e.seq), None)
        if e.step < 1 or place is None or place >= len(before):
            return None  # no earlier step to hold this rank to
        if (before[place].key, before[place].site) != (e.key, e.site):
            changed.append(r)
    return changed if len(changed) == 1 else None


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
