"""A training script ddparity did not write, run as it is inside a watched rank
(``ddparity watch``), and the local launcher that starts such ranks without torchrun.

:func:`run_script` runs the script as ``python train.py ARGS`` would: as ``__main__``, with
its ``sys.argv`` and its folder first on ``sys.path``; its traceback starts at its own
file. :class:`FrameTicker` tells the recorder the rank is computing while the script's
Python moves (so a long step without collectives is not a hang, and a rank waiting in a
collective, whose main thread stands still, is one). :func:`launch_locally` is torchrun's
agent for one machine: it holds the launch's store, starts the ranks (each dies with it),
and returns the verdict the ranks published (else the script's own exit code).
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

TICK_S = 0.5
"""How often the main thread's place in the script is sampled."""

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


class FrameTicker:
    """Ticks ``recorder`` whenever the main thread's Python frame or instruction moved
    since the last sample (every :data:`TICK_S`)."""

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder
        self._main = threading.main_thread().ident
        self._last: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddparity-ticker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            frame = sys._current_frames().get(self._main or 0)
            place = (id(frame), frame.f_lasti) if frame is not None else None
            if place != self._last:
                self._last = place
                self._recorder.tick()

    def stop(self) -> None:
        self._stop.set()


def run_script(path: str, args: list[str], module: bool = False) -> int:
    """Run ``path`` (``module``: a module's name, as ``python -m`` does) as ``__main__`` with
    ``args``; its exit code (``sys.exit``'s, else 0). An exception it raises propagates
    (:func:`from_script` trims its traceback)."""
    sys.argv = [path, *args]
    try:
        if module:
            runpy.run_module(path, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(path))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def script_file(path: str, module: bool = False) -> str | None:
    """The script's file (a module's, found as ``python -m`` would find it), or None when
    there is none."""
    if not module:
        return os.path.abspath(path) if os.path.isfile(path) else None
    import importlib.util

    try:
        spec = importlib.util.find_spec(path)
    except (ImportError, ValueError):
        return None
    return os.path.abspath(spec.origin) if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def from_script(exc: BaseException, script: str) -> BaseException:
    """``exc`` with its traceback starting at the frame of ``script`` (its file: not at
    ddparity's and runpy's frames that ran it)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return exc.with_traceback(tb) if tb is not None else exc


def exit_as_the_script_would(code: int) -> NoReturn:
    """End this process as the interpreter ends a script — its non-daemon threads joined, its
    ``atexit`` handlers run, output flushed — then without C++ static destructors: with
    torch 2.13's gloo one of them aborts a process now and then as it exits ("terminate called
    without an active exception", SIGABRT; seen with plain ``torchrun train.py`` too), which
    would turn a passing run's exit code into a crash."""
    import atexit

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# -- the local launcher (``python -m ddparity watch --nproc-per-node N``) ---------------


def launch_locally(nproc: int, rank_argv: list[str], wait_s: float, extra_env: dict[str, str]) -> list[int]:
    """Start ``nproc`` ranks running ``python -m ddparity watch <rank_argv>`` as torchrun
    would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, the store at ``MASTER_PORT`` held
    here) and wait for them: each rank's exit code (negative: the signal that ended it).
    A rank still running ``wait_s`` after another ended is killed (the ranks' watches end
    a launch in seconds; this bounds the wait should they not)."""
    import secrets

    import torch.distributed as dist

    from ddparity.harness.ranks.rank import die_with_parent

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
               **{RUN_ID_ENV: f"watch-{secrets.token_hex(4)}"}, **extra_env)
    procs: list[subprocess.Popen[Any]] = []
    try:
        for r in range(nproc):
            env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r))
            procs.append(subprocess.Popen([sys.executable, "-m", "ddparity", "watch", *rank_argv], env=env_r,
                                          preexec_fn=die_with_parent))
        first_end: float | None = None
        while any(p.poll() is None for p in procs):
            time.sleep(0.1)
            if first_end is None and any(p.poll() is not None for p in procs):
                first_end = time.monotonic()
            if first_end is not None and time.monotonic() - first_end > wait_s:
                break
        return [_code(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _code(proc: subprocess.Popen[Any]) -> int:
    return int(proc.returncode) if proc.returncode is not None else -int(signal.SIGKILL)
