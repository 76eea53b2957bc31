"""The program a rank process runs: join the world, then run tasks until told to stop.

This module is the rank side of the harness. It imports nothing from ``ddparity.checks``,
the reports, the CLI or the pytest plugin (a test pins it); it talks to the controller
only through the messages of :mod:`ddparity.harness.protocol` and the side channel.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddparity.harness.recording.recorder import Recorder

from ddparity.harness.protocol import (
    OUTPUT_END_MARK,
    RankContext,
    RankReady,
    RankSpec,
    RankStartFailed,
    RunTask,
    Shutdown,
    TaskDone,
)

_PR_SET_PDEATHSIG = 1
PR_SET_PTRACER = 0x59616D61
"""prctl option: the process that may ptrace this one under Yama's ``ptrace_scope`` 1 (the
default on Ubuntu, where only an ancestor may)."""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent dies, even by SIGKILL.

    The parent is the controller (fork) or its forkserver, which exits when the
    controller does, or ``watch``'s local launcher (run before exec). If the parent died
    before the request took effect, leave now.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def _allow_stack_dumps(controller_pid: int) -> None:
    """Let the controller (and py-spy, its child) read our stack where Yama restricts
    ptrace to ancestors (``kernel.yama.ptrace_scope = 1``)."""
    if controller_pid and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, controller_pid, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _route_output(output: Connection) -> None:
    """Send fd 1 and 2 (Python and C-level output alike) to the controller's pipe."""
    fd = output.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    output.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    # A segfault or a SIGUSR1 from the controller prints every thread's Python stack.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)


def _join_process_group(spec: RankSpec):  # -> torch.distributed.FileStore
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    if spec.loopback_ifname and spec.backend == "gloo":
        # gloo otherwise listens on the address the hostname resolves to (a LAN one).
        os.environ["GLOO_SOCKET_IFNAME"] = spec.loopback_ifname
    device_id = None
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(spec.device)
        device_id = torch.device(spec.device)
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    client = dist.FileStore(spec.rendezvous, spec.world_size)
    client.set_timeout(timeout)
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(spec.store_prefix, client),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return client


def _install_recorder(spec: RankSpec, client) -> Recorder:  # noqa: ANN001
    """The collective ledger and progress heartbeat, written to the world's private folder."""
    from ddparity.harness.recording.recorder import install_recorder
    from ddparity.harness.sidechannel import FileRankChannel

    return install_recorder(FileRankChannel(spec.side_dir, spec.store_prefix, spec.rank))


def encode_exception(exc: BaseException) -> bytes:
    import cloudpickle

    from ddparity.errors import RemoteError

    tb = "".join(traceback.format_exception(exc))
    try:
        data = cloudpickle.dumps(exc)
        cloudpickle.loads(data)  # some exceptions pickle but cannot be rebuilt
        return data
    except Exception:
        return cloudpickle.dumps(RemoteError(type(exc).__name__, str(exc), tb))


def follow_task_timeout(seconds: float) -> None:
    """The default process group's timeout (and its store's) set to ``seconds``: a task
    allowed a longer wait than the world was built with (``--timeout 600`` for a long
    compile) is stopped by the controller's report, never first by gloo's own timeout."""
    import torch.distributed as dist

    if not seconds or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    setter = getattr(c10d, "_set_pg_timeout", None)  # torch >= 2.3
    if setter is not None:
        with contextlib.suppress(Exception):  # a backend that cannot change it keeps the world's
            setter(timeout)
    store = getattr(c10d._get_default_store(), "set_timeout", None) if hasattr(c10d, "_get_default_store") else None
    if store is not None:
        with contextlib.suppress(Exception):
            store(timeout)


def _run_task(msg: RunTask, ctx: RankContext) -> TaskDone:
    import cloudpickle

    sys.path[:] = list(msg.sys_path)
    follow_task_timeout(msg.pg_timeout_s)
    started = time.perf_counter()
    try:
        fn, args, kwargs = cloudpickle.loads(msg.payload)
        value = fn(ctx, *args, **kwargs)
        payload = cloudpickle.dumps(value)
    except BaseException as exc:  # everything, SystemExit included, becomes a report
        return TaskDone(
            task_id=msg.task_id,
            rank=ctx.rank,
            ok=False,
            payload=encode_exception(exc),
            error=f"{type(exc).__name__}: {exc}",
            traceback="".join(traceback.format_exception(exc)),
            seconds=time.perf_counter() - started,
        )
    return TaskDone(msg.task_id, ctx.rank, True, payload, "", "", time.perf_counter() - started)


RELEASE_ABOVE_BYTES = 1 << 30
"""A rank this large after a task collects its garbage and trims its heap (100 ms with
transformers imported: not worth it after a small model's check)."""


def released() -> None:
    """Hand a finished replica's memory back to the system: a warm rank that idles after
    training a large model should not hold it (reference cycles through hooks, and glibc
    keeps freed small blocks)."""
    import gc

    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = RELEASE_ABOVE_BYTES
    if resident < RELEASE_ABOVE_BYTES:
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rank_main(
    spec: RankSpec, control: Connection, output: Connection, inherited_fds: tuple[int, ...] = ()
) -> None:
    """Entry point of a rank process (target of ``multiprocessing.Process``)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    for fd in inherited_fds:  # other ranks' pipe ends, inherited through fork
        try:
            os.close(fd)
        except OSError:
            pass
    _route_output(output)
    _allow_stack_dumps(spec.controller_pid)
    # torch.compile's kernels cached in the controller's private folder (warm across its
    # checks, gone with it), not in a /tmp folder any local user could have made first
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(spec.side_dir), "compiled"))
    started = time.perf_counter()
    try:
        client = _join_process_group(spec)
        recorder = _install_recorder(spec, client)
    except BaseException as exc:
        control.send(RankStartFailed(spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        os._exit(1)
    control.send(RankReady(spec.rank, os.getpid(), time.perf_counter() - started))
    ctx = RankContext(spec.rank, spec.world_size, spec.backend, spec.device)
    while True:
        try:
            msg = control.recv()
        except (EOFError, OSError):
            break  # the controller is gone
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, RunTask):
            recorder.begin_task(msg.task_id)
            done = _run_task(msg, ctx)
            recorder.end_task()
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(1, OUTPUT_END_MARK % msg.task_id)
            control.send(done)
            del done, msg
            released()  # a warm rank idles on what it needs, not on the last task's model
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        # Skip interpreter teardown: a forked rank holds copies of the controller's
        # objects (its store server among them) whose finalizers must not run here.
        os._exit(0)
