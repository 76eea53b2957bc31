"""Rank side of ``ddparity health``: what one rank measures about itself and its links.

Runs inside a ddparity World (``ddparity health``) or in each process torchrun starts
(``torchrun ... -m ddparity.cli health``); either way ``torch.distributed`` is initialised
and every rank calls :func:`health_task` with the same options. Results are plain data
(:class:`RankHealth`); :mod:`ddparity.checks.health` judges them.

Fault drills: ``DDPARITY_HEALTH_FAULT=KIND@RANK`` makes that rank misbehave the way bad
nodes do, so a deployment pipeline can prove its gate catches them — ``wrong_allreduce``
(a corrupted reduction result), ``wrong_matmul`` (a device that computes wrong),
``flip_bits`` (silent data corruption: one bit of one result, far inside any tolerance),
``flaky_bits`` (one bit of one repeat of ``--long``'s stress pass: a device unstable under load),
``wrong_step`` (a rank whose replica trains wrong: the gate's training check, in
:mod:`ddparity.verbs.health`),
``slow_compute`` (a throttled device), ``hang`` (a rank that never reaches the
collective), and ``slow_link@A-B`` (the link between ranks A and B at a quarter of its
speed: ``--pairwise`` names that pair, :mod:`ddparity.harness.health.allreduce_timing`).
"""

from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from ddparity.errors import UsageError
from ddparity.harness.health.allreduce_timing import measure_pairs, sync, time_allreduce
from ddparity.harness.health.stress_probe import digest, stress
from ddparity.harness.health.transfer_probe import measure_transfers
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.recording.recorder import active
from ddparity.measurements import PairTiming, RankHealth
from ddparity.settings import HEALTH_SIZES_MIB

FAULT_ENV = "DDPARITY_HEALTH_FAULT"
FAULTS = ("wrong_allreduce", "wrong_matmul", "flip_bits", "flaky_bits", "slow_compute", "wrong_step", "hang",
          "slow_link")
MATMUL_N = 256
CORRECTNESS_NUMELS = (1, 1000, 262_144)


@dataclass(frozen=True, slots=True)
class HealthOptions:
    sizes_bytes: tuple[int, ...] = tuple(mib << 20 for mib in HEALTH_SIZES_MIB)
    iters: int = 5
    warmup: int = 2
    pairwise: bool = False
    """Also time an all-reduce pair by pair of nodes (of ranks on one node): which link is slow."""
    long_s: float = 0.0
    """``--long``: seconds of the stress pass (:mod:`ddparity.harness.health.stress_probe`); 0: none."""


class Fault(NamedTuple):
    kind: str
    rank: int
    peer: int | None = None
    """The other end of a ``slow_link``."""


def parse_fault(text: str | None) -> Fault | None:
    """``KIND@RANK`` (``slow_link@A-B``) from :data:`FAULT_ENV`, or None."""
    if not text:
        return None
    kind, _, where = text.partition("@")
    ends = where.split("-")
    link = kind == "slow_link"
    if kind not in FAULTS or len(ends) != (2 if link else 1) or not all(e.isdigit() for e in ends) or \
            (link and ends[0] == ends[1]):
        raise UsageError(f"${FAULT_ENV}={text!r}: use KIND@RANK with KIND one of "
                         f"{', '.join(k for k in FAULTS if k != 'slow_link')}, "
                         f"e.g. wrong_allreduce@1, or slow_link@A-B (two ranks), e.g. slow_link@0-3")
    return Fault(kind, int(ends[0]), int(ends[1]) if link else None)


