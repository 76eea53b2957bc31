"""Dropout calls that activation checkpointing runs again, matched to the calls they repeat.

Activation checkpointing (torch.utils.checkpoint, reentrant or not) runs a region's
forward again inside backward, torch's RNG state restored so that torch's own dropout
draws the same mask. Aligned dropout draws from the step, the sample and the call's place
instead: the recomputed call must get the place (and, under the DataParallel emulation,
the replica's rows) of the call it repeats, not the next place (or the last replica's
rows). A recomputed input is bit-identical to the original, so a digest of it finds
the call it repeats; calls that cannot be recomputed (outside any checkpoint) keep none.
"""

from __future__ import annotations

from typing import Any


def may_be_recomputed() -> bool:
    """Whether this forward runs where checkpointing may run it again: under saved-tensor
    hooks (non-reentrant checkpointing), or without grad (the reentrant kind's forward)."""
    import torch

    if not torch.is_grad_enabled():
        return True
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except (AttributeError, TypeError):  # an older torch: keep every call's place
        return True


def in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpointed region recomputed)."""
    import torch

    try:
        return bool(torch._C._current_graph_task_id() != -1)
    except AttributeError:
        return False


def replayed(replays: dict[tuple, list[tuple[Any, int]]], x: Any) -> tuple[Any, int] | None:
    """The rows and place of the forward call this one repeats, when it runs inside
    backward (a checkpointed region recomputed), else None."""
    if not replays or not in_backward():
        return None
    calls = replays.get(digest(x))
    return calls.pop(0) if calls else None


def digest(x: Any) -> tuple:
    import torch

    sums = torch.stack([x.detach().sum(dtype=torch.float64), x.detach().abs().sum(dtype=torch.float64)]).tolist()
    return (tuple(x.shape), str(x.dtype), str(x.device), *sums)
