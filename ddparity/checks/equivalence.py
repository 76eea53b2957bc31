"""Compare runs against the single-device reference, step by step, up to the step where
the reference itself stops being comparable (a NaN or inf in its loss, gradients or
parameters: a NaN equals nothing, so such a run is never a pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddparity.checks.tolerance import Tolerance, distance, max_abs
from ddparity.trace import RECORD_KINDS, Trace
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


FINITE_KINDS = ("loss", "grad", "param")
"""What must be finite in the reference (buffers may hold infinities on purpose: masks)."""


def first_non_finite(reference: Trace) -> NonFinite | None:
    for step, record in enumerate(reference.steps):
        for kind in FINITE_KINDS:
            for name, tensor in record.tensors(kind).items():
                bad = _first_non_finite_value(tensor)
                if bad is not None:
                    return NonFinite(step, kind, name, bad)
    return None


def _first_non_finite_value(t: Any) -> float | None:
    import torch

    if t is None or not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return None
    finite = torch.isfinite(t)
    return None if bool(finite.all()) else float(t[~finite].reshape(-1)[0].real)


def divergences(reference: Trace, runs: list[Trace], tolerance: Tolerance, until: int | None = None) -> list[Divergence]:
    """Every (step, kind, tensor, rank) whose distance to the reference exceeds its tolerance,
    in the order they happened: step, then loss < grad < param < buffer, then model order.
    ``until``: compare only the steps before it."""
    found: list[Divergence] = []
    for step, ref in enumerate(reference.steps[:until]):
        for kind in RECORD_KINDS:
            ref_tensors = ref.tensors(kind)
            for name, expected in ref_tensors.items():
                for run in runs:
                    if step >= len(run.steps):
                        continue
                    got = run.steps[step].tensors(kind).get(name)
                    error = distance(expected, got)
                    tol = tolerance(step, kind, name)
                    if error > tol:
                        scale = max_abs(expected)
                        found.append(
                            Divergence(
                                step=step,
                                kind=kind,
                                name=name,
                                rank=run.rank,
                                max_abs=error,
                                max_rel=error / scale if scale else float("inf"),
                                tolerance=tol,
                            )
                        )
    return found


def worst(found: list[Divergence], limit: int = WORST_SHOWN) -> list[Divergence]:
    """The tensors furthest beyond their tolerance, one entry per (kind, name)."""
    best: dict[tuple[str, str], Divergence] = {}
    for d in found:
        key = (d.kind, d.name)
        if key not in best or d.excess > best[key].excess:
            best[key] = d
    return sorted(best.values(), key=lambda d: d.excess, reverse=True)[:limit]
