"""Every rank's stack, from outside: py-spy (native frames included), tidied for a report
(a faulthandler dump's tidying is the judge's: :mod:`ddparity.checks.judge`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from ddparity.frames import RANK_LOOP, hide_own_frames, verbose

PY_SPY_TIMEOUT_S = 3.5
"""The most a py-spy stack dump of all ranks (run side by side) may take."""
PYTHON_PASS_S = 2.0
"""Of which the Python stacks of every rank (milliseconds each) may take this much; native
frames, slow to unwind from busy ranks on few cores, fill the rest of the budget."""


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


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
        if line.startswith(("Process ", "Python v")) or not line.strip():
            continue
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


def py_spy_stacks(pids: dict[int, int], timeout: float = PY_SPY_TIMEOUT_S, native: bool = True) -> dict[int, str]:
    """Every pid's stack, from ``py-spy dump``, side by side; {} for those it cannot read
    (no py-spy, ptrace not permitted). First every rank's Python stack (fast, so a hang at
    8 ranks on 2 cores is still reported within its bound), then, within what is left of
    ``timeout``, ``--native`` dumps replace them where they finish: native frames show
    where C++ code (gloo, NCCL) waits; without them a rank inside a collective looks idle."""
    exe = _py_spy()
    if exe is None or not pids:
        return {}
    deadline = time.monotonic() + timeout
    out = _dump(exe, pids, False, min(deadline, time.monotonic() + PYTHON_PASS_S))
    if native:
        out.update(_dump(exe, {r: pid for r, pid in pids.items()}, True, deadline))
    return out


def _dump(exe: str, pids: dict[int, int], native: bool, deadline: float) -> dict[int, str]:
    procs = {r: subprocess.Popen([exe, "dump", "--pid", str(pid)] + (["--native"] if native else []),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for r, pid in pids.items()}
    out: dict[int, str] = {}
    for rank, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            continue
        if proc.returncode == 0 and text.strip():
            out[rank] = tidy_stack(text)
    return out
