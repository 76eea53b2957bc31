"""Where local worlds' ranks meet, and the choice of backend and device.

A local world's process group meets through a ``FileStore`` in the world's private folder
(mode 0700, :func:`ddparity.harness.sidechannel.private_root`; one file per generation,
see ``World._rendezvous``): no port to find, no key another local user could write, no
reverse DNS lookup of the store's peer (torch's TCPStore client did one, and a dropped
query stalled a world's start by 5 s). Gloo's own pair connections remain on loopback
(``GLOO_SOCKET_IFNAME``, :func:`loopback_ifname`).
"""

from __future__ import annotations

import socket

from ddparity.errors import UsageError
from ddparity.settings import WORLD_BACKENDS


def loopback_ifname() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name == "lo" or name.startswith("lo0"):
            return name
    return next((n for n in names if n.startswith("lo")), None)


def cuda_device_count() -> int:
    """Number of CUDA devices, counted through NVML so that this process stays fork-safe
    (``torch.cuda.device_count`` may call ``cuInit`` otherwise)."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    try:
        from torch.cuda import _device_count_nvml  # private; present since torch 2.0

        count = int(_device_count_nvml())
        if count >= 0:
            return count
    except Exception:
        pass
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a broken driver is the same as no GPU for choosing a backend
        return 0


_CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialized() -> bool:
    """Whether this process has called ``cuInit`` (so a forked child cannot use CUDA).

    ``torch.cuda.is_initialized()`` is not enough: ``torch.cuda.is_available()`` and
    friends initialise the driver without creating torch's context, and a child forked
    after that fails at its first CUDA call ("initialization error", seen on an H200
    machine). Any driver call made before ``cuInit`` answers CUDA_ERROR_NOT_INITIALIZED
    without initialising anything, which makes ``cuDeviceGetCount`` an exact probe.
    """
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False  # no driver: nothing to initialise
    count = ctypes.c_int(0)
    try:
        return int(libcuda.cuDeviceGetCount(ctypes.byref(count))) != _CUDA_ERROR_NOT_INITIALIZED
    except AttributeError:
        return True  # an unknown driver library: assume the worst, use the forkserver


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn ``auto`` into a concrete backend and reject what cannot run here."""
    if backend not in WORLD_BACKENDS:
        if backend == "threaded":
            raise UsageError(
                "backend 'threaded' (simulated ranks, threads in one process) is for `ddparity check` "
                "only; worlds, health checks and profiles need real processes: use gloo (CPU) or nccl (GPUs)"
            )
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(WORLD_BACKENDS)}")
    gpus = cuda_device_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise UsageError(
            f"backend 'nccl' needs one CUDA device per rank: world size {world_size}, "
            f"{gpus} device(s) visible; use --backend gloo on CPU, or a smaller world size"
        )
    return backend
