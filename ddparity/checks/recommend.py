"""The one line a profile ends with: which of the arms it measured to pick, from its rows.

At the largest world size any arm ran, the arms are ranked by their median step; the
fastest is named with its median and 95th percentile and its scaling, and each arm that
holds less state a rank is set against it, the lightest first (the memory it saves, the
time it costs). Where
the fastest's 95th percentile reaches the runner-up's median, the two are too close for
the steps measured to rank: the line says so, with both spreads, and names no winner (the
lighter arms are still set against the faster of the two).
"""

from __future__ import annotations

from ddparity.checks.comm import WorldProfile, state_of


def state_bytes(run: WorldProfile) -> int:
    """What a rank holds between steps (parameters, gradients, optimizer state, DDP's bucket
    copies; its shards under FSDP)."""
    return state_of(run.memory_per_rank)


def _figures(run: WorldProfile) -> str:
    assert run.step_s is not None
    p95 = f" (p95 {run.step_p95_s * 1e3:.1f})" if run.step_p95_s is not None else ""
    return f"{run.step_s * 1e3:.1f} ms/step p50{p95}"


def _scaling(run: WorldProfile, runs: list[WorldProfile]) -> str:
    base = min((r.world_size for r in runs if r.label == run.label and r.status == "ok" and r.step_s),
               default=run.world_size)
    if run.scaling_efficiency is None or base == run.world_size:
        return ""
    return f", {run.scaling_efficiency:.0%} scaling against {base} rank(s)"


def recommend(runs: list[WorldProfile]) -> str | None:
    """The profile's answer (see the module docstring), or None where no arm ran."""
    ran = [r for r in runs if r.status == "ok" and r.step_s]
    if not ran:
        return None
    ws = max(r.world_size for r in ran)
    arms = sorted((r for r in ran if r.world_size == ws), key=lambda r: r.step_s or 0.0)
    best = arms[0]
    assert best.step_s is not None
    if len(arms) == 1:
        return f"only {best.label} ran at {ws} rank(s): {_figures(best)}{_scaling(best, ran)}"
    second = arms[1]
    assert second.step_s is not None
    if best.step_p95_s is not None and best.step_p95_s >= second.step_s:
        line = (f"too close to rank at {ws} rank(s): {best.label} {_figures(best)}, {second.label} {_figures(second)}: "
                f"the faster's p95 reaches the other's median; more --steps narrow the spread")
    else:
        line = f"fastest at {ws} rank(s): {best.label}: {_figures(best)}{_scaling(best, ran)}"
    mine = state_bytes(best)
    for other in sorted(arms[1:], key=state_bytes):  # the lightest first
        theirs = state_bytes(other)
        if mine and theirs and theirs < mine:
            assert other.step_s is not None
            line += (f"; {other.label} holds {theirs / mine:.2f}x the state a rank at {other.step_s / best.step_s:.2f}x "
                     f"the time")
    return line


__all__ = ["recommend", "state_bytes"]
