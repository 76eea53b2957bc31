"""What a run records: per step, the loss and every gradient, parameter and buffer.

Tensors are CPU copies, so a trace is plain data that crosses process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RECORD_KINDS = ("loss", "grad", "param", "buffer")
"""The order in which one step's records are compared: the first that differs names the
kind of divergence (a wrong loss explains wrong gradients, which explain wrong params)."""


def _pack(t: Any) -> Any:
    """A CPU tensor as (dtype name, shape, raw bytes): pickles as one memcpy, where a
    tensor's own pickling goes through torch.save per storage (0.1 ms each; a trace holds
    thousands)."""
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse or t.is_quantized:
        return t
    flat = t.detach().contiguous().reshape(-1)
    return _Packed(str(flat.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes())


@dataclass(frozen=True, slots=True)
class _Packed:
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def unpack(self) -> Any:
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)


def _unpack(v: Any) -> Any:
    return v.unpack() if isinstance(v, _Packed) else v


_TENSOR_FIELDS = ("loss", "loss_scale")
_DICT_FIELDS = ("grads", "params", "buffers", "grad_scales")


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
    stepped: bool = True
    """Whether the optimizer stepped (a GradScaler skips steps whose gradients overflowed);
    ``grads`` is empty when it did not."""

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

    def __getstate__(self) -> dict[str, Any]:
        state = {name: _pack(getattr(self, name)) for name in _TENSOR_FIELDS}
        for name in _DICT_FIELDS:
            state[name] = {k: _pack(v) for k, v in getattr(self, name).items()}
        state["stepped"] = self.stepped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in _TENSOR_FIELDS:
            setattr(self, name, _unpack(state[name]))
        for name in _DICT_FIELDS:
            setattr(self, name, {k: _unpack(v) for k, v in state[name].items()})
        self.stepped = state.get("stepped", True)


@dataclass
class Trace:
    mode: str
    rank: int
    world_size: int
    steps: list[StepRecord] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    dropout_calls: int = 0
    """The most dropout calls one step made (each given the same mask per sample in every mode)."""
    autocast_dtype: str | None = None
    """The lowest precision autocast computed in ("bfloat16", "float16"), if any."""
