"""The rank side of the collective ledger: every collective a rank issues, recorded
before it is issued, readable by the controller while the rank is wedged.

While a task runs, each ``torch.distributed`` collective — called directly, or by DDP's
gradient buckets (:mod:`ddparity.harness.recording.ddp_buckets`) — is recorded in Python,
identically on every backend: its per-group sequence number, op, reduce op, root, split
sizes, tensor shapes and dtypes, group, and the caller's source line. Entries go to the
side channel (one line each, appended) and the rank's latest position (step, phase, recent
entries, whether it is inside a blocking collective) overwrites its progress key, outside
the rank (the world's side-channel folder, or the launch's store), so they survive a rank
stuck or killed in the collective. Format: :mod:`ddparity.records`; judged in
:mod:`ddparity.checks.collectives` and :mod:`ddparity.checks.hang`.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is not used: its wrapper skips reduce-op and root
mismatches and costs an extra collective per collective.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from ddparity.harness.recording import timing
from ddparity.harness.recording.calls import RECORDED, Binder, call_site, issuer, ledger_entry
from ddparity.records import BUCKET_VIA, encode_fingerprints, encode_progress

if TYPE_CHECKING:
    from ddparity.harness.sidechannel import RankEnd

RECENT = 8
"""Entries repeated in the progress key, so the watchdog can compare ranks at a common
sequence number even when some have moved on."""

LAZY_S = 0.1
"""How often the rank's publisher thread writes what changed (phases, ledger lines,
fingerprints) to the side channel: nothing wakes it (writing every event at once cost
15 ms of a 60 ms 4-rank step on 2 cores; waking the thread at each, ~0.3 ms each). Collectives
still write their progress record (with the recent entries) at once. The thread runs while
the main thread waits in a collective (the GIL released), so a wedged rank's place is current."""

BEHIND_S = 0.25
"""The same under ``write_behind`` (a watched script: fewer wakes on a busy node)."""

HEARTBEAT_S = 1.0
"""How often a rank that is computing (its modules' forwards and its gradients ticking,
see :meth:`Recorder.tick`) publishes that it still is, with no phase change: a long step
of a large model is never taken for a hang, and a rank that waits or is stuck ticks not."""


class StepRecorder(Protocol):
    """What the training loop, the modes and the fingerprints tell the recorder active in
    this thread (:func:`active`): the rank's :class:`Recorder`, a simulated rank's
    :class:`~ddparity.harness.recording.threads.ThreadRecorder`, or :data:`DISABLED` outside
    a rank. Its collectives reach it through the patched ``torch.distributed``."""

    def tick(self) -> None:
        """The rank is computing (a module's forward or a gradient): not hung."""

    def pause(self) -> None:
        """The rank waits on purpose (nothing to tick for a while)."""

    def set_phase(self, step: int, phase: str) -> None:
        """Where the rank is: ``phase`` one of :data:`ddparity.records.PHASES`."""

    def via(self, label: str) -> AbstractContextManager[None]:
        """Collectives issued inside are labelled ``label`` (e.g. a DDP gradient bucket)."""

    def tally(self) -> AbstractContextManager[Any]:
        """Collectives issued inside are counted (op, bytes) into the value it yields, if any."""

    def fingerprints(self, step: int, values: dict[str, int]) -> None:
        """The replica's fingerprints after ``step``."""

    def ddp_buckets(self, layout: list[Any]) -> None:
        """DDP's gradient bucket layout, once the replica is built."""


