"""Which samples a forward's rows are: what aligned dropout and stochastic depth draw for
(:mod:`ddparity.harness.ranks.randomness`). A forward called on a slice of the replica's
share (a micro-batch, DataParallel's chunks) is matched to its rows through the storage the
slice views; a forward on the whole share, or on a ``ddparity.samples`` list, has them all.
A forward on copies of the share's rows (a collator's ``v[idx]``) is told by the rows they
equal (:func:`copied_rows`); one whose input is computed from the share (a noised
micro-batch) by its content among the reference's forwards, after the run (:func:`content`,
:func:`rows_by_content`)."""

from __future__ import annotations

from typing import Any


def rows_of(rows: Any, sources: list[Any], dims: list[int], inputs: list[Any]) -> Any:
    """The samples of a forward's rows: a slice of the share (``rows``: the global index of
    each of its rows; ``sources``: its batched tensors; ``dims``: the dimensions it is batched
    along), matched by the storage the slice views, or the whole share; None when its
    ``inputs`` say neither."""
    import torch

    from ddparity.harness.ranks.batches import named_tensors

    if rows is None:
        return None
    first = None
    for _, t in named_tensors(inputs):
        if not t.dim():
            continue
        first = first if first is not None else t
        part = slice_of(len(rows), sources, t)
        if part is not None:
            return rows[part]
    if isinstance(first, torch.Tensor) and any(first.dim() > d and first.shape[d] == len(rows)
                                               for d in dims):
        return rows
    if any(_holds_sample_list(given, len(rows)) for given in inputs):  # ddparity.samples(...): one item per row
        return rows  # (an argument that is such a list, not the arguments themselves)
    copied = copied_rows(len(rows), sources, first) if isinstance(first, torch.Tensor) else None
    return rows[copied] if copied is not None else None


def copied_rows(size: int, sources: list[Any], t: Any) -> Any:
    """The rows of the share (``size`` rows; ``sources``: its batched tensors) that ``t``'s
    rows are copies of (a micro-batch a collator indexed, ``v[idx]``), each equal to exactly
    one row of one source; None where a row equals none, or several (duplicate samples,
    which no copy can tell apart)."""
    import torch

    if not t.dim() or not t.shape[0] or t.shape[0] > size or t.layout != torch.strided:
        return None
    mine = t.detach().reshape(t.shape[0], -1).to("cpu", torch.float64)
    for src in sources:
        if src.dtype != t.dtype or src.shape[1:] != t.shape[1:] or src.layout != torch.strided:
            continue
        theirs = src.detach().reshape(size, -1).to("cpu", torch.float64)
        same = torch.cdist(mine, theirs, compute_mode="donot_use_mm_for_euclid_dist") == 0
        if bool((same.sum(dim=1) == 1).all()):
            return same.int().argmax(dim=1)
    return None


def slice_of(size: int, sources: list[Any], t: Any) -> slice | None:
    """The rows of the share (``size`` rows; ``sources``: its batched tensors) that ``t``
    views along dim 0 (a micro-batch: ``x[a:b]``, ``x.chunk(k)``), matched by storage; None
    where it views none of them so."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.dim() or t.layout != torch.strided:
        return None
    for src in sources:
        if (src.layout == torch.strided and t.dim() == src.dim() and t.stride(0) == src.stride(0) and src.stride(0)
                and t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()):
            offset, rest = divmod(t.storage_offset() - src.storage_offset(), src.stride(0))
            if rest == 0 and 0 <= offset and offset + t.shape[0] <= size:
                return slice(offset, offset + t.shape[0])
    return None


def content(inputs: list[Any]) -> Any:
    """A forward's rows as one float64 matrix (row ``i``: every tensor of its arguments whose
    dim 0 is the batch's, its row ``i``, flattened), on the CPU; None where it has no tensor
    with rows. The batch's dim 0 is the one the most elements share (a mask of one row given
    beside the images is no batch)."""
    import torch

    from ddparity.harness.ranks.batches import named_tensors

    batched = [t for _, t in named_tensors(inputs) if t.dim() and t.layout == torch.strided]
    if not batched:
        return None
    sizes: dict[int, int] = {}
    for t in batched:
        sizes[t.shape[0]] = sizes.get(t.shape[0], 0) + t.numel()
    n = max(sizes, key=lambda k: sizes[k])
    parts = [(torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).reshape(n, -1).to("cpu", torch.float64)
             for t in batched if t.shape[0] == n]
    return torch.cat(parts, dim=1) if n else None


SAME_ROW = 1e-6
"""Two rows are the same sample's where they differ by at most this, relative to their size
(computed alike from the same sample, they are equal to the bit; rounding aside)."""


def rows_by_content(mine: Any, theirs: list[Any]) -> tuple[int, Any] | None:
    """Which of the forwards ``theirs`` (each's :func:`content`, or None) holds every row of
    ``mine``, and where each row is in it (the nearest row, within :data:`SAME_ROW`); None
    where none holds all of them, or more than one does (rows that tell no sample apart: a
    mask shared by every forward)."""
    import torch

    if mine is None or not len(mine):
        return None
    found = []
    for g, ref in enumerate(theirs):
        if ref is None or ref.dim() != 2 or ref.shape[1] != mine.shape[1] or not len(ref):
            continue
        gap, at = torch.cdist(mine, ref).min(dim=1)
        scale = mine.norm(dim=1).clamp_min(1.0)
        if bool((gap <= SAME_ROW * scale).all()):
            found.append((g, at))
    return found[0] if len(found) == 1 else None


def _holds_sample_list(obj: Any, size: int) -> bool:
    """Whether a forward's arguments hold a list of ``size`` items that hold tensors (the
    share of a ``ddparity.samples`` list, as the model receives it)."""
    from ddparity.harness.ranks.batches import named_tensors

    if isinstance(obj, list) and len(obj) == size and all(next(named_tensors(o), None) is not None for o in obj):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_holds_sample_list(o, size) for o in obj)
    if isinstance(obj, dict):
        return any(_holds_sample_list(o, size) for o in obj.values())
    return False
