"""Where a rank's record of a step first differs from the reference's
(:mod:`ddparity.harness.ranks.tracing` records both).

:func:`first_difference` reads a rank's record against the reference's: a rank's tensor
batched along some dim is compared with the reference's rows for the same samples, any other
whole (but a scalar, a loss, which is over a rank's own samples); a rank's activation
gradients are those of its own loss, which data parallelism averages over the W ranks, so
they are compared x 1/W (DataParallel's replicas, whose gathered loss is the reference's: as
they are). Each error is relative, against a calibrated tolerance: the reference's own
distance from a run on the same batch in reversed sample order (its rounding noise, module by
module) x :data:`NOISE_FACTOR`, never below :data:`FLOOR_EPS` x the dtype's epsilon. Forward
first, then backward from the loss; :func:`first_op` inside a module call;
:func:`backward_order` the modules in the order backward reached them (the controller reads
the parameters' gradients from the run's own distances in that order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ddparity.harness.ranks.forward_rows import rows_by_content
from ddparity.verdicts import ModuleFinding

NOISE_FACTOR = 10.0
"""A tensor differs beyond this many times the reference's own rounding noise on it."""
FLOOR_EPS = 16.0
"""... and beyond this many times its dtype's machine epsilon (noise measured at zero)."""
LOSS_GRAD = "the loss's gradient"


def first_op(ref_ops: list[tuple[str, list[Any]]], my_ops: list[tuple[str, list[Any]]], rows: Any, size: int,
             tol: float) -> tuple[str, float | None, str]:
    """Inside a differing module's call: the first aten op whose output differs beyond ``tol``
    (its name, its error, ""), where the op sequences match; else ("", None, why not)."""
    if [n for n, _ in ref_ops] != [n for n, _ in my_ops]:
        return "", None, f"its op sequences differ ({len(my_ops)} ops on the rank, {len(ref_ops)} on the reference)"
    for (name, mine), (_, theirs) in zip(my_ops, ref_ops):
        e = errors(mine, theirs, rows, size)
        if e is not None and e > tol:
            return name, e, ""
    return "", None, "no op's output differs alone"




def aligned(mine: Any, ref: Any, rows: Any, size: int) -> tuple[Any, Any, bool] | None:
    """The rank's tensor, the reference's part for the same samples and whether it is rows:
    where a dim of the rank's has this rank's samples (``rows``) and the same dim of the
    reference's the global batch (``size``), every other dim alike, the reference's rows;
    else both whole where their shapes agree; None otherwise."""
    if rows is not None and mine.dim() == ref.dim():
        for d in range(mine.dim()):
            if (mine.shape[d] == len(rows) and ref.shape[d] == size
                    and all(mine.shape[k] == ref.shape[k] for k in range(mine.dim()) if k != d)):
                return mine, ref.index_select(d, rows), True
    if mine.shape == ref.shape:
        return mine, ref, False
    return None


def rel(mine: Any, ref: Any) -> float:
    """||mine - ref|| / ||ref|| in float64 (inf where only one is finite, or ref is zero and mine is not)."""
    import torch

    a, b = mine.double(), ref.double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    finite = torch.isfinite(b)
    a, b = a[finite], b[finite]
    diff, norm = float((a - b).norm()), float(b.norm())
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def factor(mine: Any, ref: Any) -> float | None:
    """The least-squares ``c`` of ``mine ~ c * ref`` (None where ref is zero or non-finite)."""
    a, b = mine.double().flatten(), ref.double().flatten()
    den = float((b * b).sum())
    num = float((a * b).sum())
    return num / den if den and math.isfinite(num / den) else None


def tolerance(noise: float, dtype: Any) -> float:
    import torch

    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return max(NOISE_FACTOR * noise, FLOOR_EPS * eps)


def errors(mine: list[Any], ref: list[Any], rows: Any, size: int, scale: float = 1.0,
           batched_only: bool = False) -> float | None:
    """The largest error of ``mine`` against ``ref`` (tensors by position); ``scale`` multiplies a rank's batched tensors; ``batched_only``: only those (a
    gradient w.r.t. a whole tensor is a partial sum on a rank). None: nothing comparable."""
    found: list[float] = []
    for m, r in zip(mine, ref):
        if m.dim() == 0:  # a scalar of a rank's (its loss, a batch mean) is over its own samples
            continue
        pair = aligned(m, r, rows, size)
        if pair is None or (batched_only and not pair[2]):
            continue
        a, b, is_rows = pair
        found.append(rel(a * scale if is_rows else a, b))
    return max(found) if found else None


def _by_key(record: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(c["name"], c["index"]): c for c in record["calls"]}


def _grads(call: dict[str, Any], which: str) -> list[Any]:
    got = call[which]
    return [got[j] for j in sorted(got)]


