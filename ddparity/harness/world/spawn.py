"""Starting rank processes: forked from the controller or from a forkserver, joined
within a deadline. :class:`ddparity.World` decides when; this module knows how.

Ranks are forked from this (already torch-importing) process, or from a forkserver that
preloaded torch when forking here is unsafe (see :func:`start_method`).
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import os
import threading
import time
from multiprocessing import popen_forkserver, spawn
from multiprocessing.connection import Connection, wait
from typing import Any

from ddparity.errors import WorldStartError, signal_name
from ddparity.harness.protocol import RankReady, RankSpec, RankStartFailed
from ddparity.harness.world import rendezvous
from ddparity.harness.world.output import OutputReader

PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "cloudpickle",
           "ddparity.harness.ranks.rank", "ddparity.harness.recording.recorder", "ddparity.harness.recording.ddp_buckets",
           "ddparity.harness.sidechannel", "ddparity.harness.recording.fingerprint"]
"""Imported once before ranks are forked. ``torch._dynamo`` is imported lazily by the
first DDP construction (about 1 s); paying it here makes every rank's first DDP cheap."""


def preload() -> None:
    """Import :data:`PRELOAD`, then move every object alive to the garbage collector's
    permanent generation (once per process).

    torch with ``torch._dynamo`` is over a million long-lived objects; each full
    collection scanned them all (about 0.1 s here; a 30-test pytest session ran 12, and
    one more at interpreter exit). Frozen, they are skipped by every later collection
    and are still freed by reference counting; the cost is that cyclic garbage among
    objects alive at this moment is never collected.
    """
    global _preloaded
    if _preloaded:
        return
    for name in PRELOAD:
        __import__(name)
    gc.freeze()
    _preloaded = True


_preloaded = False

FORK_JOIN_S = 15.0
"""Forked gloo ranks join in about a second; after this long they are started again from
the forkserver (see ``World._launch``)."""


def start_method(backend: str, threads_per_rank: int, clean_start: bool = False) -> str:
    """Fork from here when it is safe, else from a forkserver that preloaded torch.

    Unsafe: a CUDA world, a process whose CUDA driver is initialised or whose autograd
    engine started its threads (:func:`autograd_threads_started`), ranks with more
    than one intra-op thread (libgomp hangs in a child forked after the parent ran a
    parallel region; with one thread it never enters one), and a world asked to start
    clean (``clean_start``: the host of simulated ranks, many threads running torch at
    once. Forked from a long-lived controller, a pytest worker hundreds of tests in, it
    died with SIGSEGV in four fresh-CI runs, each time in plain forward or DDP work that
    40 runs from a fresh controller never broke: what the fork inherits is suspect).
    """
    if (backend == "gloo" and threads_per_rank == 1 and not clean_start and not rendezvous.cuda_driver_initialized()
            and not autograd_threads_started()):
        return "fork"
    return "forkserver"


AUTOGRAD_THREAD = "pt_autograd_"
"""How torch names its autograd engine's device threads (``pt_autograd_0``, ...)."""


def autograd_threads_started() -> bool:
    """Whether torch's autograd engine started its device threads in this process (AOT
    autograd tracing a compiled model, a CUDA backward): every child forked after that fails
    at its first backward ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"), a crash that would read as the user's. Read from the
    threads' names (Linux's /proc); False where they cannot be read."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith(AUTOGRAD_THREAD):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


_WARMING: threading.Thread | None = None


def warm_forkserver() -> None:
    """Start the forkserver in the background (once per process): it imports :data:`PRELOAD`
    (about 5 s here), which a world started from it would otherwise wait for; started while
    the reference trains, it is ready by then. A world that asks for it meanwhile waits on
    multiprocessing's own lock around the start."""
    global _WARMING
    if _WARMING is not None:
        return

    def start() -> None:
        from multiprocessing import forkserver

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        short_socket_folder()
        try:
            forkserver.ensure_running()
        except Exception:  # noqa: BLE001 - the world that needs it starts it, and reports its error
            return
        _clean_up_after_the_forkserver()

    _WARMING = threading.Thread(target=start, name="ddparity-forkserver", daemon=True)
    _WARMING.start()


