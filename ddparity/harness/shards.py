"""Sharded tensors (FSDP2's parameters and gradients, DTensors) compared where they are:
each rank's local shard against the same slice of the reference's whole tensor, read in
place from the spool (a view of the mapped file), so no rank ever gathers a full tensor
for the comparison and a check's memory stays FSDP's own."""

from __future__ import annotations

from typing import Any


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing torch.distributed.tensor for plain tensors)."""
    return t is not None and type(t).__name__ == "DTensor"


def local_part(expected: Any, got: Any) -> tuple[Any, Any]:
    """``(the reference's slice, this rank's shard)`` for a DTensor ``got``; for anything
    else ``(expected, got)`` unchanged. A reference of another shape is left whole (the
    comparison reports the shapes)."""
    if not is_sharded(got):
        return expected, got
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = got.to_local()
    if expected is None or tuple(expected.shape) != tuple(got.shape):
        return expected, local
    shape, offset = compute_local_shape_and_global_offset(got.shape, got.device_mesh, got.placements)
    return expected[tuple(slice(o, o + s) for o, s in zip(offset, shape))], local


def optimizer_state(model: Any, optimizer: Any) -> list[tuple[str, Any]]:
    """Each tensor of ``optimizer``'s per-parameter state, named ``<parameter>.<key>``
    (``net.0.weight.exp_avg``), in model order; under FSDP a sharded parameter's state is
    sharded alike (compared shard against slice, as the parameter)."""
    import torch

    if not optimizer:  # None, or False: not asked for
        return []
    state = optimizer.state
    return [(f"{name}.{key}", value) for name, p in model.named_parameters() if p in state
            for key, value in state[p].items() if isinstance(value, torch.Tensor)]
