"""One replica's step as the draw alignment sees it (:mod:`ddparity.harness.ranks.randomness`):
its samples, where its forward is, and the place of every draw — a forward's draws numbered
in that forward, the step's own draws each sample's counted on their own — with each
sample's generator for a draw (seeded by the case's seed, the step, the place and the
sample's index in the global batch)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ddparity.harness.ranks.sample_draws import STEP_PLACES

_MASK = (1 << 63) - 1


def _start(part: slice) -> int:
    return int(part.start or 0)


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby inputs, unrelated seeds."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & _MASK


@dataclass(eq=False)
class Scope:
    """One replica's step: its samples and where its forward is."""

    seed: int
    step: int = 0
    rows: Any = None
    """Global sample index of every row of the replica's share (a LongTensor)."""
    sources: list[Any] = field(default_factory=list)
    """The share's batched tensors, to match a forward's input slices against."""
    dims: list[int] = field(default_factory=lambda: [0])
    """The dimensions the share is batched along (0, and a ``ddparity.batched``'s)."""
    forward_rows: Any = None
    forward_inputs: Any = None
    forward_calls: int = 0
    in_forward: bool = False
    """Inside the model's forward (else in the training step around it)."""
    step_counts: Any = None
    """Draws in the training step outside the forward, so far, of each row of the share (a
    LongTensor): a row's next such draw is at place ``STEP_PLACES +`` its count, whichever
    micro-batch it is drawn in."""
    micro: slice | None = None
    """The rows of the share a step's draw last named by its template (a micro-batch)."""
    cursors: dict[Any, int] = field(default_factory=dict)
    """By source line, the next row of the share a draw there without a template takes."""
    taken: dict[Any, list[slice]] = field(default_factory=dict)
    """By source line, the rows each of its draws without a template took, in order."""
    fed: list[slice | None] = field(default_factory=list)
    """The rows of the share each forward of the step was given (None: no slice of it)."""
    named: list[slice] = field(default_factory=list)
    """The micro-batches the step's draws with a template named, in order (each once in a row)."""
    calls: int = 0
    """Dropout calls in this forward (the place of the next one)."""
    drawn: int = 0
    batch_first: list[bool | None] = field(default_factory=list)
    """``batch_first`` of the modules the forward is in, innermost last (None: attention)."""
    replays: dict[tuple, list[tuple[Any, int]]] = field(default_factory=dict)
    """The rows and place of each dropout call that activation checkpointing may run again
    in backward, by a digest of its input (see :mod:`ddparity.harness.ranks.replays`)."""

    def next_place(self) -> int:
        """The place of a new draw in this forward (counted in the step's draws too)."""
        place = self.calls
        self.calls += 1
        self.drawn += 1
        return place

    def next_step_places(self, part: slice) -> list[int]:
        """The place of a new draw in the training step outside the forward for each row of
        ``part`` of the share (numbered apart from the forward's, each row's draws counted on
        their own: a sample drawn for in a micro-batch of 2 here and of 4 on one device has
        the same places), counted in the step's draws too."""
        self.drawn += 1
        places = (STEP_PLACES + self.step_counts[part]).tolist()
        self.step_counts[part] += 1
        return places

    def next_rows(self, site: Any, samples: int) -> slice | None:
        """The rows of a micro-batch's draw with no template: the next ``samples`` rows of the
        share at the draw's source line (``site``: a loop's draws, micro-batch after
        micro-batch), else (past the share's end, or no line) the rows a template last named."""
        start = self.cursors.get(site, 0)
        if site is not None and self.rows is not None and start + samples <= len(self.rows):
            self.cursors[site] = start + samples
            self.taken.setdefault(site, []).append(slice(start, start + samples))
            return slice(start, start + samples)
        if self.micro is not None and samples == self.micro.stop - self.micro.start:
            return self.micro
        return None

    def generators(self, place: int | list[int], rows: Any) -> Iterator[Any]:
        """Each sample's generator for the draw at ``place`` (one for all rows, or each
        row's): seeded by the case's seed, the step, the place and the sample's index in the
        global batch."""
        import torch

        places = place if isinstance(place, list) else [place] * len(rows)
        for g, p in zip(rows.tolist(), places):
            yield torch.Generator().manual_seed(mix(self.seed, self.step, p, g))

    def partial_sites(self) -> list[tuple[Any, int]]:
        """The source lines whose draws without a template covered only part of the share
        this step (a draw for the whole batch: one timestep for every sample), with how many
        rows they took."""
        size = len(self.rows) if self.rows is not None else 0
        return [(site, taken) for site, taken in self.cursors.items() if 0 < taken < size]

    def name_micro(self, part: slice) -> None:
        """A draw with a template named this micro-batch of the share."""
        self.micro = part
        if not self.named or self.named[-1] != part:
            self.named.append(part)

    def out_of_order(self) -> tuple[Any, slice, slice] | None:
        """A source line whose draws without a template took the share's micro-batches in
        order while the step took the same micro-batches in another (a loop over them
        reversed), as the forwards' inputs tell (each a slice of the share) or the draws
        shaped like a micro-batch do: (the line, the rows its draw took, the rows of the
        micro-batch it was drawn for), the first that differ; None where neither tells or
        the orders agree."""
        whole = slice(0, len(self.rows) if self.rows is not None else 0)
        told = [f for f in self.fed if f is not None and f != whole]
        orders = ([told] if told and len(told) == len(self.fed) else []) + [self.named]
        for site, parts in self.taken.items():
            for order in orders:
                if len(parts) == len(order) and parts != order and sorted(parts, key=_start) == sorted(order, key=_start):
                    return next((site, p, f) for p, f in zip(parts, order) if p != f)
        return None

    def uneven_step_draws(self) -> tuple[int, int] | None:
        """(fewest, most) of the step's own draws a sample of the share had, where they
        differ (a draw with no template took another micro-batch's rows); None: even."""
        counts = self.step_counts
        if counts is None or not counts.numel() or bool((counts == counts[0]).all()):
            return None
        return int(counts.min()), int(counts.max())