class JoinTimeout(Exception):
    """Forked ranks did not join in time (internal: the World retries from a forkserver)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"ranks {ranks} did not join")
        self.ranks = ranks


class Ranks:
    """The live processes of one generation; shared with the finalizer."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.Process] = []
        self.controls: list[Connection] = []
        self.readers: list[OutputReader] = []

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                try:
                    proc.kill()
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            proc.join(timeout=5)
        for conn in self.controls:
            conn.close()
        for reader in self.readers:
            reader.join(timeout=1)
        self.procs, self.controls, self.readers = [], [], []


def queued(conn: Connection) -> list[Any]:
    """Every message already waiting on ``conn``; stops at EOF (a dead rank)."""
    messages: list[Any] = []
    while True:
        try:
            if not conn.poll():
                return messages
            messages.append(conn.recv())
        except (EOFError, OSError):
            return messages


_LAUNCHER: concurrent.futures.ThreadPoolExecutor | None = None


def _started(proc: Any) -> None:
    """``proc.start()`` from a thread that lives as long as this process. A rank asks to be
    killed when its parent dies (``PR_SET_PDEATHSIG``), and the kernel ties that to the
    *thread* that forked it: a World started from a worker thread (a check in a
    ThreadPoolExecutor) would lose its ranks when that thread ends."""
    global _LAUNCHER
    if threading.current_thread() is threading.main_thread():
        proc.start()
        return
    if _LAUNCHER is None:
        _LAUNCHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddparity-launcher")
    _LAUNCHER.submit(proc.start).result()


_SWEPT: set[str] = set()

UNIX_PATH_MAX = 107
"""The longest AF_UNIX socket path Linux takes (108 bytes with the terminating NUL)."""
_SOCKET_NAME = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def short_socket_folder() -> None:
    """The forkserver listens on a socket in multiprocessing's temporary folder, made in
    ``$TMPDIR``: where that is too deep for a socket's path (a test's or a job's temporary
    folder), multiprocessing's folder of this process is made in ``/tmp`` instead (private
    to this user, 0700, removed at exit as multiprocessing removes its own), before it makes
    one; CPython 3.11 raises ``OSError: AF_UNIX path too long`` there."""
    import shutil
    import tempfile
    from multiprocessing import process, util

    config = process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is not None or len(tempfile.gettempdir()) + _SOCKET_NAME <= UNIX_PATH_MAX:
        return
    folder = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    config["tempdir"] = folder
    util.Finalize(None, shutil.rmtree, args=[folder], kwargs={"ignore_errors": True}, exitpriority=-100)


def _clean_up_after_the_forkserver() -> None:
    """multiprocessing's temporary directory (the forkserver's socket) is removed by a
    finalizer that a killed controller never runs: a janitor removes it then."""
    from multiprocessing import util

    from ddparity.harness.janitor import remove_when_gone

    path = util.get_temp_dir()
    if path not in _SWEPT:
        _SWEPT.add(path)
        remove_when_gone(path)


def start_ranks(ranks: Ranks, specs: list[RankSpec], method: str) -> None:
    """Start one process per spec (``fork`` or ``forkserver``) into ``ranks``, each with a
    control pipe and an output pipe read by an :class:`OutputReader`."""
    mp: Any = multiprocessing.get_context(method)
    if method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
        short_socket_folder()
    n = len(specs)
    controls = [mp.Pipe(duplex=True) for _ in range(n)]
    outputs = [mp.Pipe(duplex=False) for _ in range(n)]
    for rank, spec in enumerate(specs):
        inherited: tuple[int, ...] = ()
        if method == "fork":
            mine = {controls[rank][1].fileno(), outputs[rank][1].fileno()}
            inherited = tuple(
                fd
                for pair in controls + outputs
                for c in pair
                if not c.closed and (fd := c.fileno()) not in mine
            )
        process_class = _ForkserverRank if method == "forkserver" else mp.Process
        proc = process_class(
            target=_rank_entry,
            args=(spec, controls[rank][1], outputs[rank][1], inherited),
            name=f"ddparity-rank{rank}",
        )
        if method == "fork":
            # The child must never run the finalizers of objects it inherited: a
            # collected copy of an old store server would join a thread that does
            # not exist there and hang the rank. It is forked with the collector off
            # and freezes everything it inherited before turning it back on.
            enabled = gc.isenabled()
            gc.disable()
            try:
                _started(proc)
            finally:
                if enabled:
                    gc.enable()
        else:
            proc.start()  # the forkserver forks it: its parent is the forkserver's main thread
            _clean_up_after_the_forkserver()
        ranks.procs.append(proc)
        ranks.controls.append(controls[rank][0])
        controls[rank][1].close()
        outputs[rank][1].close()
        reader = OutputReader(rank, outputs[rank][0])
        reader.start()
        ranks.readers.append(reader)


