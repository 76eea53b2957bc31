"""Compare runs against the single-device reference, step by step."""

from __future__ import annotations

from ddparity.checks.tolerance import Tolerance, distance, max_abs
from ddparity.trace import RECORD_KINDS, Trace
from ddparity.verdicts import Divergence

WORST_SHOWN = 5


def divergences(reference: Trace, runs: list[Trace], tolerance: Tolerance) -> list[Divergence]:
    """Every (step, kind, tensor, rank) whose distance to the reference exceeds its tolerance,
    in the order they happened: step, then loss < grad < param < buffer, then model order."""
    found: list[Divergence] = []
    for step, ref in enumerate(reference.steps):
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
