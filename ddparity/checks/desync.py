"""Desync: ranks that should hold identical replicas no longer do.

:func:`first_desync` finds the first step at which the ranks' fingerprints (taken by
:mod:`ddparity.harness.recording.fingerprint`, decoded by :mod:`ddparity.records`) differ, names
the tensors that differ and the ranks in the minority.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ddparity.checks.collectives import minority
from ddparity.records import IN_BACKWARD, NONFINITE, SHARD_TAG, STEPPED


@dataclass(frozen=True, slots=True)
class ReplicaDrift:
    """The first step at which the ranks' replicas differ."""

    step: int
    names: list[str]
    ranks: list[int]
    agreeing: list[int] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)
    """Ranks of a tie whose parameters hold a NaN or inf (the tie broken by it)."""
    in_backward: bool = False
    """Every rank stepped DDP's parameters inside a backward at this step (:data:`~ddparity.records.IN_BACKWARD`)."""

    def what(self, limit: int = 4) -> str:
        shown = ", ".join(self.names[:limit])
        more = f" (+{len(self.names) - limit} more)" if len(self.names) > limit else ""
        return f"{shown}{more}"



def first_desync(per_rank: dict[int, dict[int, dict[str, int]]],
                 prefer_wrong: tuple[int, ...] = ()) -> ReplicaDrift | None:
    """The first step where ranks' fingerprints differ (only steps every rank reported); a
    name is compared among the ranks that publish it (every rank's, or under HSDP each
    shard's replicas').

    ``prefer_wrong``: ranks known to diverge from the single-device reference, which
    break a tie (world size 2) in favour of the rank that matches the reference; without
    them, a tie is broken by a NaN or inf (:data:`~ddparity.records.NONFINITE`) on one side.
    """
    if len(per_rank) < 2:
        return None
    common = set.intersection(*(set(steps) for steps in per_rank.values()))
    for step in sorted(common):
        prints = {r: {n: v for n, v in per_rank[r][step].items() if n not in (NONFINITE, IN_BACKWARD)}
                  for r in per_rank}
        names = list(dict.fromkeys(n for p in prints.values() for n in p))
        every = frozenset(prints)  # a name a rank lacks differs there; a shard's is only its replicas'
        held = {n: frozenset(r for r, p in prints.items() if n in p) if SHARD_TAG in n else every for n in names}
        differing = [n for n in names if len({prints[r].get(n) for r in held[n]}) > 1]
        if not differing:
            continue
        among = held[differing[0]]  # the ranks that hold the first differing name (HSDP: one shard's replicas)
        differing = [n for n in differing if held[n] == among]
        votes: dict[str, list[int]] = {}
        for r in sorted(among):
            signature = json.dumps([prints[r].get(n) for n in differing])
            votes.setdefault(signature, []).append(r)
        broken = [r for r in among if per_rank[r][step].get(NONFINITE, 0)]
        nan = broken if not prefer_wrong and 0 < len(broken) < len(among) else []
        ranks = minority(votes, prefer_wrong or tuple(nan))
        agreeing = sorted(r for r in among if r not in ranks)
        return ReplicaDrift(step, _order(differing), ranks, agreeing, nonfinite=sorted(nan) if ranks == sorted(nan)
                            else [], in_backward=all(per_rank[r][step].get(IN_BACKWARD) for r in per_rank))
    return None


def _order(names: list[str]) -> list[str]:
    """Which optimizer stepped first (ranks out of step), then parameters, buffers, optimizer
    state and RNG, each in model order."""
    rank = {STEPPED.strip(): -1, "param": 0, "buffer": 1, "optimizer": 2, "rng": 3}
    return sorted(names, key=lambda n: rank.get(n.split(" ", 1)[0], 4))
