"""The reference's tensors on disk, compared in place: how a check of a large model costs
the replicas' own memory and no more. The folder and its format: :mod:`ddparity.harness.spool_files`.

The reference's :class:`Writer` writes its steps as it trains and keeps only scalars (each
tensor's largest magnitude, the first non-finite value). A tensor whose bytes did not change
since the last step (a version counter misses ``p.data`` updates) points to the bytes
already written. Every other run trains with a
:class:`~ddparity.harness.ranks.comparer.Comparer`, which reads the reference's step (memory-mapped, one tensor at a time)
when it reaches that step — waiting for it if the reference is behind — and keeps one
distance per tensor. The controller receives those numbers only
(:class:`~ddparity.distances.Reference`, :class:`~ddparity.distances.Distances`).

Disk: ``4 B x (2 x parameters + buffers [+ optimizer state: sharded modes]) x steps``, in ``$TMPDIR``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ddparity.distances import RECORD_KINDS, Entry, Reference, distance, max_abs
from ddparity.harness.shards import optimizer_state
from ddparity.harness.spool_files import Stored, mapped

ALIGN = 64


def _as_bytes(t: Any) -> Any:
    """``t``'s elements as a flat CPU uint8 tensor (a view where it already is one)."""
    import torch

    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def gradient(p: Any) -> Any:
    """A parameter's gradient as it is compared: a sparse one (``nn.Embedding(sparse=True)``,
    ``EmbeddingBag``) made dense, so that rows one run touched and another did not differ,
    and every measure of a strided tensor applies. It costs one dense copy of the
    parameter's size while it is written or compared."""
    import torch

    g = p.grad
    return g.to_dense() if g is not None and g.layout != torch.strided else g


def _dtype_name(t: Any) -> str:
    import torch

    dtype = t.dtype if not t.is_quantized else torch.float32
    return str(dtype).removeprefix("torch.")


class Writer:
    """The reference's sink: writes every step to the spool (with ``optimizer_state``, the
    optimizer's: the sharded modes compare it), keeps scalars."""

    def __init__(self, spool: str, optimizer_state: bool = False) -> None:
        self.spool, self.optimizer_state = spool, optimizer_state
        self.reference = Reference()
        self._grads_done = -1
        self._same: dict[tuple[str, str], Stored] = {}  # key -> where its bytes were last written
        self._maps: dict[str, Any] = {}
        self._bad: dict[int, dict[str, tuple[str, float]]] = {}

    def grads(self, step: int, model: Any) -> None:
        self._write(f"g{step}", step, [(("grad", n), gradient(p), False) for n, p in model.named_parameters()], True)
        self._grads_done = step

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        if self._grads_done != step:
            self._write(f"g{step}", step, [], stepped)
        tensors = [(("loss", "loss"), loss, False)]
        tensors += [(("param", n), p, True) for n, p in model.named_parameters()]
        tensors += [(("optimizer", n), t, True) for n, t in optimizer_state(model, self.optimizer_state and optimizer)]
        tensors += [(("buffer", n), b, True) for n, b in model.named_buffers()]
        self._write(f"a{step}", step, tensors, stepped)
        self.reference.stepped.append(stepped)

    def _write(self, stem: str, step: int, tensors: list[tuple[tuple[str, str], Any, bool]], stepped: bool) -> None:
        while len(self.reference.steps) <= step:
            self.reference.steps.append({})
        entries = self.reference.steps[step]
        manifest: list[Stored] = []
        offset = 0
        path = os.path.join(self.spool, stem)
        with open(path + ".bin.tmp", "wb") as f:
            for key, t, persistent in tensors:
                kind, name = key
                if t is None:
                    manifest.append(Stored(kind, name, None))
                    entries[key] = Entry(0.0, False)
                    continue
                value = max_abs(t)
                entries[key] = Entry(value, t.is_floating_point() or t.is_complex())
                if kind != "buffer" and not (value < float("inf")):  # NaN or inf (buffers may hold -inf masks)
                    self._bad.setdefault(step, {}).setdefault(kind, (name, _first_non_finite(t)))
                kept = self._same.get(key) if persistent and not t.requires_grad else None
                if kept is not None and distance(mapped(self.spool, kept, self._maps), t) == 0.0:
                    manifest.append(kept)  # a frozen parameter or a buffer unchanged: the bytes already written
                    continue
                raw = _as_bytes(t)
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                if raw.numel():
                    f.write(raw.numpy().data)
                entry = Stored(kind, name, _dtype_name(t), list(t.shape), stem, offset, int(raw.numel()))
                offset += int(raw.numel())
                manifest.append(entry)
                if persistent:
                    self._same[key] = entry
        self._maps.clear()
        os.replace(path + ".bin.tmp", path + ".bin")
        with open(path + ".json.tmp", "w") as f:
            json.dump({"stepped": stepped, "tensors": manifest}, f)
        os.replace(path + ".json.tmp", path + ".json")

    def finish(self) -> Reference:
        """The reference summarised: entries in comparison order, the first non-finite value."""
        ref = self.reference
        ref.steps = [{k: e[k] for kind in RECORD_KINDS for k in e if k[0] == kind} for e in ref.steps]
        ref.non_finite = next(((step, kind, *self._bad[step][kind]) for step in sorted(self._bad)
                               for kind in RECORD_KINDS if kind in self._bad[step]), None)
        ref.params = sum(1 for k in ref.steps[0] if k[0] == "param") if ref.steps else 0
        self._same.clear()
        return ref


def _first_non_finite(t: Any) -> float:
    import torch

    flat = t.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    return float(flat[bad][0].real) if bool(bad.any()) else float("nan")


class NoSink:
    """Records nothing (the profile's timed passes, a re-run that names random draws)."""

    def grads(self, step: int, model: Any) -> None:
        """Nothing."""

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        """Nothing."""