@names_run("health")
def health_task(ctx: RankContext, options: HealthOptions) -> RankHealth:
    import torch
    import torch.distributed as dist

    fault = parse_fault(os.environ.get(FAULT_ENV))
    mine = fault.kind if fault and fault.rank == ctx.rank else None
    device = ctx.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    out = RankHealth(
        rank=ctx.rank, world_size=ctx.world_size, host=socket.gethostname(), device=device,
        device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else (platform.processor() or platform.machine()),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        python_version=platform.python_version(),
    )
    phase = active().set_phase  # the live line: "ddparity: health: bandwidth"
    phase(-1, "hardware")
    readings, xids = _hardware(device)
    started = time.perf_counter()
    dist.barrier()
    out.barrier_s = time.perf_counter() - started
    if mine == "hang":
        time.sleep(24 * 3600)  # the others wait in the next collective

    # Collectives compute what they must: integers are exact in float32.
    phase(-1, "collectives")
    for numel in CORRECTNESS_NUMELS:
        pattern = torch.arange(numel, dtype=torch.float32, device=device) % 7 + 1
        t = pattern * (ctx.rank + 1)
        dist.all_reduce(t)
        if mine == "wrong_allreduce":
            t[numel // 2] += 1.0
        _expect(out, f"all_reduce(sum) of {numel} float32", t, pattern * (ctx.world_size * (ctx.world_size + 1) // 2))
        b = pattern.clone() if ctx.rank == 0 else torch.zeros_like(pattern)
        dist.broadcast(b, src=0)
        _expect(out, f"broadcast from rank 0 of {numel} float32", b, pattern)
    gathered = [torch.zeros(2, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor([float(ctx.rank), 1.0], device=device))
    _expect(out, "all_gather of each rank's id", torch.stack(gathered),
            torch.tensor([[float(r), 1.0] for r in range(ctx.world_size)], device=device))

    # The device computes right (against float64 on the CPU) and how fast.
    phase(-1, "compute")
    generator = torch.Generator().manual_seed(1234)
    a = torch.randn(MATMUL_N, MATMUL_N, generator=generator)
    b64 = torch.randn(MATMUL_N, MATMUL_N, generator=generator)
    reference = a.double() @ b64.double()
    da, db = a.to(device), b64.to(device)
    product = (da @ db).cpu()
    if mine == "wrong_matmul":
        product[0, 0] += 0.05 * product.abs().max()
    if mine == "flip_bits":  # the lowest mantissa bit of one element: no tolerance can see it, only the bits
        product.view(torch.int32)[0, 0] ^= 1
    out.matmul_max_rel_error = float(((product.double() - reference).abs().max() / reference.abs().max()).item())
    out.matmul_bits = digest(product)
    out.matmul_bits_bf16 = digest((da.bfloat16() @ db.bfloat16()).cpu())  # another precision, other kernels
    # The best of up to 20 short blocks: a rank preempted for a moment (other work on the
    # machine) is not a slow device; one that is slow in every block is.
    reps = 20 if device.startswith("cuda") else 5
    times: list[float] = []
    budget = time.perf_counter() + 0.3
    while len(times) < 20 and (len(times) < 3 or time.perf_counter() < budget):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            da @ db
        sync(device)
        elapsed = time.perf_counter() - t0
        if mine == "slow_compute":  # a device at a third of its speed
            time.sleep(2 * elapsed)
            elapsed *= 3
        times.append(elapsed)
    out.gflops = 2 * MATMUL_N**3 * reps / min(times) / 1e9

    phase(-1, "transfers")
    out.transfers = measure_transfers(ctx)

    # Latency (one element) and bandwidth (all-reduce at each size), slowest rank decides.
    phase(-1, "bandwidth")
    one = torch.ones(1, device=device)
    out.latency_s = time_allreduce(one, options.warmup, options.iters, device)
    for nbytes in options.sizes_bytes:
        phase(-1, "bandwidth")  # each size: the record moves
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        out.allreduce.append((t.numel() * 4, time_allreduce(t, options.warmup, options.iters, device)))
    if options.long_s:
        out.stress = stress(ctx, options.long_s, flaky=mine == "flaky_bits")
    if options.pairwise:
        out.pairs = measure_pairs(ctx, max(options.sizes_bytes), options.warmup, options.iters, _slow_link(fault))
    if not isinstance(readings, str):  # the XIDs raised while the checks ran
        raised = xids.collect() if xids is not None else []
        out.hardware = [{**reading, "xid": raised} for reading in readings]
    else:
        out.hardware = readings
    return out


@names_run("health --pairwise (network only)")
def pairwise_task(ctx: RankContext, options: HealthOptions) -> list[PairTiming]:
    """The pairwise pass alone, for a world of fresh ranks that set
    :data:`~ddparity.harness.health.allreduce_timing.NETWORK_ONLY`."""
    if ctx.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(ctx.device)
    fault = parse_fault(os.environ.get(FAULT_ENV))
    return measure_pairs(ctx, max(options.sizes_bytes), options.warmup, options.iters, _slow_link(fault))


def _slow_link(fault: Fault | None) -> frozenset[int]:
    return frozenset((fault.rank, fault.peer)) if fault and fault.peer is not None else frozenset()


def _hardware(device: str) -> tuple[list[dict[str, Any]] | str, Any]:
    """This rank's GPU read through NVML, and a watch of its XID events, or why there is no reading."""
    from ddparity.harness.health import nvml_probe

    if not device.startswith("cuda"):
        return f"no CUDA device (the ranks run on {device})", None
    import torch

    return nvml_probe.watched(str(torch.cuda.get_device_properties(device).uuid))


def _expect(out: RankHealth, what: str, got: Any, want: Any) -> None:
    if not bool((got == want).all()):
        bad = (got != want).nonzero()
        where = tuple(int(i) for i in bad[0].tolist())
        out.collective_errors.append(f"{what}: {int(bad.shape[0])} wrong element(s), first at {list(where)}: "
                                     f"got {got[where].item():g}, expected {want[where].item():g}")
