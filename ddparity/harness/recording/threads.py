"""The recorder of a simulated rank: a thread of one process, on torch's threaded process
group (:mod:`ddparity.harness.ranks.threaded`), recording what a real rank's recorder
records, per thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ddparity.records import BUCKET_VIA, RankRecords


class ThreadRecorder:
    """The recorder of one simulated rank (a thread): what a real rank's
    :class:`~ddparity.harness.recording.recorder.Recorder` records — phases, every collective (the
    patched ``torch.distributed`` calls and DDP's gradient buckets), fingerprints — kept
    per thread, since the simulated ranks share one process. Each record is also written
    at once to the host rank's side-channel folder (``channel``): a simulated world that
    hangs or dies as a whole still says where each of its ranks was."""

    enabled = True

    def __init__(self, rank: int, channel: Any) -> None:
        from collections import deque

        from ddparity.harness.recording.recorder import RECENT

        self.rank = rank
        self.lines: list[str] = []
        self.prints: list[str] = []
        self.step, self.phase, self.events = -1, "", 0
        self.inflight: int | None = None
        self.recent: deque[str] = deque(maxlen=RECENT)
        self._seq: dict[str, int] = {}
        self._depth = 0
        self._via = ""
        self._channel = channel
        channel.set_thread(threading.get_ident())

    def note_exit(self, code: int) -> None:
        """This thread called ``os._exit``: the host process ends, the record says who."""
        self._channel.note_exit(code)

    def records(self) -> RankRecords:
        return RankRecords(self._progress(), "\n".join(self.lines), "\n".join(self.prints))

    def _progress(self) -> str:
        from ddparity.records import encode_progress

        return encode_progress(self.events, self.step, self.phase, self.inflight, self.recent)

    def _changed(self) -> None:
        self.events += 1
        self._channel.set_progress(self._progress())

    # what training calls (the Recorder's interface)

    def tick(self) -> None:
        pass  # a simulated rank's progress is its phases and collectives

    def pause(self) -> None:
        pass

    def set_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self._changed()

    @contextmanager
    def via(self, label: str) -> Iterator[None]:
        previous, self._via = self._via, label
        try:
            yield
        finally:
            self._via = previous

    @contextmanager
    def tally(self) -> Iterator[None]:
        yield None

    def fingerprints(self, step: int, values: dict[str, int]) -> None:
        from ddparity.records import encode_fingerprints

        # One process, one global RNG shared by every thread: its state is not a rank's own.
        line = encode_fingerprints(step, {k: v for k, v in values.items() if not k.startswith("rng ")})
        self.prints.append(line)
        self._channel.append_fingerprint(line)

    def ddp_buckets(self, layout: list[Any]) -> None:
        from ddparity.harness.recording.calls import call_site

        site = call_site(2)
        for index, bucket in enumerate(layout):
            self._enter("all_reduce", {"tensor": bucket}, False, site, f"{BUCKET_VIA} {index}")

    # what the patched collectives call

    def call(self, op: str, binder: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from ddparity.harness.recording.calls import issuer

        if self._depth:  # a collective's own inner one (all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        try:
            bound = binder.bind(args, kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # torch raises its own error for bad arguments
        blocking = not bound.get("async_op", False) and op not in ("isend", "irecv")
        site, issued_by = issuer(3)
        self._enter(op, bound, blocking, site, self._via or issued_by)
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            if self.inflight is not None:
                self.inflight = None
                self._changed()

    def _enter(self, op: str, args: dict[str, Any], blocking: bool, site: str, via: str) -> None:
        from ddparity.harness.recording.calls import ledger_entry

        line, self.inflight = ledger_entry(self._seq, op, args, blocking, site, via, self.step, self.phase)
        self.lines.append(line)
        self.recent.append(line)
        self._channel.append_ledger(line)
        self._changed()