Match = Callable[[dict[str, Any]], "tuple[tuple[str, int], Any, int]"]
"""A call of a run's record -> (the reference's call it is compared with, the rows of that
call's batch its samples are, that batch's size)."""


def noise_of(ref: dict[str, Any], twin: dict[str, Any], rows: Any, size: int) -> dict[str, float]:
    """The reference's own rounding noise per tensor group: a run on the same batch in
    reversed sample order (``rows``) against it (a micro-batch's call against the reference's
    call on the same samples)."""
    out: dict[str, float] = {}
    calls = _by_key(ref)
    match = same_samples(ref, twin, rows, size)
    for c in twin["calls"]:
        key, at, n = match(c)
        r = calls.get(key)
        if r is None:
            continue
        for what, name in (("outputs", "out"), ("inputs", "in"), ("out_grads", "gout"), ("in_grads", "gin")):
            mine = c[what] if what in ("outputs", "inputs") else _grads(c, what)
            theirs = r[what] if what in ("outputs", "inputs") else _grads(r, what)
            e = errors(mine, theirs, at, n)
            if e is not None and math.isfinite(e):
                out[f"{name} {key[0]}#{key[1]}"] = e
    return out


def same_samples(ref: dict[str, Any], mine: dict[str, Any], rows: Any, size: int) -> Match:
    """A data-parallel rank's calls (``rows``: its share's samples of a global batch of
    ``size``): each the reference's call of the same module and number, on this rank's
    samples; where the step's forwards are micro-batches (each a slice of the share, told by
    the tracer, or computed from it, found by content), the reference's call of the same
    module, at the same place in its forward, in the forward that holds the same samples."""
    keys = {(c["name"], c.get("forward", -1), c.get("within", 0)): (c["name"], c["index"]) for c in ref["calls"]}
    places = forward_places(ref, mine)

    def match(c: dict[str, Any]) -> tuple[tuple[str, int], Any, int]:
        f = c.get("forward", -1)
        there = places[f] if 0 <= f < len(places) else None
        key = keys.get((c["name"], there[0], c.get("within", 0))) if there is not None else None
        if there is None or key is None:
            return (c["name"], c["index"]), rows, size
        return key, there[1], there[2]

    return match


def forward_places(ref: dict[str, Any], mine: dict[str, Any]) -> list[tuple[int, Any, int] | None]:
    """Each of ``mine``'s forwards: the reference's forward that holds all of its samples,
    their rows in it and its size; None where its samples are split over several or found in
    none. Samples told by the tracer are looked up by their global index; untold ones (a
    forward on a micro-batch computed from the share: noised, copied) by their content."""
    import torch

    where: dict[int, tuple[int, int]] = {}
    for f, ids in enumerate(ref.get("forwards", [])):
        for p, g in enumerate(ids.tolist() if ids is not None else []):
            where.setdefault(g, (f, p))
    theirs, contents = ref.get("contents", []), mine.get("contents", [])
    out: list[tuple[int, Any, int] | None] = []
    for f, ids in enumerate(mine.get("forwards", [])):
        found = [where.get(g) for g in ids.tolist()] if ids is not None else []
        at = [x for x in found if x is not None]
        if found and len(at) == len(found) and len({x[0] for x in at}) == 1:
            out.append((at[0][0], torch.tensor([p for _, p in at]), len(ref["forwards"][at[0][0]])))
            continue
        by = rows_by_content(contents[f] if f < len(contents) else None, theirs)
        out.append(None if by is None else (by[0], by[1], len(theirs[by[0]])))
    return out


def replica_rows(ref: dict[str, Any], chunks: list[Any], size: int) -> Match:
    """DataParallel's calls in one process: replica ``i``'s calls of a module (its ``k`` calls
    a forward, as the reference's) come ``i``-th, on chunk ``i`` of the batch."""
    per_forward: dict[str, int] = {}
    for c in ref["calls"]:
        per_forward[c["name"]] = per_forward.get(c["name"], 0) + 1

    def match(c: dict[str, Any]) -> tuple[tuple[str, int], Any, int]:
        k = per_forward.get(c["name"], 1)
        replica = c["index"] // k
        return (c["name"], c["index"] % k), chunks[replica] if replica < len(chunks) else None, size

    return match


