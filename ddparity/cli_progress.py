"""The CLI's progress while a run goes: on a terminal, one live line on stderr (which run,
its step and phase, and once no rank has moved for a while, how long until that is a
hang); piped, one plain line when a run has made no progress for :data:`QUIET_NOTE_S`."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from ddparity.harness.world import progress

QUIET_NOTE_S = 10.0
"""No progress for this long is worth a line (the hang is declared at the timeout)."""
REFRESH_S = 0.25

def describe(snap: progress.Snapshot) -> str:
    """``ddp world_size=4 (gloo): step 2, backward`` and, when quiet, how long until a hang."""
    size = len(snap.progress) - 1 if snap.task.simulated else snap.world_size
    run = snap.task.shown(size, snap.backend)
    places = snap.positions()
    where = ""
    if places:
        slowest = min(places, key=lambda p: p.order())
        where = f": step {slowest.step}, {slowest.phase}" if slowest.step >= 0 else f": {slowest.phase or 'starting'}"
    quiet = (f" · no progress for {snap.quiet_s:.0f} s (a hang at {snap.limit_s:g} s)"
             if snap.quiet_s >= min(QUIET_NOTE_S / 2, snap.limit_s / 2) else "")
    return f"ddparity: {run}{where}{quiet}"


class LiveLine:
    """One status line on a terminal, rewritten in place; cleared before anything else prints."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.shown = False
        self._last = 0.0

    def __call__(self, snap: progress.Snapshot) -> None:
        now = time.monotonic()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns or 120  # the terminal written to
        except (OSError, ValueError):
            width = 120
        self.stream.write("\r\x1b[K" + describe(snap)[: max(20, width - 1)])
        self.stream.flush()
        self.shown = True

    def note(self, text: str) -> None:
        """A line shown until the first progress (what the command is doing meanwhile)."""
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


class QuietNotes:
    """Piped output: a plain line once per run that has made no progress for a while."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._noted: set[tuple[str, int]] = set()

    def __call__(self, snap: progress.Snapshot) -> None:
        key = (snap.task.label, snap.world_size)
        if snap.quiet_s >= QUIET_NOTE_S and snap.limit_s > 2 * QUIET_NOTE_S and key not in self._noted:
            self._noted.add(key)
            print(describe(snap), file=self.stream, flush=True)
        elif snap.quiet_s < 1:
            self._noted.discard(key)

    def clear(self) -> None:
        pass


def watching(quiet: bool, verb: str = "") -> Any:
    """The observer for this command (registered until :func:`stop`), or None with --quiet.
    On a terminal it says at once that the command started: importing torch and starting
    rank processes take seconds before the first progress."""
    if quiet:
        return None
    stream = sys.stderr
    observer = LiveLine(stream) if stream.isatty() else QuietNotes(stream)
    if verb and isinstance(observer, LiveLine):
        observer.note(f"ddparity {verb}: starting (loading torch, then the rank processes)...")
    progress.OBSERVERS.append(observer)
    return observer


def stop(observer: Any) -> None:
    if observer is not None:
        observer.clear()
        if observer in progress.OBSERVERS:
            progress.OBSERVERS.remove(observer)
