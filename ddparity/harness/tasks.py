"""The rank tasks of ``check`` and ``profile``: what a World runs, each a thin call of the
one training loop (:func:`ddparity.harness.training.train`) in a mode.

* :func:`prepare_task` builds the initial state once (from the case's factory and seed)
  and reports every global batch's size, so the controller can validate shards first;
* :func:`reference_task` trains on one device with the whole global batch (mode
  ``single``), then as the calibration twin (:mod:`ddparity.harness.modes.twin`);
* :func:`dp_task` and :func:`ddp_task` train as DataParallel and under DDP;
* :func:`profile_task` times DDP steps (:mod:`ddparity.harness.modes.timed`).
"""

from __future__ import annotations

from typing import Any

from ddparity.case import Case
from ddparity.harness.modes.ddp import DDPMode
from ddparity.harness.modes.dp import DataParallelMode
from ddparity.harness.modes.single import SingleMode
from ddparity.harness.modes.timed import TimedMode
from ddparity.harness.modes.twin import TwinMode
from ddparity.harness.protocol import RankContext
from ddparity.harness.training import batch_size, data_fn, global_batch, initial_state, train, valid_counts
from ddparity.measurements import RankProfile
from ddparity.trace import Trace


def prepare_task(ctx: RankContext, case: Case) -> tuple[dict[str, Any], list[int], dict[str, list[int]]]:
    """The initial state (built once, from the factory and the seed), the global batch
    size of every step, so the controller can validate shards before anything trains, and
    the first batch's valid entries per sample (labels not -100, mask ones), for the likely
    cause of a per-rank normalisation."""
    import torch

    state = initial_state(case)
    data = data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    sizes, valid = [], {}
    for step in range(case.steps):
        batch = global_batch(data, step, generator, pair=case.train_step is None)
        size = batch_size(batch, step)
        sizes.append(size if size is not None else -1)
        if step == 0:
            valid = valid_counts(batch)
    return state, sizes, valid


def reference_task(
    ctx: RankContext, case: Case, state: dict[str, Any], world_sizes: tuple[int, ...] = ()
) -> tuple[Trace, Trace]:
    """The single-device reference and its calibration twin for the largest world size
    to be compared."""
    reference = train(case, state, ctx.device, SingleMode(case.steps))
    twin = train(case, state, ctx.device, TwinMode(case.steps, twin_world_size=max(world_sizes, default=1)))
    return reference, twin


def dp_task(ctx: RankContext, case: Case, state: dict[str, Any],
            world_sizes: tuple[int, ...]) -> dict[int, tuple[Trace, dict[str, str], bool]]:
    """Mode ``dp`` at every requested world size, in one round trip: by world size, the
    trace, the DataParallel pitfalls found and whether the run was simulated."""
    out = {}
    for ws in world_sizes:
        mode = DataParallelMode(case.steps, ws, ctx.device)
        trace = train(case, state, ctx.device, mode)
        out[ws] = (trace, mode.notes, mode.simulated)
    return out


def ddp_task(ctx: RankContext, case: Case, state: dict[str, Any], detect: bool = True,
             settle: Any = None) -> Trace:
    """Mode ``ddp``: this rank's shard of every global batch under DDP (``detect``: with
    phases, the bucket ledger and fingerprints, see :mod:`ddparity.harness.modes.ddp`;
    ``settle``: called once the replica is built, before training)."""
    mode = DDPMode(case.steps, ctx.rank, ctx.world_size, ctx.device, case.comm_hook, case.comm_hook_state,
                   case.ddp_options, detect=detect, settle=settle)
    return train(case, state, ctx.device, mode)


def profile_task(ctx: RankContext, case: Case, state: dict[str, Any], steps: int, warmup: int) -> RankProfile:
    """Time ``warmup + steps`` iterations of the case under DDP; keep the last ``steps``."""
    mode = TimedMode(ctx.rank, ctx.world_size, ctx.device, steps, warmup, case.comm_hook, case.comm_hook_state,
                     case.ddp_options)
    train(case, state, ctx.device, mode)
    return mode.profile
