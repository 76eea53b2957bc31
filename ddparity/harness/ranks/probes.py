"""Probes of the reference, run only when a failing check's numbers fit more than one cause
(a passing check runs none): the same user code on a batch chosen to tell the causes apart.

* :func:`loss_scaling_task`: a loss summed over the samples and a mean loss divided by the
  world size leave the same numbers in a DDP run (its loss and every gradient 1/W of the
  reference's). On one device, the step's loss on its global batch given twice (every
  sample repeated, each drawing the same dropout mask as itself) is twice the loss on the
  batch for a sum, and the same loss for a mean, whatever the data.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from ddparity.case import Case, Samples
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.ranks.batches import map_tensors, reverse_samples
from ddparity.harness.ranks.comparer import wait_for
from ddparity.harness.ranks.differing import (
    backward_order,
    first_difference,
    first_op,
    forward_places,
    noise_of,
    replica_rows,
    same_samples,
)
from ddparity.harness.ranks.modes.dp import DataParallelMode
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.rank import released
from ddparity.harness.ranks.spool import NoSink
from ddparity.harness.ranks.tasks import WAIT_LIMIT_S, replica_mode
from ddparity.harness.ranks.tracing import ModuleTrace, Traced
from ddparity.harness.ranks.training import train
from ddparity.harness.spool_files import ReferenceFailed
from ddparity.verdicts import ModuleFinding


@dataclass
class RepeatedMode(SingleMode):
    """Mode ``single`` on its global batch given twice: the batch, then the same samples again."""

    def share(self, batch: Any, size: int | None) -> Any:
        import torch

        if not size:
            return batch
        return map_tensors(batch, lambda t: torch.cat([t, t]) if t.dim() and t.shape[0] == size else t,
                           samples=lambda s: Samples(s.items + s.items))


@dataclass
class ReversedMode(SingleMode):
    """Mode ``single`` on its global batch in reversed sample order."""

    def share(self, batch: Any, size: int | None) -> Any:
        return reverse_samples(batch, size) if size else batch


class StepLoss(NoSink):
    """Keeps the loss of step 0, as the step returned it (nothing else)."""

    def __init__(self) -> None:
        self.loss: float | None = None

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        if step == 0:
            self.loss = float(loss.detach().double().cpu())


@names_run("a probe of the loss: the first batch given twice")
def loss_scaling_task(ctx: RankContext, case: Case, spool: str) -> float | None:
    """The step's loss on the first global batch given twice, over its loss on that batch, on
    one device from the initial state: 2 for a loss summed over the samples, 1 for a mean
    (None where either loss is zero or not finite: the probe then says nothing)."""
    once, twice = StepLoss(), StepLoss()
    train(case, spool, ctx.device, SingleMode(1, watch_draws=False), once)
    released()
    train(case, spool, ctx.device, RepeatedMode(1, watch_draws=False), twice)
    released()
    if once.loss is None or twice.loss is None or not once.loss or not math.isfinite(twice.loss / once.loss):
        return None
    return twice.loss / once.loss


def trace_name(step: int, inside: tuple[str, int] | None = None) -> str:
    """The spool's file of the reference's record of step ``step`` (of module call ``inside``)."""
    return f"trace-{step}.pt" if inside is None else f"trace-{step}-{inside[1]}-{inside[0]}.pt"


def _trace_path(spool: str, step: int, inside: tuple[str, int] | None = None) -> str:
    return os.path.join(spool, trace_name(step, inside))


FAILED = ".failed"
"""Beside a trace's path: the reference's re-run of that step failed (the ranks stop waiting)."""


def _reference_record(spool: str, step: int, inside: tuple[str, int] | None, limit_s: float) -> Any:
    """The reference's record of step ``step`` (of call ``inside``), once it is written: the
    reference re-runs beside the ranks (raises :class:`ReferenceFailed` when its re-run failed
    or wrote nothing in ``limit_s``)."""
    import torch

    path = _trace_path(spool, step, inside)
    wait_for(spool, path, limit_s, failed=(path + FAILED, f"the reference's re-run of step {step} failed"),
             what=f"record of step {step}")
    return torch.load(path, weights_only=False)


def _traced(case: Case, spool: str, device: str, mode: Any, step: int,
            inside: tuple[str, int] | None = None, size: int = 0) -> dict[str, Any]:
    """Train ``mode`` (``step + 1`` steps) with step ``step`` recorded module by module (and
    the aten ops of module call ``inside``; ``size``: the step's global batch size)."""
    trace = ModuleTrace(step, inside, size)
    try:
        train(case, spool, device, Traced(mode, trace), trace)
    finally:
        trace.close()
    return trace.record()


@names_run("the first differing step on one device, module by module")
def reference_trace_task(ctx: RankContext, case: Case, spool: str, step: int, size: int,
                         inside: tuple[str, int] | None = None) -> None:
    """The reference's record of step ``step`` (``size``: its global batch size) and its
    rounding noise, into the spool (once per step); ``inside``: (module, call), that call's
    aten ops instead (no noise: the module's tolerance is theirs). Its failure is kept beside
    the record's path (the ranks re-running beside it stop waiting; a later ask fails alike)."""
    path = _trace_path(spool, step, inside)
    if os.path.exists(path):
        return
    if os.path.exists(path + FAILED):
        raise ReferenceFailed(f"the reference's re-run of step {step} failed in an earlier ask")
    try:
        _record_reference(ctx, case, spool, step, size, inside, path)
    except BaseException:
        with open(path + FAILED, "w"):
            pass
        raise


def _record_reference(ctx: RankContext, case: Case, spool: str, step: int, size: int,
                      inside: tuple[str, int] | None, path: str) -> None:
    import torch

    ref = _traced(case, spool, ctx.device, SingleMode(step + 1, watch_draws=False), step, inside, size)
    released()
    if inside is not None:
        torch.save({"record": ref}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return
    twin = _traced(case, spool, ctx.device, ReversedMode(step + 1, watch_draws=False), step, size=size)
    released()
    rows = torch.arange(size).flip(0) if size > 0 else None
    torch.save({"record": ref, "noise": noise_of(ref, twin, rows, size)}, path + ".tmp")
    os.replace(path + ".tmp", path)


@names_run("the first differing step, module by module", sized=True)
def replica_trace_task(ctx: RankContext, case: Case, spool: str, mode: str, shard_size: int, step: int,
                       size: int, inside: tuple[str, int, float] | None = None,
                       settle: Any = None) -> Any:
    """This rank's record of step ``step`` in ``mode``, compared with the reference's
    (:func:`reference_trace_task` wrote it): the first module whose activations differ on
    this rank, and the modules in the order backward reached them; ``inside`` (module, call,
    tolerance): the first aten op of that call whose output differs, as
    :func:`~ddparity.harness.ranks.differing.first_op` says (``settle``: as
    :func:`~ddparity.harness.ranks.tasks.replica_task`'s)."""
    import torch

    trains = replica_mode(ctx, case, mode, shard_size, step + 1, settle)
    call = (inside[0], inside[1]) if inside is not None else None
    mine = _traced(case, spool, ctx.device, trains, step, call, size)
    rows = trains.share(torch.arange(size), size) if size > 0 else None
    ref = _reference_record(spool, step, call, WAIT_LIMIT_S)
    released()
    if inside is not None:
        return first_op(ref["record"]["ops"], mine["ops"], rows, size, inside[2])
    found = first_difference(ref["record"], ref["noise"], mine, same_samples(ref["record"], mine, rows, size),
                             1.0 / ctx.world_size, ctx.rank, step)
    counts = (len(mine["forwards"]), len(ref["record"]["forwards"]))
    if 0 not in counts and counts[0] != counts[1]:
        found = dataclasses.replace(found, forwards=counts)
    return found, backward_order(mine)


@names_run("DataParallel's first differing step, module by module")
def dp_trace_task(ctx: RankContext, case: Case, spool: str, world_size: int, step: int,
                  size: int) -> tuple[ModuleFinding, list[tuple[str, str, list[str]]]]:
    """DataParallel at ``world_size`` (emulated in this process, or real on enough GPUs) on
    step ``step``, module by module against the reference's record: each replica's calls on
    the samples of its chunk (told by the storage the emulation's chunks view, micro-batches
    of the step too, or found by content: :func:`~ddparity.harness.ranks.differing.same_samples`;
    else by replica,
    :func:`~ddparity.harness.ranks.differing.replica_rows`); the
    gathered output's loss is the reference's, so gradients are compared as they are."""
    import torch

    trains = DataParallelMode(step + 1, world_size, ctx.device)
    mine = _traced(case, spool, ctx.device, trains, step, size=size)
    ref = _reference_record(spool, step, None, WAIT_LIMIT_S)
    released()
    chunks = list(torch.arange(size).chunk(world_size)) if size > 0 else []
    places = forward_places(ref["record"], mine)  # each replica's chunk a view, or found by content
    told = bool(places) and all(p is not None for p in places)
    match = (same_samples(ref["record"], mine, torch.arange(size), size) if told and size > 0
             else replica_rows(ref["record"], chunks, size))
    found = first_difference(ref["record"], ref["noise"], mine, match, 1.0, 0, step)
    return found, backward_order(mine)
