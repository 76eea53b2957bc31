"""Tolerances, named and explained.

``auto`` calibrates a noise floor from the reference itself. Data parallelism changes
*where* the batch is summed (per-shard partial sums, then an all-reduce), never *what* is
computed, so a correct DDP run differs from the reference only by floating-point
rounding. The reference is therefore run a second time, as a *calibration twin*:

* on every global batch in reversed sample order — the same mathematics for any model
  that treats the batch as a set (BatchNorm and mean or sum losses included, so their
  misuse is *not* absorbed into the floor), summed in another order;
* with every gradient nudged towards zero, before each optimizer step, by the rounding a
  W-rank run may add: W ulps of the size of its summands (per-sample gradients through
  ``torch.func``, or per-shard ones where those are not defined). Rounding a sum scales
  with its terms, which can be far larger than a cancelling result; and Adam-like
  optimizers turn ulps of a near-zero gradient into visible update differences that
  later steps carry on.

The twin's distance to the reference, step by step and tensor by tensor, is then the
noise a correct run may show, including what the optimizer and later steps make of it.
The per-tensor tolerance is ``HEADROOM * max(twin distance, floor)``, the floor being W
ulps of the summands' size (losses, gradients) or of the tensor (params, buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddparity.trace import RECORD_KINDS, Trace

HEADROOM = 32.0
"""The twin samples *one* reordering; DDP is another. Across our sweep
(``benchmarks/tolerance_sweep.py``: the demo MLP, CNN and transformer block, and MLPs of
three shapes with SGD/Adam/AdamW in float32 and float64, at world sizes 2, 3, 4 and 8)
a correct DDP run came at most 4.1x the twin's distance (Adam). 32x leaves an 8x margin
above that and stays far below the error of real bugs: the bug fixtures land 270
(BatchNorm on 4 shards, first divergence) to 1.6e6 (summed loss) tolerances away."""


def max_abs(t: Any) -> float:
    return float(t.detach().abs().max()) if t is not None and t.numel() else 0.0


def distance(a: Any, b: Any) -> float:
    """Largest elementwise difference; equal infinities (a mask's ``-inf``) are equal, a
    NaN equals nothing, not even a NaN (infinite distance)."""
    import torch

    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    x, y = a.detach().double(), b.detach().double()
    diff = (x - y).abs().masked_fill(x == y, 0.0)
    if torch.isnan(diff).any():
        return float("inf")
    return float(diff.max())


@dataclass(frozen=True)
class Tolerance:
    """Absolute tolerance per (step, kind, tensor name)."""

    description: str
    table: dict[tuple[int, str, str], float]

    def __call__(self, step: int, kind: str, name: str) -> float:
        return self.table.get((step, kind, name), 0.0)


def auto_tolerance(reference: Trace, twin: Trace, world_size: int, dtype: Any) -> Tolerance:
    """Calibrated tolerance for a run of ``world_size`` ranks against ``reference``."""
    import torch

    eps = torch.finfo(dtype).eps
    table: dict[tuple[int, str, str], float] = {}
    for step, (ref, cal) in enumerate(zip(reference.steps, twin.steps)):
        for kind in RECORD_KINDS:
            ref_t, cal_t = ref.tensors(kind), cal.tensors(kind)
            for name, tensor in ref_t.items():
                noise = distance(tensor, cal_t.get(name))
                if noise == float("inf"):
                    noise = 0.0  # shape/None mismatches are not noise
                # Summing W partial results rounds by up to ~W ulps of the partials' size
                # (not of the result's: partial gradients can cancel).
                scale = cal.scale(kind, name) if kind in ("loss", "grad") else tensor
                floor = world_size * eps * max_abs(scale)
                table[(step, kind, name)] = HEADROOM * max(noise, floor)
    return Tolerance(f"auto (calibrated noise floor x{HEADROOM:g}, {dtype})", table)


def fixed_tolerance(reference: Trace, relative: float) -> Tolerance:
    """``relative`` times each tensor's largest magnitude; ``0`` demands bit-exactness."""
    table: dict[tuple[int, str, str], float] = {}
    for step, ref in enumerate(reference.steps):
        for kind in RECORD_KINDS:
            for name, tensor in ref.tensors(kind).items():
                table[(step, kind, name)] = relative * max_abs(tensor)
    return Tolerance(f"fixed relative {relative:g}", table)
