"""One collective call as the ledger records it: which calls are recorded and how their
arguments are compared across ranks (:func:`describe`), the call's group
(:func:`group_name`) and the user's source line that issued it (:func:`call_site`).
Used by the rank's recorder (:mod:`ddparity.harness.recording.recorder`) and by each simulated rank's
(:mod:`ddparity.harness.ranks.threaded`)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from types import FrameType
from typing import Any

from ddparity.frames import PACKAGE
from ddparity.records import GATHERED_WITH_GRAD, GATHERS

EXACT = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "barrier", "monitored_barrier")
"""Collectives whose every argument (shapes, dtypes, reduce op, root) must agree on all ranks.
``all_gather_single`` and ``reduce_scatter_single`` (torch 2.13's names, FSDP2's calls) are
what ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` call there: the outer call is
recorded, the nested one not."""
ROOTED = ("gather", "scatter")  # only the root passes the list: compare the own tensor
SPLIT = ("all_to_all", "all_to_all_single")  # per-rank split sizes may differ: compare dtypes
OBJECT = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
P2P = ("send", "recv", "isend", "irecv")  # pairwise, not part of the group's sequence
RECORDED = EXACT + ROOTED + SPLIT + OBJECT + P2P


def _short(obj: Any) -> str:
    import torch

    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        return f"{dtype}{list(obj.shape)}"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        parts = [_short(t) for t in obj]
        return f"{len(parts)}x{parts[0]}" if len(set(parts)) == 1 else "[" + ", ".join(parts) + "]"
    return ""


GROUP_RANKS: dict[str, list[int]] = {}
"""The global ranks of each process group a recorded collective used (other than the
world), by name: the Flight Recorder dump's ``pg_config``."""


def group_name(group: Any) -> str:
    if group is None:
        return "world"
    import torch.distributed as dist

    if group is dist.GroupMember.WORLD:
        return "world"
    name = str(getattr(group, "group_name", None) or id(group))
    if name not in GROUP_RANKS:
        try:
            GROUP_RANKS[name] = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            GROUP_RANKS[name] = []
    return name


_TORCH_DIR = ""
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = {os.path.join(_HERE, name) for name in ("calls.py", "recorder.py", "ddp_buckets.py", "replicas.py")}
"""Frames skipped when looking for the caller: the recorder's and the DDP bucket hook's."""


def call_site(depth: int) -> str:
    """The first frame outside torch and the recorder: where the user issued it."""
    return issuer(depth + 1)[0]


TORCH_ISSUERS = (("distributed/fsdp/", "FSDP2"), ("nn/parallel/distributed.py", "DDP"),
                 ("distributed/nn/functional", "torch.distributed.nn"))
"""torch's own callers of collectives named as a call's ``via`` when its frames are on the way
from the user's line: FSDP2's all-gathers and reduce-scatters, DDP's broadcasts of buffers
and of the initial state are not the user's calls (a desync's odd one out, a profile's step's
own collectives); ``torch.distributed.nn``'s are, made differentiable
(:func:`ddparity.checks.causes.gathered_without_grad`)."""


def issuer(depth: int) -> tuple[str, str]:
    """``(site, via)``: the first frame outside torch and the recorder (where the user issued
    it), and the torch code that issued it on the user's behalf (:data:`TORCH_ISSUERS`), or ""."""
    global _TORCH_DIR
    if not _TORCH_DIR:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frame: FrameType | None = sys._getframe(depth)
    via = ""
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) not in _OWN_FILES:
            return f"{_shown(path)}:{frame.f_lineno} in {frame.f_code.co_name}", via
        if not via and path.startswith(_TORCH_DIR):
            via = next((name for part, name in TORCH_ISSUERS if part in path.replace(os.sep, "/")), "")
        frame = frame.f_back
    return "?", via


@functools.lru_cache(maxsize=512)
def _shown(path: str) -> str:
    """A source file as its import path names it (``ddparity/fixtures/faults.py``,
    ``my_cases.py``): the same from every working directory and on every rank; else the
    path as it is."""
    full = os.path.abspath(path)
    if full.startswith(PACKAGE):  # however ddparity is installed (an editable install is on no sys.path entry)
        return os.path.join("ddparity", full[len(PACKAGE):])
    roots = sorted({os.path.abspath(p or os.curdir) for p in sys.path}, key=len, reverse=True)
    for root in roots:
        if full.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(full, root)
    return path


def ledger_entry(counters: dict[str, int], op: str, args: dict[str, Any], blocking: bool, site: str, via: str,
                 step: int, phase: str) -> tuple[str, int | None]:
    """One call's ledger line, numbered in its group (``counters`` advanced), and the
    sequence number of the world-group collective it blocks in (None if it does not)."""
    from ddparity.records import encode_entry

    key, desc, _ = describe(op, args)
    group = "p2p" if op in P2P else group_name(args.get("group"))
    seq = counters[group] = counters.get(group, -1) + 1
    line = encode_entry(group, seq, op, key, desc, site, via, step, phase, time.time(), not blocking)
    return line, (seq if blocking and group == "world" else None)


def describe(op: str, args: dict[str, Any]) -> tuple[str, str, int | None]:
    """(comparison key, human description, root) of one collective call."""
    reduce_op = args.get("op")
    rop = getattr(reduce_op, "name", None) or (str(reduce_op) if reduce_op is not None else "")
    root = next((args[k] for k in ("src", "dst", "group_src", "group_dst") if args.get(k) is not None), None)
    tensors = [f"{k}={s}" for k, v in args.items() if (s := _short(v))]
    splits = [f"{k}={list(args[k])}" for k in ("output_split_sizes", "input_split_sizes") if args.get(k) is not None]
    parts = tensors + ([rop] if rop else []) + ([f"root={root}"] if root is not None else []) + splits
    desc = f"{op}({', '.join(parts)})"
    if op in GATHERS and getattr(args.get("tensor", args.get("input_tensor")), "requires_grad", False):
        desc += GATHERED_WITH_GRAD  # the copies it writes carry no gradient back (causes.gathered_without_grad)
    if op in EXACT:
        key = "|".join([op, rop, str(root), *tensors])
    elif op in ROOTED:
        key = "|".join([op, str(root), _short(args.get("tensor"))])
    elif op in SPLIT:
        dtypes = sorted({t.split("[")[0].split("x")[-1] for t in (_short(v) for v in args.values()) if t})
        key = "|".join([op, *dtypes])
    else:
        key = "|".join([op, str(root)])
    return key, desc, root


class Binder:
    """A collective's arguments by name, as ``inspect.Signature.bind`` gives them (only
    those passed, in the signature's order, so that ranks passing them differently compare
    alike) in a fraction of its time: this runs at every collective a rank issues."""

    def __init__(self, fn: Any) -> None:
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.fast = all(p.kind in kinds for p in params)
        """Whether calls bind without ``Signature.bind`` (no ``*args`` or positional-only parameters)."""
        self._positional = tuple(p.name for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._order = tuple(p.name for p in params)
        self._names = frozenset(self._order)
        self._required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments passed, by name; TypeError where the call does not fit (as torch would raise)."""
        if self.fast and len(args) <= len(self._positional):
            bound = dict(zip(self._positional, args))
            if not kwargs:
                if self._required.issubset(bound):
                    return bound
            elif self._names.issuperset(kwargs) and bound.keys().isdisjoint(kwargs):
                bound.update(kwargs)
                if self._required.issubset(bound):
                    return {name: bound[name] for name in self._order if name in bound}
        return dict(self.signature.bind(*args, **kwargs).arguments)
