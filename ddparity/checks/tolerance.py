"""Tolerances, named and explained.

``auto`` calibrates a noise floor from the reference itself. Data parallelism changes
*where* the batch is summed (per-shard partial sums, then an all-reduce), never *what* is
computed, so a correct DDP run differs from the reference only by floating-point
reordering. The reference is therefore run a second time on every global batch in
reversed sample order: the same mathematics for any model that treats the batch as a set
(BatchNorm and mean or sum losses included, so their misuse is *not* absorbed into the
floor), summed in another order. Its distance to the reference, step by step and tensor
by tensor, is the reordering noise of this model, dtype and trajectory, including how
the optimizer amplifies it over steps.

The per-tensor tolerance is ``HEADROOM * max(calibrated noise, all-reduce floor)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddparity.trace import KINDS, Trace

HEADROOM = 32.0
"""The calibration run samples *one* reordering; DDP is another. Across our sweep
(``benchmarks/tolerance_sweep.py``: the demo MLP, CNN and transformer block, and MLPs of
three shapes with SGD/Adam/AdamW in float32 and float64, at world sizes 2, 3, 4 and 8)
a correct DDP run came at most 6.1x the calibrated noise (Adam, which divides by the
root of tiny second moments, amplifies reordering most). 32x leaves a 5x margin above
that and stays four to five orders of magnitude below the error of real bugs (a summed
loss is off by a factor of W, a sharded BatchNorm by O(1), a corrupted gradient by its
corruption: measured 1e4 to 5e5 tolerances away)."""


def max_abs(t: Any) -> float:
    return float(t.detach().abs().max()) if t is not None and t.numel() else 0.0


def distance(a: Any, b: Any) -> float:
    """Largest elementwise difference; NaN in the same place counts as equal."""
    import torch

    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    x, y = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    diff = (x - y).abs().masked_fill(both_nan, 0.0)
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


def auto_tolerance(reference: Trace, permuted: Trace, world_size: int, dtype: Any) -> Tolerance:
    """Calibrated tolerance for a run of ``world_size`` ranks against ``reference``."""
    import torch

    eps = torch.finfo(dtype).eps
    table: dict[tuple[int, str, str], float] = {}
    for step, (ref, cal) in enumerate(zip(reference.steps, permuted.steps)):
        for kind in KINDS:
            ref_t, cal_t = ref.tensors(kind), cal.tensors(kind)
            for name, tensor in ref_t.items():
                noise = distance(tensor, cal_t.get(name))
                if noise == float("inf"):
                    noise = 0.0  # shape/None mismatches are not noise
                # Summing W partial results of this size rounds by up to ~W ulps of it.
                floor = world_size * eps * max_abs(tensor)
                table[(step, kind, name)] = HEADROOM * max(noise, floor)
    return Tolerance(f"auto (calibrated noise floor x{HEADROOM:g}, {dtype})", table)


def fixed_tolerance(reference: Trace, relative: float) -> Tolerance:
    """``relative`` times each tensor's largest magnitude; ``0`` demands bit-exactness."""
    table: dict[tuple[int, str, str], float] = {}
    for step, ref in enumerate(reference.steps):
        for kind in KINDS:
            for name, tensor in ref.tensors(kind).items():
                table[(step, kind, name)] = relative * max_abs(tensor)
    return Tolerance(f"fixed relative {relative:g}", table)
