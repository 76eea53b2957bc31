"""Timing all-reduces on a rank: over the world (``health``'s bandwidth and latency) and
pair by pair (``health --pairwise``: which link is slow).

Pairwise, an all-reduce between two ranks alone, pair after pair (the others wait behind a
barrier, so no pair shares a link with another): every pair of nodes, each node standing
as its lowest rank, when the launch spans nodes; every pair of ranks on one node. A slow
pair is named by :func:`ddparity.checks.health.judge_pairs`. Under nccl, ranks that set
:data:`NETWORK_ONLY` before their first communicator measure the network alone.
"""

from __future__ import annotations

import itertools
import os
import socket
import statistics
import time
from typing import Any

from ddparity.harness.protocol import RankContext
from ddparity.harness.recording.recorder import active
from ddparity.measurements import PairTiming

ROUNDS = 2
"""Every pair is timed in each round, the rounds apart in time: a link is slow in all of
them, a rank preempted for a while (a loaded host) in one. (With the median of one round, a
healthy pair read 0.37x the median pair's on a loaded 2-core machine: a false alarm.)"""

NETWORK_ONLY = (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"))
"""What keeps NCCL off NVLink/PCIe peer copies and shared memory: the network alone."""


def network_only(backend: str) -> bool:
    """This rank's NCCL moves bytes through the network alone (:data:`NETWORK_ONLY` set)."""
    return backend == "nccl" and all(os.environ.get(name) == value for name, value in NETWORK_ONLY)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_allreduce(t: Any, warmup: int, iters: int, device: str, group: Any = None, best: bool = False) -> float:
    """Median (``best``: the fastest) seconds of one all-reduce (over ``group``, the world by
    default), each started together behind a barrier."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def every_host(ctx: RankContext) -> list[str]:
    """Each rank's host name, by rank (every rank of the world calls it: a collective)."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def pairs_of(hosts: list[str]) -> tuple[list[tuple[int, int]], str]:
    """The pairs to time and what a rank stands for: nodes (each by its lowest rank) when
    ``hosts`` (each rank's) name more than one, else ranks."""
    firsts = list(dict.fromkeys(hosts))
    if len(firsts) > 1:
        return list(itertools.combinations([hosts.index(h) for h in firsts], 2)), "node"
    return list(itertools.combinations(range(len(hosts)), 2)), "rank"


def measure_pairs(ctx: RankContext, nbytes: int, warmup: int, iters: int,
                  slow: frozenset[int] = frozenset()) -> list[PairTiming]:
    """Every pair's all-reduce of ``nbytes``, one pair at a time, :data:`ROUNDS` rounds; each
    pair's time the fastest of its repeats in every round; returns the pairs this rank was
    one end of. Every rank calls it (it creates a group per pair). ``slow``: a drilled pair
    (``slow_link@A-B``), timed four times slower."""
    import torch
    import torch.distributed as dist

    pairs, unit = pairs_of(every_host(ctx))
    groups = [dist.new_group(list(pair)) for pair in pairs]  # every rank creates every group, in order
    alone = network_only(ctx.backend)
    best: dict[tuple[int, int], float] = {}
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device)
    for _ in range(ROUNDS):
        for pair, group in zip(pairs, groups):
            active().set_phase(-1, "pairwise")
            dist.barrier()  # one pair at a time
            if ctx.rank not in pair:
                continue
            seconds = time_allreduce(t, warmup, iters, ctx.device, group=group, best=True)
            if set(pair) == slow:  # a link at a quarter of its speed
                time.sleep(3 * seconds)
                seconds *= 4
            best[pair] = min(seconds, best.get(pair, seconds))
    mine = [PairTiming(a, b, t.numel() * 4, seconds, unit, alone) for (a, b), seconds in best.items()]
    dist.barrier()
    for group in groups:
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    return mine