class Recorder:
    """Records this rank's collectives and progress, published to the side channel by a
    background thread (and synchronously at the start and end of every task)."""

    def __init__(self, channel: RankEnd, write_behind: bool = False) -> None:
        self.channel = channel
        self.write_behind = write_behind
        """DDP's bucket all-reduces written by the publisher, not by the step (``ddparity watch``:
        a watched step waits for the store only at the script's own collectives)."""
        self._lock = threading.Lock()  # the recorder's state
        self._io = threading.Lock()  # store writes: publisher thread vs. task start/end
        self._local = threading.local()
        self.ticks = 0
        self._ticks_published = 0
        self._reset()
        self._publisher = threading.Thread(target=self._publish_loop, name="ddparity-ledger", daemon=True)
        self._publisher.start()

    def _reset(self) -> None:
        self.seq: dict[str, int] = {}
        self.step = -1
        self.phase = ""
        self.events = 0
        self.inflight: int | None = None
        self._last: tuple[bool, int] | None = None  # the last call's (blocking, step)
        self._returned = True  # the last blocking call returned
        self.recent: deque[str] = deque(maxlen=RECENT)
        self.enabled = True
        self._dirty = False  # the progress record changed since it was last written
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
        last = time.monotonic()
        while True:
            time.sleep(BEHIND_S if self.write_behind else LAZY_S)  # nothing wakes it: a wake cost ~0.3 ms
            with self._lock:
                if not self._dirty and self.ticks != self._ticks_published and time.monotonic() - last > HEARTBEAT_S:
                    self._changed()  # still computing, with no phase change: a slow step is progress
                if not (self._dirty or self._ledger or self._prints):
                    continue
            last, self._ticks_published = time.monotonic(), self.ticks
            with self._io:
                try:
                    self._write()
                except Exception:  # the store is gone: the controller left; so will we
                    return

    def tick(self) -> None:
        """Work done (a forward, a gradient): a slow step is progress (every :data:`HEARTBEAT_S`)."""
        self.ticks += 1

    def _write(self) -> None:
        """Write what changed since the last write (call with ``_io`` held)."""
        with self._lock:
            progress = self._render() if self._dirty else None
            ledger, prints = self._ledger, self._prints
            self._ledger, self._prints = [], []
        if ledger:
            self.channel.append_ledger("\n".join(ledger))
        if prints:
            self.channel.append_fingerprint("\n".join(prints))
        if progress is not None:
            self.channel.set_progress(progress)

    def flush(self) -> None:  # (a watched script raised: what it did last goes first)
        with self._io:
            self._write()

    # what tasks call

    def pause(self) -> None:  # stop recording until the next task (run without detection)
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
        line = encode_fingerprints(step, values)
        with self._lock:
            self._prints.append(line)
            self._changed()

    def ddp_buckets(self, layout: list[Any]) -> None:
        """Record the gradient all-reduces DDP's reducer is about to issue in backward
        (one per bucket, as :class:`BucketLayout` found them)."""
        if not self.enabled or not self.channel.active:
            return
        site = call_site(2)
        for index, bucket in enumerate(layout):
            self.enter("all_reduce", {"tensor": bucket}, blocking=False, site=site,
                       via=f"{BUCKET_VIA} {index}", write=index == len(layout) - 1 and not self.write_behind)

    @contextmanager
    def tally(self) -> Iterator[list[tuple[str, int]]]:
        """``(op, bytes)`` of every collective this thread issues inside, recorded or not
        (``ddparity profile``): bytes of its first tensor argument (the tensor all-reduced or
        broadcast, a gather's output: the sizes nccl-tests reports)."""
        counted: list[tuple[str, int]] = []
        self._local.tally = counted
        try:
            yield counted
        finally:
            self._local.tally = None

    # called by the patched collectives

    def enter(self, op: str, args: dict[str, Any], blocking: bool, site: str = "", via: str = "",
              write: bool = True) -> None:
        """Record a collective about to be issued; ``write=False`` leaves the write to the next
        entry's or the publisher (DDP's buckets: one round trip for all, or none written behind)."""
        site, issued_by = (site, "") if site else issuer(3)
        via = via or getattr(self._local, "via", "") or issued_by
        with self._lock:
            entry, self.inflight = ledger_entry(self.seq, op, args, blocking, site, via, self.step, self.phase)
            self._last, self._returned = (blocking, self.step), not blocking
            self.recent.append(entry)
            self._ledger.append(entry)
            self._changed()
        if not write:
            return
        # written at once (the progress record holds the recent entries): a mismatch must be
        # visible before gloo aborts a rank over it (std::terminate), or the pair wedges
        with self._io:
            with self._lock:
                progress = self._render()
            self.channel.set_progress(progress)

    def leave(self, returned: bool = True) -> None:
        with self._lock:
            self._returned = returned
            if self.inflight is not None:
                self.inflight = None
                self._changed()

    def last_running(self) -> bool:
        """Whether this rank's last recorded collective may still be running: a blocking
        call that has not returned (or raised), or one issued asynchronously (DDP's gradient
        buckets, ``async_op=True``) in the step the rank is still in (DDP's backward waits
        for its buckets before the optimizer steps)."""
        with self._lock:
            if self._last is None:
                return False
            blocking, step = self._last
            return not self._returned if blocking else step >= self.step

    def _changed(self) -> None:
        """The progress record changed (call with ``_lock`` held): the publisher renders and
        writes it within :data:`LAZY_S`."""
        self.events += 1
        self._dirty = True

    def _render(self) -> str:
        self._dirty = False
        return encode_progress(self.events, self.step, self.phase, self.inflight, self.recent)


