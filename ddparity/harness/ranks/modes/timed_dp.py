"""``profile --modes dp``: ``torch.nn.DataParallel`` timed where it really runs, over that many
CUDA devices in one process; nowhere else (ddparity's emulation of it on one device gives
no figure a user could compare).

Each step is timed as the training loop runs it (its batch, forward over the replicas, the
gathered loss, backward, the optimizer), every device synchronised at the step's end; the
peak memory of each device over the run is kept, device 0's (the gathered outputs, the loss,
the parameters' master copy) against the others'.
"""

from __future__ import annotations

import time
from typing import Any

from ddparity.case import Case
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.ranks.modes.dp import DataParallelMode
from ddparity.harness.ranks.spool import NoSink
from ddparity.harness.ranks.training import train


def not_timed(device: str, devices: int, world_size: int) -> str | None:
    """Why DataParallel is not timed at ``world_size`` here, or None."""
    if world_size < 2:
        return "not timed: DataParallel over one device is the model alone (nothing is replicated)"
    if not device.startswith("cuda") or devices < world_size:
        return (f"not timed: DataParallel is timed over {world_size} CUDA devices in one process, and this machine "
                f"has {devices}; ddparity's emulation of it on one device gives no figure to compare")
    return None


class _StepEnds(NoSink):
    """The time each step ends, every device synchronised first."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.ends: list[float] = []

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        import torch

        for i in range(self.devices):
            torch.cuda.synchronize(i)
        self.ends.append(time.perf_counter())


@names_run("DataParallel, timed", sized=True)
def dp_profile_task(ctx: RankContext, case: Case, spool: str, steps: int, warmup: int,
                    world_size: int) -> tuple[list[float], list[int]] | str:
    """``warmup + steps`` steps of DataParallel over ``world_size`` CUDA devices: the last
    ``steps`` steps' seconds and each device's peak allocated bytes; or why it is not timed
    here (:func:`not_timed`)."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = not_timed(ctx.device, devices, world_size)
    if why:
        return why
    for i in range(world_size):
        torch.cuda.reset_peak_memory_stats(i)
    ends = _StepEnds(world_size)
    started = time.perf_counter()
    train(case, spool, ctx.device, DataParallelMode(warmup + steps, world_size, ctx.device), ends)
    edges = [started, *ends.ends]
    seconds = [b - a for a, b in zip(edges, edges[1:])][warmup:]
    peaks = [int(torch.cuda.max_memory_allocated(i)) for i in range(world_size)]
    return seconds, peaks


__all__ = ["dp_profile_task", "not_timed"]
