"""A step's batch as a nest of tensors: its paths, its size (the dim 0 its tensors share),
each rank's shard of it, its valid entries per sample, on a device in the case's dtype.
Used by the training loop and the dropout alignment alike (a leaf of the rank side)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from ddparity.case import Batched, Case, Whole
from ddparity.errors import CaseError


def map_tensors(obj: Any, fn: Any, whole: Callable[[Any], Any] = lambda w: w,
                batched: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` with ``fn`` applied to every batched tensor and ``whole`` to every
    :class:`~ddparity.case.Whole` (kept as is unless told); a :class:`~ddparity.case.Batched`
    has ``fn`` applied to its batch-major tensor and stays marked, unless ``batched`` says
    what it becomes."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Whole):
        return whole(obj)
    if isinstance(obj, Batched):
        return batched(obj) if batched is not None else Batched(fn(obj.tensor), obj.dim)
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn, whole, batched) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(o, fn, whole, batched) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn, whole, batched)) for k, v in obj.items())
    return obj


def batch_dims(obj: Any) -> set[int]:
    """The dimensions the batch's tensors are batched along: 0, and each
    :class:`~ddparity.case.Batched`'s."""
    dims = {0}
    map_tensors(obj, lambda t: t, batched=lambda b: dims.add(b.dim))
    return dims


def named_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """Every tensor of a nest that may be batched (not :class:`~ddparity.case.Whole`), with its path."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Batched):
        yield path, obj.tensor  # batch-major
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from named_tensors(o, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from named_tensors(v, f"{path}[{k!r}]")


def batch_size(obj: Any, step: int = 0) -> int | None:
    """The global batch size of a batch: the dim 0 most of its tensors share. Tensors with
    another dim 0 are not batched (every replica gets them whole); a tie between sizes
    cannot be decided and is a :class:`CaseError` naming the tensors."""
    sized = [(path, int(t.shape[0])) for path, t in named_tensors(obj) if t.dim()]
    if not sized:
        return None
    counts = Counter(size for _, size in sized).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        tied = {size for size, n in counts if n == counts[0][1]}
        named = ", ".join(f"{path} (dim 0 = {size})" for path, size in sized if size in tied)
        raise CaseError(
            f"cannot tell the batch size of step {step}'s batch: {named} are as many of each size; wrap the tensors "
            f"that are not batched in ddparity.whole(...) so that every replica gets them whole"
        )
    return counts[0][0]


IGNORE_INDEX = -100
"""torch's (and transformers') label for an entry a loss leaves out."""


def valid_counts(batch: Any) -> dict[str, list[int]]:
    """Per sample, the entries a loss averaged over valid entries counts: labels that are
    not ``IGNORE_INDEX`` (batched integer tensors that have some), and the ones of a 0/1
    mask (a batched tensor whose path names a mask). For the likely cause of a per-rank
    normalisation."""
    import torch

    size = batch_size(batch)
    labels: dict[str, list[int]] = {}
    masks: dict[str, list[int]] = {}
    for path, t in named_tensors(batch):
        if t.dim() < 2 or t.shape[0] != size or t.is_floating_point() or t.dtype == torch.bool:
            continue
        if bool((t == IGNORE_INDEX).any()):
            labels[path] = (t != IGNORE_INDEX).reshape(size, -1).sum(1).tolist()
        elif "mask" in path.lower() and bool(((t == 0) | (t == 1)).all()) and not bool(t.all()):
            masks[path] = t.reshape(size, -1).sum(1).tolist()
    return labels | masks  # labels first: what a loss counts


def shard(obj: Any, rank: int, world_size: int, size: int | None = None) -> Any:
    """Rank ``rank``'s contiguous, equal share of every batched tensor (dim 0 = ``size``,
    the global batch size; every tensor with a dim 0 when ``size`` is None)."""

    def cut(t: Any) -> Any:
        if t.dim() == 0 or (size is not None and t.shape[0] != size):
            return t
        per = t.shape[0] // world_size
        return t[rank * per : (rank + 1) * per]

    return map_tensors(obj, cut)


def reverse_samples(obj: Any, size: int) -> Any:
    """The same batch in reversed sample order (tensors whose dim 0 is the batch)."""
    return map_tensors(obj, lambda t: t.flip(0) if t.dim() and t.shape[0] == size else t)


def cast(batch: Any, case: Case, device: str) -> Any:
    """The batch on ``device``, floating tensors in the case's dtype, :class:`~ddparity.case.Whole` unwrapped,
    a :class:`~ddparity.case.Batched` given its batch back at its own dimension."""

    def move(t: Any) -> Any:
        t = t.to(device)
        return t.to(case.torch_dtype) if t.is_floating_point() else t

    return map_tensors(batch, move, lambda w: move(w.tensor), lambda b: move(b.tensor).movedim(0, b.dim))
