"""Stacks and tracebacks as reports show them, tidied in this one place: each run of
ddparity's own frames (the step driver, the modes, the collective recorder, between the
rank loop and the user's code) folded into one line, unless ``--verbose``; py-spy's dumps
(:func:`tidy_stack`) and faulthandler's (:func:`tidy_faulthandler_dump`) without the
rank's bootstrap. A leaf module: text in, text out."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable

PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""The package's folder, as tracebacks name its files."""
_FRAME_FILE = re.compile(r'^\s*File "(?P<tb>[^"]+)", line \d+|\((?P<spy>[^()\s]+\.py):\d+\)\s*$')
RANK_LOOP = "ddparity/harness/ranks/rank.py"
"""The rank loop's file as stacks and tracebacks name it: where a task (the user's step)
is called from; the frames below it are the rank's bootstrap, nobody's code."""
_KEPT = ("fixtures" + os.sep, os.path.join(*RANK_LOOP.split("/")[1:]))
"""ddparity's files whose frames a report keeps: the fixtures stand for a user's model,
the rank loop is where the task (the user's step) is called from."""


def verbose() -> bool:
    """Whether reports keep ddparity's own threads and frames (``--verbose`` sets
    ``DDPARITY_VERBOSE=1``; rank processes inherit it)."""
    return bool(os.environ.get("DDPARITY_VERBOSE"))


def own_file(path: str) -> bool:
    """Whether a frame's file is ddparity's own harness code (py-spy names files relative
    to ``sys.path``, tracebacks in full)."""
    inside = path[len(PACKAGE):] if path.startswith(PACKAGE) else path[len("ddparity/"):] if (
        path.startswith("ddparity/")) else None
    return inside is not None and not inside.startswith(_KEPT)


def hide_own_frames(text: str) -> str:
    """A stack or traceback (py-spy's, faulthandler's or Python's) with each run of
    ddparity's own frames between the rank loop and the user's code (the step driver, the
    modes, the collective recorder) folded into one line saying how many; unchanged with
    ``--verbose``."""
    return text if verbose() else _drop_frames(text, own_file, fold=True)


def without_package_frames(text: str) -> str:
    """A traceback less every frame in ddparity's folder, silently (the call into a user's
    factory, data or loss: what is left is the user's code)."""
    return _drop_frames(text, lambda path: path.startswith(PACKAGE), fold=False)


def _drop_frames(text: str, dropped: Callable[[str], bool], fold: bool) -> str:
    """``text`` less the frames whose file ``dropped`` names (with their source lines and
    carets), each run of them one line saying how many when ``fold``."""
    lines: list[str] = []
    hidden, hidden_at, depth = 0, "", -1

    def flush() -> None:
        if hidden and fold:
            lines.append(f"{hidden_at}[{hidden} frame{'s' * (hidden > 1)} of ddparity's own: --verbose shows them]")

    for line in text.splitlines():
        frame = _FRAME_FILE.search(line)
        indent = len(line) - len(line.lstrip())
        if frame is None and hidden and indent > depth:
            continue  # the dropped frame's source line and carets
        if frame is not None and dropped(frame.group("tb") or frame.group("spy")):
            hidden, hidden_at, depth = hidden + 1, line[:indent], indent
            continue
        flush()
        hidden = 0
        lines.append(line)
    flush()
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


_TB_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+)')
_STDLIB = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
_TORCH = re.compile(r"[/\\](site|dist)-packages[/\\]torch[/\\]")


def own_error_site(traceback: str) -> str | None:
    """Where a Python traceback's error arose in ddparity's own harness code (``file:line``),
    or None where it arose in the user's code.

    The innermost frame outside torch and the standard library decides: an error that
    torch raised inside one of ddparity's observers (``aten::max`` on a sparse gradient
    in the spool) is ddparity's; one raised in the user's forward, or by torch under it or
    under ddparity's step driver, is the user's."""
    frames = [(m.group("path"), m.group("line")) for line in traceback.splitlines()
              if (m := _TB_FRAME.match(line))]
    for depth, (path, line) in enumerate(reversed(frames)):
        if own_file(path):
            inside = path[len(PACKAGE):] if path.startswith(PACKAGE) else path
            ours = inside.startswith(OBSERVERS) or (depth == 0 and inside.startswith(WRAPPERS))
            return f"{inside}:{line}" if ours else None
        if not (_TORCH.search(path) or os.path.realpath(path).startswith(_STDLIB)):
            return None
    return None


