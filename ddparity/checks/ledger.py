"""The collective ledger: every collective of every rank, in order, readable while wedged.

Rank side (:class:`Recorder`): while a task runs, each ``torch.distributed`` collective —
called directly, or by DDP's gradient buckets through :func:`ddp_comm_hook` — is recorded
in Python, identically on every backend, *before* it is issued: its per-group sequence
number, op, reduce op, root, split sizes, tensor shapes and dtypes, group, and the
caller's source line. Entries go to the side channel (one line each, appended) and the
rank's latest position (step, phase, recent entries, whether it is inside a blocking
collective) overwrites its progress key. Both live in the controller's store, so they
survive a rank stuck in the collective or killed in it.

Controller side: :func:`parse_ledger`, :func:`parse_progress`, and
:func:`collective_mismatch` — the first sequence slot where ranks issued different
collectives, with the minority ranks.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is not used: its wrapper skips reduce-op and root
mismatches and costs an extra collective per collective.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

RECENT = 8
"""Entries repeated in the progress key, so the watchdog can compare ranks at a common
sequence number even when some have moved on."""

EXACT = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "barrier", "monitored_barrier")
"""Collectives whose every argument (shapes, dtypes, reduce op, root) must agree on all ranks."""
ROOTED = ("gather", "scatter")  # only the root passes the list: compare the own tensor
SPLIT = ("all_to_all", "all_to_all_single")  # per-rank split sizes may differ: compare dtypes
OBJECT = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
P2P = ("send", "recv", "isend", "irecv")  # pairwise, not part of the group's sequence
RECORDED = EXACT + ROOTED + SPLIT + OBJECT + P2P

PHASES = ("", "build", "ddp", "forward", "backward", "optimizer", "fingerprint",
          "profile no_sync", "profile forward", "profile backward", "profile optimizer", "done")
"""Phases of a training step in the order a rank passes them (for who is behind)."""


# -- rank side ---------------------------------------------------------------------------


def _short(obj: Any) -> str:
    import torch

    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        return f"{dtype}{list(obj.shape)}"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        parts = [_short(t) for t in obj]
        return f"{len(parts)}x{parts[0]}" if len(set(parts)) == 1 else "[" + ", ".join(parts) + "]"
    return ""


def _group_name(group: Any) -> str:
    if group is None:
        return "world"
    import torch.distributed as dist

    if group is dist.GroupMember.WORLD:
        return "world"
    return str(getattr(group, "group_name", None) or id(group))


_TORCH_DIR = ""
_THIS_FILE = os.path.abspath(__file__)


def _call_site(depth: int) -> str:
    """The first frame outside torch and this module: where the user issued it."""
    global _TORCH_DIR
    if not _TORCH_DIR:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) != _THIS_FILE:
            try:
                shown = os.path.relpath(path)
                if shown.startswith(".."):
                    shown = os.sep.join(path.split(os.sep)[-2:])
            except ValueError:
                shown = path
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _describe(op: str, args: dict[str, Any]) -> tuple[str, str, int | None]:
    """(comparison key, human description, root) of one collective call."""
    reduce_op = args.get("op")
    rop = getattr(reduce_op, "name", None) or (str(reduce_op) if reduce_op is not None else "")
    root = next((args[k] for k in ("src", "dst", "group_src", "group_dst") if args.get(k) is not None), None)
    tensors = [f"{k}={s}" for k, v in args.items() if (s := _short(v))]
    splits = [f"{k}={list(args[k])}" for k in ("output_split_sizes", "input_split_sizes") if args.get(k) is not None]
    parts = tensors + ([rop] if rop else []) + ([f"root={root}"] if root is not None else []) + splits
    desc = f"{op}({', '.join(parts)})"
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


PUBLISH_S = 0.02
"""How long the rank's publisher thread lets changes gather before writing them to the
side channel. Writing every event synchronously cost 10-30 store round trips a step (15 ms
of a 60 ms 4-rank check on 2 cores). Collectives still write their progress record (with
the recent entries) at once; phases, ledger lines and fingerprints are batched. The
thread runs while the main thread waits in a collective (torch releases the GIL there),
so a wedged rank's position is current; a rank killed outright loses at most this much
of its phases and fingerprints."""


class Recorder:
    """Records this rank's collectives and progress, published to the side channel by a
    background thread (and synchronously at the start and end of every task)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self._lock = threading.Lock()  # the recorder's state
        self._io = threading.Lock()  # store writes: publisher thread vs. task start/end
        self._wake = threading.Event()
        self._local = threading.local()
        self._reset()
        self._publisher = threading.Thread(target=self._publish_loop, name="ddparity-ledger", daemon=True)
        self._publisher.start()

    def _reset(self) -> None:
        self.seq: dict[str, int] = {}
        self.step = -1
        self.phase = ""
        self.events = 0
        self.inflight: int | None = None
        self.recent: deque[str] = deque(maxlen=RECENT)
        self.enabled = True
        self._progress: str | None = None
        self._ledger: list[str] = []
        self._prints: list[str] = []

    # task lifecycle (called by the rank loop)

    def begin_task(self, task_id: int) -> None:
        with self._io:
            with self._lock:
                self.channel.begin(task_id)
                self._reset()
                self._changed()
            self._write()

    def end_task(self) -> None:
        with self._io:
            self._write()
            with self._lock:
                self.channel.end()

    def _publish_loop(self) -> None:
        while True:
            self._wake.wait()  # something changed
            time.sleep(PUBLISH_S)  # let more changes gather
            self._wake.clear()
            with self._io:
                try:
                    self._write()
                except Exception:  # the store is gone: the controller left; so will we
                    return

    def _write(self) -> None:
        """Write what changed since the last write (call with ``_io`` held)."""
        with self._lock:
            progress, ledger, prints = self._progress, self._ledger, self._prints
            self._progress, self._ledger, self._prints = None, [], []
        if ledger:
            self.channel.append_ledger("\n".join(ledger))
        if prints:
            self.channel.append_fingerprint("\n".join(prints))
        if progress is not None:
            self.channel.set_progress(progress)

    # what tasks call

    def pause(self) -> None:
        """Stop recording until the next task (a task run without detection)."""
        self.enabled = False

    def set_phase(self, step: int, phase: str) -> None:
        with self._lock:
            self.step, self.phase = step, phase
            self._changed()

    @contextmanager
    def via(self, label: str) -> Iterator[None]:
        """Label the collectives issued inside (e.g. ``DDP gradient bucket 0``)."""
        previous = getattr(self._local, "via", "")
        self._local.via = label
        try:
            yield
        finally:
            self._local.via = previous

    def fingerprints(self, step: int, values: dict[str, int]) -> None:
        line = json.dumps({"step": step, "fp": values}, separators=(",", ":"))
        with self._lock:
            self._prints.append(line)
            self._changed()

    def ddp_buckets(self, layout: list[Any]) -> None:
        """Record the gradient all-reduces DDP's reducer is about to issue in backward
        (one per bucket, as :class:`BucketLayout` found them)."""
        if not self.enabled or not self.channel.active:
            return
        site = _call_site(2)
        for index, bucket in enumerate(layout):
            self.enter("all_reduce", {"tensor": bucket}, blocking=False, site=site,
                       via=f"DDP gradient bucket {index}")

    @contextmanager
    def tally(self) -> Iterator[list[tuple[str, int]]]:
        """``(op, bytes)`` of every collective this thread issues inside, recorded or not
        (``ddparity profile`` counts what a comm hook sends). Bytes are those of the
        collective's first tensor argument: the tensor all-reduced or broadcast, the
        output of a gather (the sizes nccl-tests reports)."""
        counted: list[tuple[str, int]] = []
        self._local.tally = counted
        try:
            yield counted
        finally:
            self._local.tally = None

    # called by the patched collectives

    def enter(self, op: str, args: dict[str, Any], blocking: bool, site: str = "", via: str = "") -> None:
        key, desc, _ = _describe(op, args)
        group = "p2p" if op in P2P else _group_name(args.get("group"))
        with self._lock:
            seq = self.seq[group] = self.seq.get(group, -1) + 1
            entry = json.dumps(
                {"g": group, "s": seq, "op": op, "k": key, "d": desc, "site": site or _call_site(3),
                 "via": via or getattr(self._local, "via", ""), "step": self.step, "phase": self.phase,
                 "t": round(time.time(), 6), "async": not blocking},
                separators=(",", ":"),
            )
            self.recent.append(entry)
            self._ledger.append(entry)
            self.inflight = seq if blocking and group == "world" else None
            self._changed()
        # A collective is written at once (its progress record holds the recent entries):
        # a mismatch must be visible before gloo aborts a rank over it, or the pair wedges.
        with self._io:
            with self._lock:
                progress, self._progress = self._progress, None
            if progress is not None:
                self.channel.set_progress(progress)

    def leave(self) -> None:
        with self._lock:
            if self.inflight is not None:
                self.inflight = None
                self._changed()

    def _changed(self) -> None:
        """Render the progress record (call with ``_lock`` held); the publisher writes it."""
        self.events += 1
        inflight = "null" if self.inflight is None else str(self.inflight)
        self._progress = (
            f'{{"n":{self.events},"step":{self.step},"phase":{json.dumps(self.phase)},'
            f'"inflight":{inflight},"recent":[{",".join(self.recent)}]}}'
        )
        self._wake.set()


