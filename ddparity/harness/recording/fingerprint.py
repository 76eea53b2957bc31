"""Fingerprints of a replica: every parameter, buffer, optimizer state tensor and RNG
state reduced to one integer, on the rank, after every optimizer step.

A fingerprint is the wrapping sum of the tensor's bit patterns, so any change to any
element changes it (a permutation of elements within one tensor does not), at the cost
of one vectorised pass over the data (0.4 ms per 3 M float32 elements on one CPU core;
large tensors a rotating slice per step, see :data:`SLICES`). Ranks publish them through
the recorder; :mod:`ddparity.checks.desync` finds the first step where they differ.
"""

from __future__ import annotations

import zlib
from typing import Any

from ddparity.records import NONFINITE

_INT_OF_SIZE: dict[int, Any] = {}


SLICES = 16
"""Per step, tensors larger than :data:`SLICE_MIN` elements are fingerprinted a rotating
sixteenth at a time (all of them at a check's last step). Reading every byte of the
parameters and Adam state of a 3.7 M-parameter MLP costs 1.6 ms on one CPU core (memory
bandwidth: 4% of its 41 ms 2-rank step, more under contention); a sixteenth, 0.1 ms. A
desync that touches many elements (every one we know: a rank-local update, a lost or
corrupted all-reduce, a rank-local learning rate) is still caught at its step; one that
changes a few elements, within SLICES steps (replicas that drifted stay apart), and the
equivalence check compares every rank to the reference whole."""

SLICE_MIN = 1 << 16


def device_sums(tensors: list[Any], part: int | None = None, slices: int = SLICES) -> list[Any]:
    """Wrapping integer sum of each tensor's bit patterns, each a 0-d integer tensor (int32
    for elements of up to 4 bytes, int64 for wider ones) on the tensor's own device (nothing
    waits for them). ``part``: fingerprint slice ``part % slices`` of large tensors only."""
    import torch

    if not _INT_OF_SIZE:
        _INT_OF_SIZE.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    sums: list[Any] = []
    # As few ops a tensor as it takes (their dispatch, not the sums, cost most of a small
    # model's fingerprint), and int32 sums where the elements fit: int64 accumulation of
    # 4-byte elements is not vectorised on a CPU (4x slower).
    with torch.no_grad():
        for t in tensors:
            if t.is_complex():
                t = torch.view_as_real(t)
            as_int = _INT_OF_SIZE[t.element_size()]
            bits = t if t.dtype == as_int else t.view(as_int)  # (bool: uint8)
            if part is not None and t.numel() > SLICE_MIN:
                rows = bits.shape[0] if bits.dim() else 0
                if (slices - 1) * -(-rows // slices) >= rows:  # a slice of rows would be empty: flat slices
                    bits = bits.reshape(-1)
                size = -(-bits.shape[0] // slices)  # a slice of rows (of the flat tensor where contiguous)
                bits = bits[(part % slices) * size : (part % slices + 1) * size]
            sums.append(bits.sum(dtype=torch.int64 if as_int == torch.int64 else torch.int32))
    return sums


def _bit_sums(tensors: list[Any], part: int | None = None) -> list[int]:
    """:func:`device_sums` as integers, one device sync per device."""
    import torch

    sums = device_sums(tensors, part)
    by_device: dict[Any, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)  # (int32 and int64 sums stack as int64)
    out = [0] * len(sums)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            out[i] = int(v)
    return out


def nonfinite_count(tensors: list[Any], part: int | None = None, slices: int = SLICES) -> Any:
    """How many of the floating tensors hold a NaN or inf in the part fingerprinted, a 0-d
    int64 tensor on the first tensor's device (nothing waits for it): the evidence of which
    of two ranks that disagree went wrong."""
    import torch

    finite = []
    with torch.no_grad():
        for t in tensors:
            if not t.is_floating_point():
                continue
            if part is not None and t.numel() > SLICE_MIN:
                flat = t.reshape(-1)
                size = -(-flat.shape[0] // slices)
                t = flat[(part % slices) * size : (part % slices + 1) * size]
            # one pass, no mask: summed in float64, a part of up to 32-bit floats is NaN or inf iff an
            # element is (their largest, 3.4e38, summed overflows no float64)
            finite.append(torch.isfinite(t).all() if t.dtype == torch.float64 else
                          torch.isfinite(t.sum(dtype=torch.float64)))
        if not finite:
            return torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
        device = finite[0].device
        return (~torch.stack([f.to(device) for f in finite])).sum(dtype=torch.int64)


def fingerprint(model: Any, optimizer: Any = None, buffers: bool = True, part: int | None = None) -> dict[str, int]:
    """Fingerprints of everything that must be identical on every rank after a step.

    ``buffers=False`` leaves buffers out: under DDP's ``broadcast_buffers=True`` (its
    default) rank 0's buffers overwrite the others' at the next forward, so buffers that
    differ after a step (BatchNorm statistics of each shard) are DDP's contract, not a
    desync. Whether those statistics match one device is the equivalence check's job.
    ``part``: the step number, to fingerprint that step's slice of large tensors (see
    :data:`SLICES`); None for everything.
    """
    import torch

    names: list[str] = []
    tensors: list[Any] = []
    param_names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.append(f"param {name}")
        tensors.append(p)
        param_names[id(p)] = name
    for name, b in model.named_buffers() if buffers else ():
        names.append(f"buffer {name}")
        tensors.append(b)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            pname = param_names.get(id(p), "?")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    names.append(f"optimizer {pname}.{key}")
                    tensors.append(value)
    out = dict(zip(names, _bit_sums(tensors, part))) if tensors else {}
    out[NONFINITE] = int(nonfinite_count([p for _, p in model.named_parameters()], part))
    out["rng cpu"] = zlib.crc32(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng cuda:{i}"] = zlib.crc32(state.numpy().tobytes())
    return out



def shard_fingerprint(model: Any, optimizer: Any, shard: int, part: int | None = None) -> dict[str, int]:
    """Fingerprints of this rank's shards (a DTensor's local part) of every sharded
    parameter and of its optimizer state, each named with the shard it is (``param w
    [shard 1]``): under HSDP the ranks of one shard, one in each replica, must agree; ranks
    of other shards publish other names (:func:`ddparity.checks.desync.first_desync`
    compares a name among the ranks that have it)."""
    import torch

    from ddparity.harness.shards import is_sharded
    from ddparity.records import SHARD_TAG

    names: list[str] = []
    tensors: list[Any] = []
    for name, p in model.named_parameters():
        if not is_sharded(p):
            continue  # left out of sharding: compared with the reference, whole
        names.append(f"param {name}{SHARD_TAG}{shard}]")
        tensors.append(p.to_local())  # type: ignore[attr-defined]  # a DTensor
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and is_sharded(value):
                names.append(f"optimizer {name}.{key}{SHARD_TAG}{shard}]")
                tensors.append(value.to_local())  # type: ignore[attr-defined]  # a DTensor
    return dict(zip(names, _bit_sums(tensors, part))) if tensors else {}