class _Disabled:
    """Stands in for the recorder outside a rank (e.g. a task run in-process)."""

    def tick(self) -> None:
        pass

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


_thread = threading.local()


def active() -> StepRecorder:
    """This thread's recorder: a simulated rank's own (see :func:`set_thread_recorder`),
    else this rank's (a no-op outside a ddparity rank)."""
    own = getattr(_thread, "recorder", None)
    if own is not None:
        return own
    return _active if _active is not None else DISABLED


def set_thread_recorder(own: StepRecorder | None) -> None:
    """This thread is a simulated rank: its phases and collectives go to ``own`` (a
    :class:`~ddparity.harness.recording.threads.ThreadRecorder`), not to the rank's recorder."""
    _thread.recorder = own


def _recorded(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    binder = Binder(fn)

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        timer = timing.timer
        if timer is not None and not getattr(_thread, "timed", False):
            try:
                arguments = binder.bind(args, kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # let torch raise its own error for bad arguments
            _thread.timed = True
            try:
                return timer.call(op, arguments, lambda: _record(*args, **kwargs))
            finally:
                _thread.timed = False
        return _record(*args, **kwargs)

    def _record(*args: Any, **kwargs: Any) -> Any:
        simulated = getattr(_thread, "recorder", None)
        if simulated is not None:
            return simulated.call(op, binder, fn, args, kwargs)
        rec = _active
        counted = getattr(rec._local, "tally", None) if rec is not None else None
        if rec is not None and counted is not None and not getattr(rec._local, "depth", False):
            first = next(iter(args), None) if args else next(iter(kwargs.values()), None)
            counted.append((op, _nbytes(first)))
        if rec is None or not rec.enabled or not rec.channel.active or getattr(rec._local, "depth", False):
            return fn(*args, **kwargs)  # not in a task, or nested (all_gather_object -> all_gather)
        try:
            bound = binder.bind(args, kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let torch raise its own error for bad arguments
        blocking = not bound.get("async_op", False) and op not in ("isend", "irecv")
        rec.enter(op, bound, blocking)
        rec._local.depth = True
        returned = False
        try:
            result = fn(*args, **kwargs)
            returned = True
            return result
        finally:
            rec._local.depth = False
            rec.leave(returned)

    recorded.__ddparity_recorded__ = True  # type: ignore[attr-defined]
    return recorded


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or a list of tensors (0 for anything else)."""
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    numel, size = getattr(value, "numel", None), getattr(value, "element_size", None)
    return int(numel() * size()) if callable(numel) and callable(size) else 0


def untraced(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` (ddparity's, recording on the module a run wraps) as Dynamo leaves it: called
    eagerly, never traced into the user's compiled graphs (compiling DDP's forward traced the
    DDP hook's ledger code and counted its ops as the model's)."""
    import torch

    return torch.compiler.disable(hook)


def install_recorder(channel: RankEnd, write_behind: bool = False) -> Recorder:
    """Patch ``torch.distributed``'s collectives in this process to record into
    ``channel``. Called once by the rank loop; recording happens only while a task runs.
    ``write_behind``: see :attr:`Recorder.write_behind`."""
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
    _active = Recorder(channel, write_behind)
    return _active
