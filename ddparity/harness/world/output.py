"""A rank's stdout and stderr, drained by a thread in the controller: the last
:data:`TAIL_BYTES` of each task's output are kept (a rank that prints gigabytes costs the
controller a megabyte), with a note of how much was dropped."""

from __future__ import annotations

import os
import re
import threading
import time
from multiprocessing.connection import Connection

from ddparity.harness.protocol import OUTPUT_END_MARK

_END_MARK_RE = re.compile(re.escape(OUTPUT_END_MARK).replace(b"%d", rb"\d+"))
_MARK_HEAD = OUTPUT_END_MARK.split(b"%d")[0]
TAIL_BYTES = 1 << 20


class OutputReader(threading.Thread):
    """Drains one rank's stdout+stderr pipe. Only reads and appends; decides nothing."""

    def __init__(self, rank: int, conn: Connection) -> None:
        super().__init__(name=f"ddparity-output-rank{rank}", daemon=True)
        self._conn = conn
        self._buffer = bytearray()
        self._dropped = 0
        self._cond = threading.Condition()
        self.closed = False

    def run(self) -> None:
        fd = self._conn.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            with self._cond:
                if not chunk:
                    self.closed = True
                    self._cond.notify_all()
                    break
                self._buffer += chunk
                self._trim()
                self._cond.notify_all()
        self._conn.close()

    def _trim(self) -> None:
        """Keep the tail of the task's output (call with the lock held): up to the first
        task-end mark still to be taken, what follows it being the next task's."""
        mark = self._buffer.find(_MARK_HEAD)
        excess = (len(self._buffer) if mark < 0 else mark) - TAIL_BYTES
        if excess > 0:
            del self._buffer[:excess]
            self._dropped += excess

    def _note(self) -> bytes:
        """What was dropped since the last take (call with the lock held)."""
        dropped, self._dropped = self._dropped, 0
        if not dropped:
            return b""
        return (f"[ddparity: {dropped} bytes of this rank's earlier output dropped; the last "
                f"{TAIL_BYTES >> 20} MiB kept]\n").encode()

    def take_until(self, mark: bytes, timeout: float) -> str:
        """Everything up to ``mark`` (removed with it), or all there is after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while mark not in self._buffer and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            cut = self._buffer.find(mark)
            if cut < 0:
                data, self._buffer = bytes(self._buffer), bytearray()
            else:
                data = bytes(self._buffer[:cut])
                del self._buffer[: cut + len(mark)]
            data = self._note() + data
        return data.decode("utf-8", "replace")

    @property
    def buffered(self) -> int:
        with self._cond:
            return len(self._buffer)

    def take_all(self, settle: float = 0.0) -> str:
        """Everything buffered (task-end marks dropped), after up to ``settle`` s for EOF."""
        if settle:
            self.join(settle)
        with self._cond:
            data, self._buffer = self._note() + bytes(self._buffer), bytearray()
        return _END_MARK_RE.sub(b"", data).decode("utf-8", "replace")