OBSERVERS = tuple(os.path.join(*f.split("/")) for f in (
    "harness/ranks/spool.py", "harness/ranks/comparer.py", "harness/spool_files.py", "harness/shards.py",
    "harness/recording/ddp_buckets.py", "harness/recording/calls.py", "harness/recording/fingerprint.py",
    "distances.py"))
"""ddparity's files that only watch the training (record, compare, fingerprint): an error
raised there, by them or by torch under them, is ddparity's. The step driver and the modes
call the user's model through torch, where torch raises over the user's set-up (an unused
parameter under DDP)."""
WRAPPERS = tuple(os.path.join(*f.split("/")) for f in (
    "harness/recording/recorder.py", "harness/recording/timing.py", "harness/recording/replicas.py"))
"""ddparity's files that wrap the user's own calls (a collective, DDP's constructor) and
pass them on to torch: torch raising under them is the user's (bad arguments to a
collective); only an error raised in their own lines is ddparity's."""


_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")
_LAMBDA = re.compile(r"\{lambda\([^{}]*\)#\d+\}")
_PARENS = re.compile(r"\([^()]*\)")
_THREAD_START = re.compile(r"^\s+Thread\.run \(threading\.py:\d+\)$")


OWN_THREAD = re.compile(r'^Thread .*"ddparity-(?!simulated-rank)[^"]*"')
"""The first line of a thread of ddparity's own in a py-spy dump (the ledger's publisher;
a simulated rank is the user's)."""


def tidy_stack(text: str) -> str:
    """py-spy's dump without its header, the rank's bootstrap frames or ddparity's own
    threads and frames (kept with ``--verbose``: :func:`ddparity.frames.verbose`), C++ frames
    without template arguments."""
    skipping = own = False
    keep_own = verbose()
    lines = []
    for line in text.splitlines():
        if line.startswith(("Process ", "Python v")) or not line.strip() or "(<frozen runpy>:" in line:
            continue  # (python -m's bootstrap: a launched rank's)
        if line.startswith("Thread "):
            own = not keep_own and bool(OWN_THREAD.match(line))
        if own:
            continue
        if RANK_LOOP in line:  # below it: the rank's bootstrap, not the user's code
            lines.append(line)
            skipping = True
            continue
        if _THREAD_START.search(line):  # a thread's bootstrap (a simulated rank's, say): nobody's code
            skipping = True
            continue
        if line.startswith("Thread "):
            skipping = False
        elif skipping:
            continue
        if line.rstrip().endswith(".so)") or ".so." in line:
            head, sep, lib = line.rpartition(" (")
            previous = None
            while previous != head:
                previous, head = head, _PARENS.sub("", _TEMPLATE_ARGS.sub("", _LAMBDA.sub("{lambda}", head)))
            line = head + sep + lib
            if len(line) > 160:
                line = line[:157] + "..."
        lines.append(line)
    return hide_own_frames("\n".join(lines) + "\n")


def tidy_faulthandler_dump(text: str) -> str:
    """A faulthandler dump without the frames below the rank loop (its bootstrap, which
    in a forked rank repeats the controller's whole stack), ddparity's own folded."""
    lines, skipping = [], False
    for line in text.splitlines():
        if skipping and (not line.strip() or not line.startswith("  ")):
            skipping = False
        if skipping:
            continue
        lines.append(line)
        if RANK_LOOP in line and line.lstrip().startswith("File"):
            skipping = True
    return hide_own_frames("\n".join(lines))


def own_stacks(skip: tuple[str, ...] = ("ddparity-",)) -> str:
    """Every thread's Python stack in this process, the main thread first (not ddparity's
    own threads: the watch, the ledger's publisher, the reference's server)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        name = names.get(ident, f"0x{ident:x}")
        if name.startswith(skip):
            continue
        frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith("<frozen runpy>")]
        stack = hide_own_frames("".join(traceback.format_list(frames)).rstrip())  # less python -m's bootstrap
        parts.append(f"Thread {name} (most recent call last):\n{stack}")
    return "\n".join(parts)