class _Disabled:
    """Stands in for the recorder outside a rank (e.g. a task run in-process)."""

    def pause(self) -> None:
        pass

    def set_phase(self, step: int, phase: str) -> None:
        pass

    @contextmanager
    def tally(self) -> Iterator[None]:
        yield None  # nothing is patched outside a rank: nothing to count

    @contextmanager
    def via(self, label: str) -> Iterator[None]:
        yield

    def fingerprints(self, step: int, values: dict[str, int]) -> None:
        pass

    def ddp_buckets(self, layout: list[Any]) -> None:
        pass


_active: Recorder | None = None
DISABLED = _Disabled()


def active() -> Recorder | _Disabled:
    """This rank's recorder (a no-op outside a ddparity rank)."""
    return _active if _active is not None else DISABLED


def _recorded(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        counted = getattr(rec._local, "tally", None) if rec is not None else None
        if rec is not None and counted is not None and not getattr(rec._local, "depth", False):
            first = next(iter(args), None) if args else next(iter(kwargs.values()), None)
            counted.append((op, _nbytes(first)))
        if rec is None or not rec.enabled or not rec.channel.active or getattr(rec._local, "depth", False):
            return fn(*args, **kwargs)  # not in a task, or nested (all_gather_object -> all_gather)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let torch raise its own error for bad arguments
        blocking = not bound.arguments.get("async_op", False) and op not in ("isend", "irecv")
        rec.enter(op, bound.arguments, blocking)
        rec._local.depth = True
        try:
            return fn(*args, **kwargs)
        finally:
            rec._local.depth = False
            rec.leave()

    recorded.__ddparity_recorded__ = True  # type: ignore[attr-defined]
    return recorded


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or a list of tensors (0 for anything else)."""
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    numel, size = getattr(value, "numel", None), getattr(value, "element_size", None)
    return int(numel() * size()) if callable(numel) and callable(size) else 0


def install_recorder(channel: Any) -> Recorder:
    """Patch ``torch.distributed``'s collectives in this process to record into
    ``channel``. Called once by the rank loop; recording happens only while a task runs."""
    global _active
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for op in RECORDED:
        original = getattr(c10d, op, None)
        if original is None or getattr(original, "__ddparity_recorded__", False):
            continue
        wrapped = _recorded(op, original)
        setattr(c10d, op, wrapped)
        if getattr(dist, op, None) is original:
            setattr(dist, op, wrapped)
    _active = Recorder(channel)
    return _active


class BucketLayout:
    """The gradient buckets of one DDP model, as (meta) tensors of their shape and dtype.

    DDP's reducer issues one all-reduce per bucket from C++. Registering a Python comm
    hook to see them would cost an extra pass over every gradient (the reducer divides
    while copying into the bucket only when no hook is registered: 7% of a step in our
    benchmark), so instead the ledger records them from the layout, at the start of
    backward, before the reducer issues them. The layout is read at the first two
    backwards only: DDP rebuilds its buckets once, after the first iteration.
    """

    def __init__(self, ddp: Any) -> None:
        self._ddp = ddp
        self._reads = 0
        self._layout: list[Any] = []

    @staticmethod
    def available(ddp: Any) -> bool:
        return hasattr(getattr(ddp, "reducer", None), "_get_zeros_like_grad_buckets")

    def current(self) -> list[Any]:
        if self._reads < 2:
            self._reads += 1
            self._layout = [b.buffer().to("meta") for b in self._ddp.reducer._get_zeros_like_grad_buckets()]
        return self._layout


@dataclass(frozen=True, slots=True)
class _HookState:
    hook: Callable[..., Any] | None
    state: Any


def ddp_comm_hook(hook: Callable[..., Any] | None = None, state: Any = None) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` to register on a DDP model so that its bucket all-reduces are
    recorded (labelled with the bucket). Wraps the user's hook, or DDP's default
    averaging all-reduce when there is none."""
    return _HookState(hook, state), _ledger_hook


def _ledger_hook(state: _HookState, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with active().via(f"DDP gradient bucket {bucket.index()}"):
        if state.hook is None:
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group
        return state.hook(state.state, bucket)


# -- controller side ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One recorded collective."""

    group: str
    seq: int
    op: str
    key: str
    desc: str
    site: str
    via: str
    step: int
    phase: str
    t: float
    is_async: bool

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        return cls(d["g"], d["s"], d["op"], d["k"], d["d"], d["site"], d.get("via", ""), d.get("step", -1),
                   d.get("phase", ""), d.get("t", 0.0), d.get("async", False))

    @property
    def comparable(self) -> bool:
        return self.group != "p2p"

    def render(self) -> str:
        via = f" [{self.via}]" if self.via else ""
        return f"#{self.seq} {self.desc}{via} at {self.site}"


@dataclass(frozen=True, slots=True)
class Position:
    """Where a rank is: its step and phase, the blocking collective it is inside (if
    any), and its most recent collectives."""

    step: int = -1
    phase: str = ""
    inflight: int | None = None
    recent: tuple[Entry, ...] = ()
    events: int = 0

    @property
    def last(self) -> Entry | None:
        world = [e for e in self.recent if e.group == "world"]
        return world[-1] if world else None

    @property
    def seq(self) -> int:
        last = self.last
        return last.seq if last is not None else -1

    def order(self) -> tuple[int, int, int]:
        """Sortable progress: step, then phase, then collectives issued."""
        phase = PHASES.index(self.phase) if self.phase in PHASES else 0
        return (self.step, phase, self.seq)


def parse_progress(text: str) -> Position | None:
    if not text:
        return None
    try:
        d = json.loads(text)
        return Position(d["step"], d["phase"], d["inflight"], tuple(Entry.from_json(e) for e in d["recent"]), d["n"])
    except (ValueError, KeyError, TypeError):
        return None


def parse_ledger(text: str) -> list[Entry]:
    entries = []
    for line in text.splitlines():
        if line.strip():
            try:
                entries.append(Entry.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a dying rank
    return entries


def minority(groups: dict[str, list[int]], prefer_wrong: tuple[int, ...] = ()) -> list[int]:
    """The ranks outside the group that agrees, given ranks grouped by what they hold.

    A unique largest group of two or more ranks is the majority. Otherwise the ranks
    known to be wrong (``prefer_wrong``: they diverge from the single-device reference)
    decide: the one top group without such a rank is the majority; if every group has
    one, every rank is reported. Without that evidence, two ranks that disagree are
    judged against the lowest rank, and three or more that all disagree are all reported.
    """
    everyone = sorted(r for g in groups.values() for r in g)
    ranked = sorted(groups.values(), key=len, reverse=True)
    top = [g for g in ranked if len(g) == len(ranked[0])]
    if len(top) == 1 and len(top[0]) > 1:
        majority = top[0]
    elif prefer_wrong:
        clean = [g for g in top if not set(g) & set(prefer_wrong)]
        if len(clean) != 1:
            return everyone
        majority = clean[0]
    elif len(top[0]) == 1 and len(everyone) > 2:
        return everyone
    else:
        majority = min(top, key=min)
    return [r for r in everyone if r not in majority]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Ranks issued different collectives at the same place in a group's sequence."""

    group: str
    seq: int
    entries: dict[int, Entry]
    ranks: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return max(e.step for e in self.entries.values())

    def what(self) -> str:
        return f"collective #{self.seq} differs across ranks: " + "; ".join(
            f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r in self.ranks
        ) + " vs " + "; ".join(f"rank {r}: {e.desc}" for r, e in sorted(self.entries.items()) if r not in self.ranks)


def slots(sequences: Mapping[int, Sequence[Entry]]) -> dict[tuple[str, int], dict[int, Entry]]:
    """The comparable entries by (group, sequence number), then by rank."""
    out: dict[tuple[str, int], dict[int, Entry]] = {}
    for rank, entries in sequences.items():
        for e in entries:
            if e.comparable:
                out.setdefault((e.group, e.seq), {})[rank] = e
    return out


def collective_mismatch(sequences: Mapping[int, Sequence[Entry]]) -> Mismatch | None:
    """The first slot (per group) where the ranks holding it issued different collectives."""
    for (group, seq), by_rank in sorted(slots(sequences).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        keys: dict[str, list[int]] = {}
        for rank, e in sorted(by_rank.items()):
            keys.setdefault(e.key, []).append(rank)
        if len(keys) > 1:
            return Mismatch(group, seq, by_rank, minority(keys))
    return None


class LiveWatch:
    """Called by the World with the ranks' progress while a task runs: returns a reason to
    stop the task when ranks issued different collectives at the same slot. Waits until
    every rank reached the slot (or ``settle`` seconds) so the minority is the right one."""

    def __init__(self, settle: float = 1.0) -> None:
        self.settle = settle
        self.found: Mismatch | None = None
        self._since: float | None = None

    def __call__(self, progress: list[str]) -> str | None:
        positions = {r: p for r, text in enumerate(progress) if (p := parse_progress(text)) is not None}
        mismatch = collective_mismatch({r: p.recent for r, p in positions.items()})
        if mismatch is None:
            self._since = None
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        everyone = len(mismatch.entries) == len(progress)
        if not everyone and now - self._since < self.settle:
            return None
        self.found = mismatch
        return "ranks issued different collectives: " + mismatch.what()
