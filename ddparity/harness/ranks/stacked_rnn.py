"""Stacked RNNs with inter-layer dropout, run for a check as the identical stack of one-layer
RNNs with ddparity's aligned dropout between the layers.

``nn.LSTM(..., num_layers=2, dropout=0.2)`` draws its inter-layer dropout masks inside torch's
fused RNN kernel, from torch's global generator: every mode and rank would draw other masks
for the same sample. torch's fused kernel (``_VF.lstm`` and friends, on CPU) runs its layers
one after another and applies ``dropout(layer output, p, train)`` between them; so does
:func:`_stacked_forward`, one ``_VF`` call per layer on the module's own weights (the same
parameters, names and state), with ``torch.nn.functional.dropout`` between the layers, which
ddparity aligns per sample (:mod:`ddparity.harness.ranks.randomness`). At dropout 0 the
outputs and gradients equal the fused module's bit for bit (tested); with the same masks,
the same result. Only in training, only on tensors: a ``PackedSequence`` keeps the fused
kernel (its draws are then found and named, as before).
"""

from __future__ import annotations

from typing import Any

STACKED = "_ddparity_stacked"
"""The attribute a module run as a stack carries."""
FUSED_DRAW = "_ddparity_fused_draw"
"""Set on a stacked module that ran torch's fused kernel with its dropout on (a PackedSequence)."""


def stack_rnns(model: Any) -> list[str]:
    """Run every RNN of ``model`` with inter-layer dropout as a stack (its class swapped for a
    subclass whose forward is :func:`_stacked_forward`, everything else the module's own);
    the names of those RNNs."""
    from torch import nn

    names = []
    for name, module in model.named_modules():
        if (isinstance(module, nn.RNNBase) and type(module) in (nn.LSTM, nn.GRU, nn.RNN) and module.num_layers > 1
                and module.dropout):
            module.__class__ = _stacked_class(type(module))
            setattr(module, STACKED, True)
            names.append(name or "the model")
    return names


_CLASSES: dict[type, type] = {}


def _stacked_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"forward": _stacked_forward, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def _stacked_forward(self: Any, input: Any, hx: Any = None) -> Any:  # noqa: A002 - torch's own argument name
    from torch import nn
    from torch.nn.utils.rnn import PackedSequence

    # torch's own class (FSDP2 puts a class of its own in front of ours)
    fused = next(c for c in type(self).__mro__ if c in (nn.LSTM, nn.GRU, nn.RNN)).forward
    if isinstance(input, PackedSequence) or not (self.training and self.dropout and self.num_layers > 1):
        if self.training and self.dropout and self.num_layers > 1:
            setattr(self, FUSED_DRAW, True)  # torch's kernel draws its masks: named if a draw is found
        return fused(self, input, hx)
    return layer_by_layer(self, input, hx, self.dropout)


def layer_by_layer(self: Any, input: Any, hx: Any, dropout: float) -> Any:  # noqa: A002 - torch's argument name
    """What the fused kernel computes in training (tensors only), one layer at a time, with
    ``torch.nn.functional.dropout(p=dropout)`` between the layers."""
    import torch
    import torch.nn.functional as F
    from torch import _VF

    lstm = self.mode == "LSTM"
    unbatched = input.dim() == 2
    if unbatched:
        input = input.unsqueeze(0 if self.batch_first else 1)
        if hx is not None:
            hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1)) if lstm else hx.unsqueeze(1)
    dirs = 2 if self.bidirectional else 1
    batch = input.shape[0 if self.batch_first else 1]
    if hx is None:
        out_size = self.proj_size if lstm and self.proj_size > 0 else self.hidden_size
        h0 = torch.zeros(self.num_layers * dirs, batch, out_size, dtype=input.dtype, device=input.device)
        hx = (h0, torch.zeros(self.num_layers * dirs, batch, self.hidden_size, dtype=input.dtype,
                              device=input.device)) if lstm else h0
    per = len(self._flat_weights) // self.num_layers
    output, last_h, last_c = input, [], []
    for layer in range(self.num_layers):
        if layer:
            output = F.dropout(output, dropout, True)
        weights = self._flat_weights[layer * per:(layer + 1) * per]
        here = slice(layer * dirs, (layer + 1) * dirs)
        if lstm:
            output, h, c = _VF.lstm(output, (hx[0][here], hx[1][here]), weights, self.bias, 1, 0.0, True,
                                    self.bidirectional, self.batch_first)
            last_c.append(c)
        else:
            run = {"GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}[self.mode]
            output, h = run(output, hx[here], weights, self.bias, 1, 0.0, True, self.bidirectional,
                            self.batch_first)
        last_h.append(h)
    h_n = torch.cat(last_h, 0)
    state: Any = (h_n, torch.cat(last_c, 0)) if lstm else h_n
    if unbatched:
        output = output.squeeze(0 if self.batch_first else 1)
        state = (state[0].squeeze(1), state[1].squeeze(1)) if lstm else state.squeeze(1)
    return output, state
