"""Every rank's stack, from outside: py-spy (native frames included), tidied for a report
(a faulthandler dump's tidying is the judge's: :mod:`ddparity.checks.verdict`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

PY_SPY_TIMEOUT_S = 5.0
"""The most a py-spy stack dump of all ranks (run side by side) may take."""


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")
_LAMBDA = re.compile(r"\{lambda\([^{}]*\)#\d+\}")
_PARENS = re.compile(r"\([^()]*\)")


def tidy_stack(text: str) -> str:
    """py-spy's dump without its header or the rank's bootstrap frames, C++ frames
    without template arguments."""
    skipping = False
    lines = []
    for line in text.splitlines():
        if line.startswith(("Process ", "Python v")) or not line.strip():
            continue
        if "ddparity/harness/rank.py" in line:  # below it: the rank's bootstrap, not the user's code
            lines.append(line)
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
    return "\n".join(lines) + "\n"


def py_spy_stacks(pids: dict[int, int], timeout: float = PY_SPY_TIMEOUT_S, native: bool = True) -> dict[int, str]:
    """``py-spy dump --native`` of every pid, side by side; {} for those it cannot read
    (no py-spy, ptrace not permitted). Native frames show where C++ code (gloo, NCCL)
    waits; without them a rank inside a collective looks idle."""
    exe = _py_spy()
    if exe is None or not pids:
        return {}

    def launch(pid: int, native: bool) -> subprocess.Popen[str]:
        cmd = [exe, "dump", "--pid", str(pid)] + (["--native"] if native else [])
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)

    deadline = time.monotonic() + timeout
    out: dict[int, str] = {}
    for with_native in (True, False) if native else (False,):
        todo = {r: pid for r, pid in pids.items() if r not in out}
        procs = {r: launch(pid, with_native) for r, pid in todo.items()}
        for rank, proc in procs.items():
            try:
                text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                continue
            if proc.returncode == 0 and text.strip():
                out[rank] = tidy_stack(text)
        if len(out) == len(pids) or time.monotonic() >= deadline:
            break
    return out
