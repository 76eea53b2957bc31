"""Compare runs against the single-device reference, step by step, up to the step where
the reference itself stops being comparable (a NaN or inf in its loss, gradients or
parameters: a NaN equals nothing, so such a run is never a pass)."""

from __future__ import annotations

from dataclasses import dataclass

from ddparity.checks.tolerance import Tolerance
from ddparity.distances import RECORD_KINDS, Distances, Reference, update_ratio
from ddparity.verdicts import Divergence

WORST_SHOWN = 5


@dataclass(frozen=True)
class NonFinite:
    """The first NaN or inf in the reference's loss, gradients or parameters."""

    step: int
    kind: str
    name: str
    value: float

    def reason(self) -> str:
        return (f"the reference (mode single) has a non-finite {self.kind} {self.name!r} at step {self.step} "
                f"({self.value}): the training itself blew up, and a non-finite reference proves nothing from "
                f"that step on; lower the learning rate, or check the data and the loss")


def first_non_finite(reference: Reference) -> NonFinite | None:
    """The first NaN or inf in the reference's loss, gradients or parameters (buffers may
    hold infinities on purpose: masks), as its writer found it."""
    return NonFinite(*reference.non_finite) if reference.non_finite is not None else None


def divergences(reference: Reference, runs: list[Distances], tolerance: Tolerance,
                until: int | None = None) -> list[Divergence]:
    """Every (step, kind, tensor, rank) whose distance to the reference exceeds its tolerance,
    in the order they happened: step, then loss < grad < param < optimizer < buffer, then
    model order.
    ``until``: compare only the steps before it."""
    found: list[Divergence] = []
    for step, entries in enumerate(reference.steps[:until]):
        for kind in RECORD_KINDS:
            for (k, name), expected in entries.items():
                if k != kind:
                    continue
                for run in runs:
                    if step >= len(run.steps):
                        continue
                    error = run.steps[step].get((kind, name), float("inf"))  # never compared: never a pass
                    tol = tolerance(step, kind, name)
                    if error > tol:
                        scale = expected.value
                        why = run.mismatches.get((step, kind, name)) if (kind, name) in run.steps[step] \
                            else "never compared (this run did not record it)"
                        found.append(
                            Divergence(
                                step=step,
                                kind=kind,
                                name=name,
                                rank=run.rank,
                                max_abs=error,
                                max_rel=error / scale if scale else float("inf"),
                                tolerance=tol,
                                mismatch=why if error == float("inf") else None,
                            )
                        )
    return sorted(found + _update_factor(runs, tolerance, until), key=lambda d: (d.step, RECORD_KINDS.index(d.kind)))


UPDATE_FACTOR = "(the update, as a factor of one device's)"
"""The name a run's step-0 update is judged under as a whole (see
:data:`~ddparity.checks.tolerance.UPDATE_SHARE`)."""


def _update_factor(runs: list[Distances], tolerance: Tolerance, until: int | None) -> list[Divergence]:
    """Each rank's step-0 update as a whole (its own shards under FSDP2), where ``tolerance``
    judges its factor and it is further from 1 than that. Per rank: the factor over every rank
    is a mean of theirs, and a learning rate doubled on one rank of two (0.5 on the other's
    shards) averaged to 0.75, under a quarter off."""
    if not tolerance.update or until == 0:
        return []
    found = []
    for run in sorted(runs, key=lambda r: r.rank):
        ratio = update_ratio([run.moved]) if run.moved else None
        error = abs(ratio[0] - 1) if ratio is not None else 0.0
        if error > tolerance.update:
            found.append(Divergence(step=0, kind="param", name=UPDATE_FACTOR, rank=run.rank, max_abs=error,
                                    max_rel=error, tolerance=tolerance.update, factor=ratio[0] if ratio else None))
    return found


def worst(found: list[Divergence], limit: int = WORST_SHOWN) -> list[Divergence]:
    """The tensors furthest beyond their tolerance, one entry per (kind, name)."""
    best: dict[tuple[str, str], Divergence] = {}
    for d in found:
        key = (d.kind, d.name)
        if key not in best or d.excess > best[key].excess:
            best[key] = d
    return sorted(best.values(), key=lambda d: d.excess, reverse=True)[:limit]
