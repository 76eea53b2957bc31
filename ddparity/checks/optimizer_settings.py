"""The cause read from the optimizer's own settings: each rank's (lr, momentum, betas, weight
decay, ...), as each step's ``optimizer.step()`` ended, against one device's. Where they
differ at or before the step that first differs, they are the cause, named outright rather
than guessed from how far the parameters moved: the same setting on every rank, W times one
device's learning rate (the linear scaling rule on a global batch that did not grow) or
another factor; or a setting that differs between the ranks (a ``ReduceLROnPlateau`` stepped
on each rank's own loss, a rate computed from the rank's data or, under FSDP2, from its own
shards). Read as each step ends: a setting the step itself computes (Prodigy's ``d``) is
one the step used."""

from __future__ import annotations

from ddparity.records import SETTING
from ddparity.run_kinds import kind
from ddparity.verdicts import Divergence

Settings = dict[int, dict[str, tuple[float, ...]]]
"""Per step, each setting's value in every param group (:func:`ddparity.harness.optimizer_settings.settings_of`)."""

PER_RANK = ("it is set per rank, from what only that rank sees (a scheduler stepped on the rank's own metric, such "
            "as ReduceLROnPlateau given the rank's loss, or a rate computed from the rank's data")
"""Where a setting that differs between the ranks comes from (the sentence's open parenthesis
is closed by the caller)."""

SAME_SETTING = 1e-4
"""How close (relative) two values of a setting are to be the same: a setting an optimizer
computes from the gradients (Prodigy's and D-Adaptation's ``d``) carries their rounding."""


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= SAME_SETTING * max(abs(x), abs(y)) for x, y in zip(a, b))


def _shown(values: tuple[float, ...]) -> str:
    return f"{values[0]:.4g}" if len(set(values)) == 1 else "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def settings_apart(reference: Settings, ranks: dict[int, Settings], first: Divergence | None, world_size: int,
                   mode: str, desync_step: int | None = None) -> str | None:
    """The likely cause where some rank's optimizer settings differ from the reference's at a
    step whose update can explain the run's first divergence (``first``; or the step of a
    desync): before it, or at it where the parameters or optimizer state differ first (the
    loss and gradients of a step come before its update). None where every setting agrees."""
    last = first.step if first is not None else desync_step
    if last is None:
        return None
    for step in sorted(s for s in reference if s <= last):
        if first is not None and step == first.step and first.kind in ("loss", "grad"):
            break
        ref = reference[step]
        for key, expected in ref.items():
            got = {r: s[step][key] for r, s in sorted(ranks.items()) if step in s and key in s[step]}
            apart = {r: v for r, v in got.items() if not _same(v, expected)}
            if apart:
                return _cause(key, step, expected, got, apart, world_size, mode)
    return None


def _cause(key: str, step: int, expected: tuple[float, ...], got: dict[int, tuple[float, ...]],
           apart: dict[int, tuple[float, ...]], world_size: int, mode: str) -> str:
    name = mode.upper()
    values = set(got.values())
    one = _shown(expected)
    if len(apart) == len(got) and len(values) == 1:
        [value] = values
        evidence = (f"evidence: the optimizer's {key} is {_shown(value)} on every rank and {one} on one device as "
                    f"step {step}'s optimizer.step() ends")
        factors = {v / e for v, e in zip(value, expected) if e}
        if "lr" in key and factors and all(abs(f - world_size) <= 1e-6 * world_size for f in factors):
            return (f"likely cause: the learning rate multiplied by the world size ({world_size}), the linear "
                    f"scaling rule, on a global batch that did not grow: ddparity keeps the global batch, so "
                    f"{world_size} {name} ranks must train with one device's rate; scale it where the global batch "
                    f"grows, not with the ranks; {evidence}")
        return (f"likely cause: the optimizer's {key} differs from one device's on every rank, a setting that "
                f"depends on the world size or the mode; give the ranks one device's; {evidence}")
    listed = ", ".join(f"rank {r} {_shown(v)}" for r, v in list(got.items())[:6]) + (
        f" and {len(got) - 6} more" if len(got) > 6 else "")
    shards = (f", or computed by the optimizer from the rank's own shards: a sum over p.grad.to_local(), as "
              f"Prodigy and D-Adaptation compute their d unless told that {name} shards the parameters"
              if kind(mode).sharded else "")
    return (f"likely cause: the optimizer's {key} differs between the ranks as step {step}'s optimizer.step() "
            f"ends ({listed}; one device {one}): {PER_RANK}{shards}), so the ranks' updates differ; give every rank "
            f"the same number (all-reduce what it is computed from first: {name}'s loss is the mean of the ranks')")


def settings_desync(differs: list[str], step: int, ranks: list[int], agreeing: list[int] | None) -> str | None:
    """The likely cause of a desync among whose differing fingerprints (``differs``) are the
    optimizer's settings (``setting lr (group 0)``: a watched script's), which only the ranks'
    own values tell apart; None where none differ."""
    settings = list(dict.fromkeys(d[len(SETTING):].split(" (group")[0] for d in differs if d.startswith(SETTING)))
    if not settings:
        return None
    return (f"likely cause: the optimizer's {', '.join(settings)} differ{'s' if len(settings) == 1 else ''} between "
            f"the ranks at step {step} ({ranks} against {agreeing}): {PER_RANK}); give every rank the same number "
            f"(all-reduce the metric first)")
