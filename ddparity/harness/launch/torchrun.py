"""The environment of a launch (torchrun, srun, or any ``env://`` launcher): which rank
this process is, the launch's store, its process group, and a process group of one.

On a cluster the launcher owns the processes. :func:`connect` reaches the launch's store
(torchrun's agent holds it; rank 0 under srun) before any process group exists, so the
watch threads (:mod:`ddparity.harness.launch.watchdog`) can see every rank from the start;
:func:`form_world` then joins the group the model trains on (and a gloo group of
ddparity's own); :func:`alone` gives rank 0 a group of its own for work that must not wait
for the other ranks (the reference). A rank that cannot reach the store is ended by a
:class:`Watchdog` (its stacks, exit code 3) instead of waiting for the store's timeout.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ddparity.errors import Exit, UsageError, WorldStartError
from ddparity.harness.protocol import RankContext

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def _slurm_tasks() -> bool:
    """A task of a Slurm job step of several tasks (``srun -n N ...``), not started by torchrun."""
    return ("RANK" not in os.environ and "SLURM_STEP_ID" in os.environ
            and os.environ.get("SLURM_NTASKS", "1").isdigit() and int(os.environ.get("SLURM_NTASKS", "1")) > 1)


def launched() -> bool:
    """True in a process started by torchrun (or another ``env://`` launcher), or as one
    task of a Slurm step of several (``srun``): the launched processes are the world."""
    if _slurm_tasks():
        for ours, theirs in SLURM.items():
            os.environ.setdefault(ours, os.environ.get(theirs, "0"))
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise UsageError(f"under srun, set {' and '.join(missing)} (where rank 0 listens), e.g. export "
                             f"MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500")
        return True
    return all(k in os.environ for k in ENV)


def node_id() -> str:
    """Which machine this process is on, as the launcher numbers them (torchrun's node
    rank, Slurm's node id), else the host name."""
    import socket

    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if key in os.environ:
            return f"node {os.environ[key]}"
    return socket.gethostname()


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text or "")
    except ValueError:
        raise UsageError(f"${name}={text!r} is not an integer; is this process started by torchrun?") from None


def context(backend: str) -> RankContext:
    """This process's rank, world size, backend (``auto``: nccl when it has a GPU) and device."""
    import torch

    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK", 0)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend {backend!r} under torchrun: use auto, gloo or nccl")
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"backend nccl: LOCAL_RANK {local_rank} but {torch.cuda.device_count()} CUDA device(s) "
                         f"visible; start one process per GPU (--nproc-per-node)")
    return RankContext(rank, world_size, backend, f"cuda:{local_rank}" if backend == "nccl" else "cpu")


class Watchdog:
    """Past ``seconds``, print this process's stacks and exit with code 3."""

    def __init__(self, seconds: float, rank: int, what: str) -> None:
        self._timer = threading.Timer(seconds, self._fire, args=(seconds, rank, what))
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    @staticmethod
    def _fire(seconds: float, rank: int, what: str) -> None:
        sys.stderr.write(f"ddparity: rank {rank}: {what} did not finish within {seconds:g} s (a hang: a rank that "
                         f"died or never arrived, or a broken link); this rank's stacks:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(Exit.HANG_OR_CRASH)


@dataclass
class Launch:
    """This process's place in a launch: its rank context, the launch's store (under a
    ddparity prefix), its node, and (once :func:`form_world` ran) a gloo group of its own
    for serving the reference."""

    ctx: RankContext
    store: Any
    node: str
    root_store: Any = None
    serve: Any = None


def _pg_timeout(timeout: float) -> timedelta:
    """The process group's own timeout stays out of the watch's way: the watch ends a hang first."""
    from ddparity.harness.launch.watchdog import DEAD_S

    return timedelta(seconds=timeout + 4 * DEAD_S + 60)


def connect(backend: str, timeout: float, tasks: tuple[int, ...]) -> Launch:
    """Reach the launch's store (torchrun's agent's, or rank 0's) without forming the
    process group yet, create this rank's side-channel keys for ``tasks`` and wait (a store
    barrier, bounded by a watchdog) until every rank has."""
    import time

    import torch
    import torch.distributed as dist

    from ddparity.harness import store_keys
    from ddparity.harness.sidechannel import record_keys

    ctx = context(backend)
    if ctx.device.startswith("cuda"):
        torch.cuda.set_device(ctx.device)
    with Watchdog(timeout, ctx.rank, "reaching the launch's store"):
        try:
            root, _, _ = next(dist.rendezvous("env://", timeout=_pg_timeout(timeout)))
        except Exception as exc:  # a rendezvous that fails is the cluster's problem, said plainly
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise WorldStartError(f"rank {ctx.rank}: could not reach the launch's store at {where}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'launch')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store = dist.PrefixStore(f"ddparity/{run_id}/", root)
        node = node_id()
        store_keys.prepare(store, ctx.rank, node, record_keys(ctx.rank, tasks))
        store.add(store_keys.JOINED, 1)
        while int(store.add(store_keys.JOINED, 0)) < ctx.world_size:
            time.sleep(0.05)
    return Launch(ctx, store, node, root)


def form_world(launch: Launch, timeout: float) -> None:
    """Every rank: the launch's process group (the one the model trains on), and a gloo
    group of ddparity's own (``launch.serve``)."""
    import torch.distributed as dist

    ctx = launch.ctx
    try:
        dist.init_process_group(ctx.backend, store=dist.PrefixStore("default_pg", launch.root_store),
                                rank=ctx.rank, world_size=ctx.world_size, timeout=_pg_timeout(timeout))
        launch.serve = dist.new_group(backend="gloo", timeout=_pg_timeout(timeout))
    except Exception as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise WorldStartError(f"rank {ctx.rank}: could not form the {ctx.backend} process group at {where}: "
                              f"{type(exc).__name__}: {exc}") from exc


@contextmanager
def alone(backend: str) -> Iterator[None]:
    """A process group of this process alone (the reference, as a local check runs it: a
    collective the user's code issues is one rank's, not a wait for ranks that are not
    there)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
