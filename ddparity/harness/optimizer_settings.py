"""An optimizer's numeric settings as they are read from it (its param groups' lr, momentum,
betas, weight decay, a scheduler's ``initial_lr``): by the ranks of a check, as each step's
``optimizer.step()`` ends (:class:`~ddparity.harness.ranks.stepping.OptimizerSettings`), and by a watched
script's ranks, fingerprinted beside the parameters
(:mod:`ddparity.harness.recording.replicas`)."""

from __future__ import annotations

from typing import Any


def settings_of(optimizer: Any) -> dict[str, tuple[float, ...]]:
    """Every real-number setting of ``optimizer``'s param groups (``betas[0]`` for a pair),
    by name: its value in each group; a setting some group lacks is left out."""
    import torch

    groups: list[dict[str, float]] = []
    for group in optimizer.param_groups:
        numbers: dict[str, float] = {}
        for key, value in group.items():
            items = enumerate(value) if isinstance(value, (tuple, list)) and key != "params" else [(None, value)]
            for i, v in items:
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = float(v)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    numbers[key if i is None else f"{key}[{i}]"] = float(v)
        groups.append(numbers)
    return {k: tuple(g[k] for g in groups) for k in (groups[0] if groups else {}) if all(k in g for g in groups)}
