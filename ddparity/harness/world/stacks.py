"""Every rank's stack, from outside: py-spy (native frames included), tidied for a report
by :func:`ddparity.frames.tidy_stack`."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

from ddparity.frames import tidy_stack
from ddparity.harness.ranks.rank import PR_SET_PTRACER

PY_SPY_TIMEOUT_S = 3.5
"""The most a py-spy stack dump of all ranks (run side by side) may take."""
PYTHON_PASS_S = 2.0
"""Of which the Python stacks of every rank (milliseconds each) may take this much; native
frames, slow to unwind from busy ranks on few cores, fill the rest of the budget."""


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


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


def own_native_stacks(timeout: float) -> str:
    """This process's stacks, native frames included (py-spy ``--native`` on itself), or
    "" where py-spy is missing, may not attach or takes longer than ``timeout``. For a
    rank with no controller outside it (a launch): where gloo or NCCL waits, which
    ``sys._current_frames`` cannot show. py-spy starts behind a shell that waits for a
    line, so that this process can name it as its one permitted tracer (``PR_SET_PTRACER``)
    before it attaches; the permission is withdrawn afterwards (a launched rank has no other
    tracer: a World's rank names its controller, and is never asked for its own stack)."""
    exe = _py_spy()
    if exe is None:
        return ""
    proc = subprocess.Popen(["/bin/sh", "-c", 'read _ && exec "$0" dump --native --pid "$1"', exe, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PTRACER, proc.pid, 0, 0, 0)  # fails harmlessly without Yama
    try:
        text, _ = proc.communicate("\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return ""
    finally:
        libc.prctl(PR_SET_PTRACER, 0, 0, 0, 0)
    return tidy_stack(text) if proc.returncode == 0 and text.strip() else ""
