"""Rank side of ``health``'s ``transfers`` check: copy bandwidth host to device and device to
host (pinned memory), and device to device between every pair a host's first rank sees.

Copies share a host's PCIe switches and root ports, so a host's ranks copy in turn (every
host's k-th rank at once: hosts share nothing), and the host's first rank times its peer
pairs while the others wait. Judged by :mod:`ddparity.checks.transfers`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ddparity.harness.health.allreduce_timing import every_host
from ddparity.harness.protocol import RankContext

COPY_BYTES = 256 << 20
COPIES = 5
"""Each figure is the best of this many copies of :data:`COPY_BYTES` (after one unmeasured)."""


def measure_transfers(ctx: RankContext) -> dict[str, Any] | str:
    """This rank's copy bandwidths (GB/s), or why none were measured. Every rank of the world
    calls it (it waits at barriers); on CPU ranks it returns at once, with the reason."""
    if not ctx.device.startswith("cuda"):
        return f"no CUDA device (the ranks run on {ctx.device})"
    import torch
    import torch.distributed as dist

    hosts = every_host(ctx)
    mine = [r for r, h in enumerate(hosts) if h == hosts[ctx.rank]]
    slot = mine.index(ctx.rank)
    device = torch.device(ctx.device)
    reading: dict[str, Any] = {"name": torch.cuda.get_device_name(device), "index": device.index}
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    for turn in range(max(Counter(hosts).values())):
        if turn == slot:
            reading["h2d_gbps"] = _best_gbps(on_device, host)
            reading["d2h_gbps"] = _best_gbps(host, on_device)
        dist.barrier()
    if slot == 0:
        reading["peers"] = _peers()
    dist.barrier()
    return reading


def _peers() -> list[dict[str, Any]]:
    """Every ordered pair of this process's visible devices: peer access, and the copy's
    bandwidth where there is access."""
    import torch

    count = torch.cuda.device_count()
    out = []
    for src in range(count):
        for dst in range(count):
            if src == dst:
                continue
            access = bool(torch.cuda.can_device_access_peer(dst, src))
            row: dict[str, Any] = {"src": src, "dst": dst, "access": access}
            if access:
                row["gbps"] = _best_gbps(torch.empty(COPY_BYTES, dtype=torch.uint8, device=f"cuda:{dst}"),
                                         torch.empty(COPY_BYTES, dtype=torch.uint8, device=f"cuda:{src}"))
            out.append(row)
    return out


def _best_gbps(dst: Any, src: Any) -> float:
    """GB/s of ``dst.copy_(src)`` (each on its device, or pinned host memory), the best of
    :data:`COPIES`."""
    import torch

    devices = [t.device for t in (dst, src) if t.device.type == "cuda"]
    best = float("inf")
    for i in range(COPIES + 1):
        for d in devices:
            torch.cuda.synchronize(d)
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        for d in devices:
            torch.cuda.synchronize(d)
        if i:
            best = min(best, time.perf_counter() - started)
    return COPY_BYTES / best / 1e9