def await_ready(ranks: Ranks, join_timeout: float, what: str, retry_possible: bool = False) -> None:
    """Wait until every rank reported ready. A rank that fails or dies, or a deadline
    passed, is a :class:`WorldStartError` with the ranks' output (``what`` names the
    world); with ``retry_possible`` a deadline is a :class:`JoinTimeout` instead."""
    waiting = set(range(len(ranks.procs)))
    deadline = time.monotonic() + join_timeout
    problem = ""
    while waiting and not problem:
        left = deadline - time.monotonic()
        if left <= 0:
            if retry_possible:
                raise JoinTimeout(sorted(waiting))
            problem = f"ranks {sorted(waiting)} did not join within {join_timeout:g} s"
            break
        watched: dict[Any, int] = {ranks.controls[r]: r for r in waiting}
        watched.update({ranks.procs[r].sentinel: r for r in waiting})
        for obj in wait(list(watched), timeout=left):
            rank = watched[obj]
            if rank not in waiting:
                continue
            for msg in queued(ranks.controls[rank]):
                if isinstance(msg, RankReady):
                    waiting.discard(rank)
                elif isinstance(msg, RankStartFailed):
                    problem = f"rank {rank} could not join the process group: {msg.error}\n{msg.traceback}"
            if rank in waiting and not problem and not isinstance(obj, Connection):
                proc = ranks.procs[rank]
                proc.join(timeout=1)
                problem = f"rank {rank} died during start-up ({signal_name(proc.exitcode)})"
    if problem:
        outputs = {r: rd.take_all(settle=0.5) for r, rd in enumerate(ranks.readers)}
        ranks.kill()
        detail = "".join(f"\n--- rank {r} output ---\n{o}" for r, o in outputs.items() if o.strip())
        raise WorldStartError(f"could not start {what}: {problem}{detail}")


class _NoMainPopen(popen_forkserver.Popen):
    """Forkserver launch without re-running the user's ``__main__`` in the rank.

    multiprocessing re-imports the parent's main script in every forkserver child, which
    re-executes an unguarded script (and pays its imports). Ranks need nothing from it:
    tasks travel by value (cloudpickle).
    """

    def _launch(self, process_obj: Any) -> None:
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main  # the controller is single-threaded here
        try:
            super()._launch(process_obj)  # type: ignore[misc]  # untyped in typeshed
        finally:
            spawn.get_preparation_data = original


class _ForkserverRank(multiprocessing.get_context("forkserver").Process):  # type: ignore[misc]
    @staticmethod
    def _Popen(process_obj: Any) -> _NoMainPopen:
        return _NoMainPopen(process_obj)


def _let_the_forkserver_go() -> None:
    """A forkserver child holds the write end of the forkserver's "alive" pipe, so the
    forkserver (this rank's parent) would outlive the controller as long as the rank does,
    and the rank's death signal, tied to its parent, would never fire: ranks of a killed
    controller lived on (a forked rank inherits the controller's copy). A rank never asks the
    forkserver for processes: it lets go."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def _rank_entry(spec: RankSpec, control: Connection, output: Connection, inherited: tuple[int, ...]) -> None:
    _let_the_forkserver_go()  # a forked rank too: it inherited the controller's copy
    gc.freeze()  # what a forked rank inherited is never collected here (see start_ranks)
    gc.enable()
    os.environ.update(dict(spec.env))  # before anything reads it: NCCL reads its own once
    from ddparity.harness.ranks.rank import rank_main

    rank_main(spec, control, output, inherited)
