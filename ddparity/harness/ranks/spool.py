"""The reference's tensors on disk, compared in place: how a check of a large model costs
the replicas' own memory and no more.

A check owns one :class:`Spool`, a private directory (mode 0700, removed when the check
ends). In it:

* ``state.pt``: the initial state every replica loads (memory-mapped: never pickled to
  the controller or through a pipe);
* per step of the reference, ``g<step>`` (the gradients as its optimizer saw them) and
  ``a<step>`` (its loss, parameters, optimizer state and buffers after the step): a
  ``.bin`` of raw tensor bytes and a ``.json`` manifest written after it (its presence
  says the step is complete). A tensor whose bytes did not change since the last step (a
  version counter misses ``p.data`` updates) points to the bytes already written.

The reference's :class:`Writer` writes them as it trains and keeps only scalars (each
tensor's largest magnitude, the first non-finite value). Every other run trains with a
:class:`~ddparity.harness.ranks.comparer.Comparer`, which reads the reference's step (memory-mapped, one tensor at a time)
when it reaches that step — waiting for it if the reference is behind — and keeps one
distance per tensor. The controller receives those numbers only
(:class:`~ddparity.distances.Reference`, :class:`~ddparity.distances.Distances`).

Disk: ``4 B x (2 x parameters + buffers [+ optimizer state: sharded modes]) x steps``, in ``$TMPDIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, NamedTuple

from ddparity.distances import RECORD_KINDS, Entry, Reference, distance, max_abs
from ddparity.harness.janitor import remove_when_gone
from ddparity.harness.shards import optimizer_state

ALIGN = 64
PREFIX = "ddparity-spool-"
STATE = "state.pt"
ABORT = "abort"


class Stored(NamedTuple):
    """One tensor of a step file's ``.json`` manifest (written as a JSON list, in this order;
    read back with :meth:`read`)."""

    kind: str
    name: str
    dtype: str | None
    """``None``: no tensor (a parameter without a gradient); the rest is then left out."""
    shape: list[int] | tuple[int, ...] = ()
    stem: str = ""
    """The ``.bin`` file holding the bytes (an earlier step's, for bytes unchanged since)."""
    offset: int = 0
    nbytes: int = 0

    @staticmethod
    def read(manifest: list[list[Any]]) -> list[Stored]:
        return [Stored(*entry) for entry in manifest]


class ReferenceFailed(RuntimeError):
    """The reference stopped (its run failed, or the check ended) before the step a run waits for."""


class Spool:
    """The controller's handle on one check's spool directory (``janitor``: also removed
    should this process die without removing it)."""

    def __init__(self, parent: str | None = None, janitor: bool = False) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)  # 0700; the pid tells leftovers apart
        if janitor:
            remove_when_gone(self.path)

    def abort(self) -> None:
        """Tell runs waiting for the reference that it will not come."""
        with open(os.path.join(self.path, ABORT), "w"):
            pass

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_state(spool: str, state: dict[str, Any]) -> None:
    import torch

    tmp = os.path.join(spool, STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(spool, STATE))


def fits_the_spool(steps: int, state: dict[str, Any], spool: str) -> None:
    """A CaseError, before anything trains, when the reference's steps cannot fit on the
    spool's file system: each step keeps the gradients and the state after it, about
    twice the initial state."""
    from ddparity.errors import CaseError

    per_step = 2 * sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "element_size"))
    need, free = steps * per_step, shutil.disk_usage(spool).free
    if need > free:
        raise CaseError(
            f"{steps} steps need about {_size(need)} for the reference's steps ({_size(per_step)} a step: its "
            f"gradients and state) in {os.path.dirname(spool)}, which has {_size(free)} free: check fewer steps "
            "(a broken data-parallel setup shows in the first few; --steps), or point TMPDIR at a larger disk"
        )


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def load_state(spool: str) -> dict[str, Any]:
    """The initial state, memory-mapped (the pages are shared by every replica that loads it)."""
    import torch

    return torch.load(os.path.join(spool, STATE), mmap=True, weights_only=False, map_location="cpu")


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


def mapped(spool: str, entry: Stored, maps: dict[str, Any]) -> Any:
    """The tensor a manifest entry describes, read in place from its file (``maps``: the
    files mapped so far, by name)."""
    return typed(entry, mapped_bytes(spool, entry, maps))


def mapped_bytes(spool: str, entry: Stored, maps: dict[str, Any]) -> Any:
    """A manifest entry's raw bytes (a uint8 tensor), mapped from its file."""
    import torch

    stem, offset, nbytes = entry.stem, entry.offset, entry.nbytes
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    if stem not in maps:
        path = os.path.join(spool, stem + ".bin")
        maps[stem] = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    return maps[stem][offset : offset + nbytes]


def typed(entry: Stored, raw: Any) -> Any:
    """A manifest entry's tensor, given its raw bytes."""
    import torch

    dtype = getattr(torch, str(entry.dtype))
    if not raw.numel():
        return torch.empty(entry.shape, dtype=dtype)
    return raw.view(dtype).reshape(entry.shape)


class NoSink:
    """Records nothing (the profile's timed passes, a re-run that names random draws)."""

    def grads(self, step: int, model: Any) -> None:
        """Nothing."""

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        """Nothing."""

