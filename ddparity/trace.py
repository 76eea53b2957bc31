"""What a run records: per step, the loss and every gradient, parameter and buffer.

Tensors are CPU copies, so a trace is plain data that crosses process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("loss", "grad", "param", "buffer")
"""The order in which one step's records are compared: the first that differs names the
kind of divergence (a wrong loss explains wrong gradients, which explain wrong params)."""


@dataclass
class StepRecord:
    loss: Any  # 0-d tensor: the loss the run optimised this step (global mean for DDP)
    grads: dict[str, Any] = field(default_factory=dict)  # name -> tensor or None
    params: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    # Calibration twin only: mean |loss| and |gradient| of the samples (or shards) DDP sums (the terms'
    # size bounds the rounding of their sum; see checks/tolerance.py). None when unknown.
    loss_scale: Any = None
    grad_scales: dict[str, Any] = field(default_factory=dict)

    def scale(self, kind: str, name: str) -> Any:
        """What rounding of this record scales with: its summands where known, else itself."""
        if kind == "loss" and self.loss_scale is not None:
            return self.loss_scale
        if kind == "grad" and name in self.grad_scales:
            return self.grad_scales[name]
        return self.tensors(kind).get(name)

    def tensors(self, kind: str) -> dict[str, Any]:
        if kind == "loss":
            return {"loss": self.loss}
        return {"grad": self.grads, "param": self.params, "buffer": self.buffers}[kind]


@dataclass
class Trace:
    mode: str
    rank: int
    world_size: int
    steps: list[StepRecord] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
