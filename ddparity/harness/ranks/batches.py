"""A step's batch as a nest of tensors: its paths, its size (the dim 0 its tensors share),
each rank's shard of it, its valid entries per sample, on a device in the case's dtype.
Used by the training loop and the dropout alignment alike (a leaf of the rank side)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from ddparity.case import Batched, Case, Samples, Whole
from ddparity.errors import CaseError


def map_tensors(obj: Any, fn: Any, whole: Callable[[Any], Any] = lambda w: w,
                batched: Callable[[Any], Any] | None = None, samples: Callable[[Any], Any] = lambda s: s) -> Any:
    """``obj`` with ``fn`` applied to every batched tensor and ``whole`` to every
    :class:`~ddparity.case.Whole` (kept as is unless told); a :class:`~ddparity.case.Batched`
    has ``fn`` applied to its batch-major tensor and stays marked, unless ``batched`` says
    what it becomes; ``samples`` is applied to every :class:`~ddparity.case.Samples` (a list
    of samples, kept as is unless told: its tensors are items, not batches)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Whole):
        return whole(obj)
    if isinstance(obj, Batched):
        return batched(obj) if batched is not None else Batched(fn(obj.tensor), obj.dim)
    if isinstance(obj, Samples):
        return samples(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn, whole, batched, samples) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(o, fn, whole, batched, samples) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn, whole, batched, samples)) for k, v in obj.items())
    return obj


def sample_lists(obj: Any) -> list[tuple[str, int]]:
    """Every :class:`~ddparity.case.Samples` of a nest, by path, with its length."""
    found: list[tuple[str, int]] = []

    def walk(o: Any, path: str) -> None:
        if isinstance(o, Samples):
            found.append((path, len(o.items)))
        elif isinstance(o, (tuple, list)):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{path}[{k!r}]")

    walk(obj, "batch")
    return found


def batch_dims(obj: Any) -> set[int]:
    """The dimensions the batch's tensors are batched along: 0, and each
    :class:`~ddparity.case.Batched`'s."""
    dims = {0}
    map_tensors(obj, lambda t: t, batched=lambda b: dims.add(b.dim))
    return dims


def named_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """Every tensor of a nest that may be batched (not :class:`~ddparity.case.Whole`, not an
    item of :class:`~ddparity.case.Samples`), with its path."""
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
    lists = sample_lists(obj)
    if lists:  # said by the user: the lists of samples set the size
        size = lists[0][1]
        if any(n != size for _, n in lists):
            raise CaseError(f"the lists of samples of step {step}'s batch differ in length: "
                            f"{', '.join(f'{path} ({n} items)' for path, n in lists)}; ddparity.samples(...) marks a "
                            f"list with one item per sample of the batch")
        return size
    sized = [(path, int(t.shape[0])) for path, t in named_tensors(obj) if t.dim()]
    if not sized:
        return None
    counts = Counter(size for _, size in sized).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        tied = {size for size, n in counts if n == counts[0][1]}
        named = ", ".join(f"{path} (dim 0 = {size})" for path, size in sized if size in tied)
        raise CaseError(
            f"cannot tell the batch size of step {step}'s batch: {named} are as many of each size; wrap the tensors "
            f"that are not batched in ddparity.whole(...) so that every replica gets them whole, or a list with one "
            f"item per sample (images, target dicts) in ddparity.samples(...)"
        )
    return counts[0][0]


def layout(batch: Any, size: int | None) -> str:
    """How a batch is cut per rank, said by its tensors' paths: those whose dim 0 is the
    batch size ``size`` (cut, and reversed by the calibration twin), those every rank gets
    whole, and the lists of samples."""
    cut = [path for path, t in named_tensors(batch) if t.dim() and t.shape[0] == size]
    whole = [f"{path} (dim 0 = {t.shape[0]})" if t.dim() else f"{path} (0-d)"
             for path, t in named_tensors(batch) if not (t.dim() and t.shape[0] == size)]
    parts = [f"cut along dim 0 = {size}: {', '.join(cut)}" if cut else "", f"given whole: {', '.join(whole)}" if whole else "",
             f"lists of samples: {', '.join(path for path, _ in sample_lists(batch))}" if sample_lists(batch) else ""]
    return "; ".join(p for p in parts if p)


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

    def cut_list(s: Samples) -> Samples:
        per = len(s.items) // world_size
        return Samples(s.items[rank * per : (rank + 1) * per])

    return map_tensors(obj, cut, samples=cut_list)


def reverse_samples(obj: Any, size: int) -> Any:
    """The same batch in reversed sample order (tensors whose dim 0 is the batch)."""
    return map_tensors(obj, lambda t: t.flip(0) if t.dim() and t.shape[0] == size else t,
                       samples=lambda s: Samples(s.items[::-1]))


def cast(batch: Any, case: Case, device: str) -> Any:
    """The batch on ``device``, floating tensors in the case's dtype, :class:`~ddparity.case.Whole` unwrapped,
    a :class:`~ddparity.case.Batched` given its batch back at its own dimension, a
    :class:`~ddparity.case.Samples` a plain list. For the built-in step, inputs that are a
    list of samples become the model's one argument (``model(images)``, where a plain list of
    inputs is its positional arguments)."""

    def move(t: Any) -> Any:
        t = t.to(device)
        return t.to(case.torch_dtype) if t.is_floating_point() else t

    def unwrapped(obj: Any) -> Any:
        return map_tensors(obj, move, lambda w: move(w.tensor), lambda b: move(b.tensor).movedim(0, b.dim),
                           lambda s: unwrapped(s.items))

    if case.train_step is None and isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Samples):
        return ((unwrapped(batch[0]),), *(unwrapped(rest) for rest in batch[1:]))
    return unwrapped(batch)
