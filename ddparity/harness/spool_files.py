"""A check's spool: the private folder the reference's tensors are written to and read from
in place, and its file format — shared by the controller (which makes the folder and the
initial state), the ranks (the reference writes its steps, every other run compares with
them: :mod:`ddparity.harness.ranks.spool`, :mod:`ddparity.harness.ranks.comparer`) and a
launch's rank 0, which serves the files to other nodes (:mod:`ddparity.harness.launch.refserve`).

In it: ``state.pt``, the initial state every replica loads (memory-mapped: never pickled to
the controller or through a pipe); per step of the reference, ``g<step>`` (the gradients as
its optimizer saw them) and ``a<step>`` (its loss, parameters, optimizer state and buffers
after the step), each a ``.bin`` of raw tensor bytes and a ``.json`` manifest of
:class:`Stored` entries written after it (its presence says the step is complete); ``abort``
once the reference will write no more.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, NamedTuple

from ddparity.harness.janitor import remove_when_gone

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
