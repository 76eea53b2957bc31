"""Probes of the reference, run only when a failing check's numbers fit more than one cause
(a passing check runs none): the same user code on a batch chosen to tell the causes apart.

* :func:`loss_scaling_task`: a loss summed over the samples and a mean loss divided by the
  world size leave the same numbers in a DDP run (its loss and every gradient 1/W of the
  reference's). On one device, the step's loss on its global batch given twice (every
  sample repeated, each drawing the same dropout mask as itself) is twice the loss on the
  batch for a sum, and the same loss for a mean, whatever the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ddparity.case import Case
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.ranks.batches import map_tensors
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.rank import released
from ddparity.harness.ranks.spool import NoSink
from ddparity.harness.ranks.training import train


@dataclass
class RepeatedMode(SingleMode):
    """Mode ``single`` on its global batch given twice: the batch, then the same samples again."""

    def share(self, batch: Any, size: int | None) -> Any:
        import torch

        if not size:
            return batch
        return map_tensors(batch, lambda t: torch.cat([t, t]) if t.dim() and t.shape[0] == size else t)


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
