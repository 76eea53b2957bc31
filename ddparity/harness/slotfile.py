"""A record overwritten in place, read whole or not at all: a local rank's progress
record, rewritten at every collective it issues.

Writing it as a new file renamed over the old one (open, write, close, rename) cost about
0.2 ms a write here, on the training step's path, at every collective. A slot file costs
one ``pwrite`` of the record and one of a 24-byte header (a few microseconds), through a
descriptor kept open while the task runs:

* the header at offset 0 holds ``(sequence, offset, length, crc32)`` of the current record;
* a record is written first where it overlaps neither the current record nor the header
  (at :data:`FIRST` when it fits before the current one, else after it), then the header
  is rewritten to point at it.

A reader takes the header, then the record it names, and accepts it only when its crc32
matches: a read that raced a write (a torn header or record) is retried; a writer killed
mid-write leaves the header naming the previous record, whole. Nothing else reads or
writes the file (it lives in the controller's private folder, see
:func:`ddparity.harness.sidechannel.private_root`).
"""

from __future__ import annotations

import os
import struct
import time
import zlib

HEADER = struct.Struct("<QQII")
FIRST = 4096
"""Where records start (the header's page is the header's alone)."""
TRIES = 20
"""Reads of a record that races its writer before the reader gives up (``""``: as if
nothing were written yet; the next poll reads it)."""


class SlotWriter:
    """One record's writer (one thread at a time: the rank's recorder holds its lock)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._seq = 0
        self._at, self._length = FIRST, 0  # the current record (none yet)

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        if FIRST + len(data) <= self._at:
            offset = FIRST
        else:  # after the current record, on a page of its own
            offset = -(-(self._at + self._length) // FIRST) * FIRST
        os.pwrite(self._fd, data, offset)
        self._seq += 1
        os.pwrite(self._fd, HEADER.pack(self._seq, offset, len(data), zlib.crc32(data)), 0)
        self._at, self._length = offset, len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_slot(path: str) -> str:
    """The record last written whole at ``path`` (``""``: none, or no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    try:
        for attempt in range(TRIES):
            head = os.pread(fd, HEADER.size, 0)
            if len(head) < HEADER.size:
                return ""
            _, offset, length, crc = HEADER.unpack(head)
            data = os.pread(fd, length, offset)
            if len(data) == length and zlib.crc32(data) == crc:
                return data.decode("utf-8", "replace")
            time.sleep(0.0005 * attempt)  # raced the writer: it is done within microseconds
        return ""
    finally:
        os.close(fd)