def first_difference(ref: dict[str, Any], noise: dict[str, float], mine: dict[str, Any], match: Match,
                     scale: float, rank: int, step: int) -> ModuleFinding:
    """The first module call of the rank's step whose inputs agree with the reference's and
    whose output differs (forward, in the order calls finish); else, from the loss back, the
    first whose output gradient agrees and whose input or parameter gradient differs.
    ``match``: a call's reference call and its rows (:func:`same_samples`, :func:`replica_rows`);
    ``scale``: what the rank's activation gradients are multiplied by (1/W under DDP, whose
    ranks' losses are each over their own samples; 1 for DataParallel's gathered loss).
    Where no tensor of the step could be compared (its calls matched to none of the
    reference's samples), phase ``none`` says so in its ``note``: not that every module agrees."""
    calls = _by_key(ref)
    compared = 0
    uncompared: dict[str, str] = {}  # module -> its output's rows against the rank's samples

    def judge(key: str, got: float | None, dtype: Any) -> tuple[float, float, bool] | None:
        """(error, tolerance, beyond it) of one tensor group (None: nothing comparable)."""
        nonlocal compared
        if got is None:
            return None
        compared += 1
        tol = tolerance(noise.get(key, 0.0), dtype)
        return got, tol, got > tol

    for position, c in enumerate(mine["calls"]):
        key, rows, size = match(c)
        r = calls.get(key)
        if r is None or not c["outputs"]:
            continue
        label = f"{key[0]}#{key[1]}"
        got = errors(c["outputs"], r["outputs"], rows, size)
        first = c["outputs"][0]
        if got is None and rows is not None and first.dim() and len(first) != len(rows):
            uncompared.setdefault(c["name"] or "the model", f"{len(first)} rows for {len(rows)} samples")
        out = judge(f"out {label}", got, first.dtype)
        if out is None or not out[2]:
            continue
        inp = judge(f"in {label}", errors(c["inputs"], r["inputs"], rows, size),
                    c["inputs"][0].dtype if c["inputs"] else c["outputs"][0].dtype)
        return ModuleFinding(step=step, rank=rank, phase="forward", module=c["name"], type=c["type"],
                             differs="output", error=out[0], tolerance=out[1], agrees="input",
                             agrees_error=inp[0] if inp is not None else None,
                             agrees_ok=None if inp is None else not inp[2], position=position, call=c["index"])
    for n, position in enumerate(mine["backward"]):
        c = mine["calls"][position]
        key, rows, size = match(c)
        r = calls.get(key)
        if r is None:
            continue
        label = f"{key[0]}#{key[1]}"
        gout = _grads(c, "out_grads")
        dtype = gout[0].dtype if gout else c["outputs"][0].dtype
        got_out = judge(f"gout {label}", errors(gout, _grads(r, "out_grads"), rows, size, scale, batched_only=True),
                        dtype)
        if got_out is not None and got_out[2]:
            if n == 0:  # the first gradient backward made: the loss's
                pairs = [aligned(m, t, rows, size) for m, t in zip(gout, _grads(r, "out_grads"))]
                pair = next((p for p in pairs if p is not None and p[2]), None)
                ratio = factor(pair[0] * scale, pair[1]) if pair is not None else None
                return ModuleFinding(step=step, rank=rank, phase="loss", module=c["name"], type=c["type"],
                                     differs=LOSS_GRAD, error=got_out[0], tolerance=got_out[1], factor=ratio,
                                     position=n)
            return ModuleFinding(step=step, rank=rank, phase="backward", module=c["name"], type=c["type"],
                                 differs="output gradient", error=got_out[0], tolerance=got_out[1], position=n)
        gin = judge(f"gin {label}", errors(_grads(c, "in_grads"), _grads(r, "in_grads"), rows, size, scale,
                                           batched_only=True), dtype)
        if gin is not None and gin[2]:
            return ModuleFinding(step=step, rank=rank, phase="backward", module=c["name"], type=c["type"],
                                 differs="input gradient", error=gin[0], tolerance=gin[1], agrees="output gradient",
                                 agrees_error=got_out[0] if got_out is not None else None,
                                 agrees_ok=None if got_out is None else True, position=n)
    shown = ", ".join(f"{m} ({why})" for m, why in list(uncompared.items())[:3])
    more = f" and {len(uncompared) - 3} more" if len(uncompared) > 3 else ""
    return ModuleFinding(step=step, rank=rank, phase="none", note="" if compared else NOTHING_COMPARED,
                         uncompared=shown + more)


NOTHING_COMPARED = ("no module call of the step could be matched to the reference's samples (a forward on a "
                    "micro-batch that is no slice of the batch the step was given)")


def backward_order(record: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(module, class, its own parameters) in the order backward reached them, then the
    modules it did not reach: where a parameter's gradient is made."""
    calls = record["calls"]
    seen, out = set(), []
    for c in [calls[p] for p in record["backward"]] + calls:
        if c["name"] not in seen:
            seen.add(c["name"])
            out.append((c["name"], c["type"], c["params"]))
    return out


__all__ = ["FLOOR_EPS", "NOISE_FACTOR", "NOTHING_COMPARED", "Match", "aligned", "backward_order", "errors", "factor",
           "first_difference", "first_op", "forward_places", "noise_of", "rel", "replica_rows", "same_samples", "tolerance"]
