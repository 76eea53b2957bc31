"""The rank tasks of ``check`` and ``profile``: what a World runs, each a thin call of the
one training loop (:func:`ddparity.harness.ranks.training.train`) in a mode, with a sink that
writes the reference's tensors to the check's spool or compares a run's with them there
(:mod:`ddparity.harness.ranks.spool`). Only numbers come back.

* :func:`prepare_task` builds the initial state once (from the case's factory and seed)
  into the spool and reports every global batch's size, so the controller can validate
  shards first;
* :func:`reference_task` trains on one device with the whole global batch (mode
  ``single``), writing every step, then as the calibration twin
  (:mod:`ddparity.harness.ranks.modes.twin`), compared step by step;
* :func:`dp_task` trains as DataParallel, :func:`replica_task` under DDP, FSDP2 or HSDP
  (a replicated row of :mod:`ddparity.run_kinds`), compared;
* :func:`profile_task` times DDP or FSDP2 steps (:mod:`ddparity.harness.ranks.modes.timed`).
"""

from __future__ import annotations

from typing import Any

from ddparity.case import Case
from ddparity.compile_spec import CompileSpec
from ddparity.distances import Distances, Reference, update_ratio
from ddparity.errors import CaseError, DdparityError, UsageError
from ddparity.harness.protocol import RankContext, RunName, names_run
from ddparity.harness.ranks.batches import batch_size, layout, valid_counts
from ddparity.harness.ranks.comparer import Comparer
from ddparity.harness.ranks.compiling import Compiled
from ddparity.harness.ranks.modes.ddp import DDPMode
from ddparity.harness.ranks.modes.dp import DataParallelMode
from ddparity.harness.ranks.modes.fsdp import FSDPMode
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.modes.timed import TimedMode
from ddparity.harness.ranks.modes.timed_sharded import TimedShardedMode
from ddparity.harness.ranks.modes.twin import TwinMode, calibrated
from ddparity.harness.ranks.rank import released
from ddparity.harness.ranks.spool import Writer
from ddparity.harness.ranks.training import data_fn, global_batch, initial_state, train
from ddparity.harness.recording.timing import set_collective_timer
from ddparity.harness.spool_files import fits_the_spool, write_state
from ddparity.measurements import RankProfile
from ddparity.run_kinds import REPLICA_MODES, kind

WAIT_LIMIT_S = 3600.0
"""The longest a run waits for the reference to reach a step (the controller stops a
stuck check long before: this bounds the wait should it not)."""


@names_run("set-up (the initial state, every step's batch)")
def prepare_task(ctx: RankContext, case: Case, spool: str) -> tuple[list[int], dict[str, list[int]]]:
    """Writes the initial state (built once, from the factory and the seed) to the spool;
    returns the global batch size of every step, so the controller can validate shards
    before anything trains, and the first batch's valid entries per sample (labels not
    -100, mask ones), for the likely cause of a per-rank normalisation."""
    import torch

    from ddparity.harness.recording import recorder

    state = initial_state(case)
    write_state(spool, state)
    fits_the_spool(case.steps, state, spool)
    data = data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    sizes, valid = [], {}
    rec = recorder.active()
    for step in range(case.steps):
        rec.set_phase(step, "drawing the global batch")  # many steps take a while: progress, not a hang
        batch = global_batch(data, step, generator, pair=case.train_step is None)
        size = batch_size(batch, step)
        sizes.append(size if size is not None else -1)
        if step == 0:
            valid = valid_counts(batch)
    return sizes, valid


@names_run("the reference (one device)")
def reference_task(ctx: RankContext, case: Case, spool: str, world_sizes: tuple[int, ...] = (),
                   optimizer_state: bool = False) -> Reference:
    """The single-device reference, written to the spool step by step, calibrated by its
    twin for the largest world size to be compared (``optimizer_state``: the optimizer's
    state too, which the sharded modes compare)."""
    writer = Writer(spool, optimizer_state)
    trained = train(case, spool, ctx.device, SingleMode(case.steps), writer)
    reference = writer.finish()
    reference.batch_sizes, reference.dropout_calls = trained.batch_sizes, trained.dropout_calls
    reference.autocast_dtype, reference.layer_types = trained.autocast_dtype, trained.layer_types
    reference.optimizer_dtype, reference.changed_outside = trained.optimizer_dtype, trained.changed_outside
    reference.grad_hooks, reference.settings = trained.grad_hooks, trained.settings
    released()  # one replica at a time: the reference's before the twin's
    twin = Comparer(spool, "twin", 0, 1, WAIT_LIMIT_S, own_values=True)
    mode = TwinMode(case.steps, twin_world_size=max(world_sizes, default=1), dtype=case.torch_dtype,
                    optimizer_dtype=trained.optimizer_dtype)
    try:
        train(case, spool, ctx.device, mode, mode.sink(twin))
    except DdparityError:
        raise
    except Exception as exc:  # the user's code ran the batch as given, not as ddparity varied it
        raise CaseError(_twin_raised(case, exc)) from exc
    reference.update_noise = update_ratio([twin.result.moved]) if twin.result.moved else None
    return calibrated(reference, twin)


def _twin_raised(case: Case, exc: Exception) -> str:
    """Why a check stops when the reference trained but its calibration twin raised: what
    the twin changes (the sample order), how the batch is cut, and the fixes."""
    import torch

    first = global_batch(data_fn(case), 0, torch.Generator().manual_seed(case.seed), pair=case.train_step is None)
    return (f"the reference trained, but the same batches in reversed sample order (ddparity's calibration twin, "
            f"which measures the noise floor) raised {type(exc).__name__}: {exc}. A rank's share would be cut the same "
            f"way, so a data-parallel run could not train either: ddparity cuts, as DistributedSampler does, every "
            f"tensor whose dim 0 is the batch size ({layout(first, batch_size(first))}). A tensor whose rows are not "
            f"samples (offsets or indices into another tensor) cannot be cut: pass one item per sample as "
            f"ddparity.samples([...]) and build the offsets in forward, or wrap what every rank needs whole in "
            f"ddparity.whole(...)")


@names_run("the single-device run, compiled")
def compiled_single_task(ctx: RankContext, case: Case, spool: str, spec: CompileSpec) -> Distances:
    """Mode ``single`` with the model the step calls compiled (``spec``): its distance to
    the eager reference is what compiling alone does to the numbers (data-parallel bugs
    vanish on one device), the compiled runs' noise floor."""
    return _compiled_distances(Comparer(spool, "single", 0, 1, WAIT_LIMIT_S),
                               lambda sink, compiled: train(case, spool, ctx.device,
                                                            SingleMode(case.steps, watch_draws=False),
                                                            sink, compiled),
                               spec, "single")


@names_run("the single-device run in float64")
def float64_single_task(ctx: RankContext, case: Case, spool: str) -> Distances:
    """Mode ``single``, eager, with the model and batches in float64: its distance to the
    reference is the reference's own rounding error, what a compiled run's error is measured
    against (torch's accuracy minifier's rule, :func:`ddparity.checks.tolerance.compiled_tolerance`)."""
    import dataclasses

    import torch

    exact = dataclasses.replace(case, dtype=torch.float64)
    sink = Comparer(spool, "single", 0, 1, WAIT_LIMIT_S)
    train(exact, spool, ctx.device, SingleMode(case.steps, watch_draws=False), sink)
    return sink.finish()


def _compiled_distances(sink: Comparer, run: Any, spec: CompileSpec | None, mode: str) -> Distances:
    """``run(sink, compiled)`` trains; the distances, with what compiling did (if ``spec``)."""
    compiled = Compiled(spec, mode) if spec is not None else None
    trained = run(sink, compiled)
    distances = sink.finish()
    distances.settings = trained.settings
    distances.compiled = compiled.summary if compiled is not None else None
    return distances


@names_run("dp")
def dp_task(ctx: RankContext, case: Case, spool: str,
            world_sizes: tuple[int, ...]) -> dict[int, tuple[Distances, dict[str, str], bool]]:
    """Mode ``dp`` at every requested world size, in one round trip: by world size, its
    distances to the reference, the DataParallel pitfalls found and whether the run was
    simulated."""
    out = {}
    for ws in world_sizes:
        released()  # the last world size's replica before this one's
        mode = DataParallelMode(case.steps, ws, ctx.device)
        sink = Comparer(spool, "dp", 0, ws, WAIT_LIMIT_S)
        trained = train(case, spool, ctx.device, mode, sink)
        distances = sink.finish()
        distances.settings = trained.settings
        out[ws] = (distances, mode.notes, mode.simulated)
    return out


@names_run("replicas", sized=True)  # shown as the run's mode (see replica_run_name)
def replica_task(ctx: RankContext, case: Case, spool: str, mode: str, shard_size: int = 0,
                 open_step: Any = None, state: Any = None, settle: Any = None,
                 compiled: CompileSpec | None = None) -> Distances:
    """A replicated mode (a row of :mod:`ddparity.run_kinds` with ``replicated``) on this
    rank: its shard of every global batch under DDP (phases, the bucket ledger and
    fingerprints, :mod:`ddparity.harness.ranks.modes.ddp`) or FSDP2 on the row's mesh
    (``shard_size``: :meth:`~ddparity.run_kinds.RunKind.shard_size`; each local shard
    compared with the same slice of the reference, :mod:`ddparity.harness.ranks.modes.fsdp`);
    its distance to the reference, compared step by step as it trains. ``settle``: called
    once the replica is built, before training; ``open_step``, ``state``: the reference's
    steps and the initial state from elsewhere than ``spool``
    (:mod:`ddparity.harness.launch.refserve`); ``compiled``: the step calls
    ``torch.compile`` of what the mode wrapped."""
    row = kind(mode)
    trains = replica_mode(ctx, case, mode, shard_size, case.steps, settle, traced=compiled is not None)
    sink = Comparer(spool, mode, ctx.rank, ctx.world_size, WAIT_LIMIT_S, open_step=open_step)
    distances = _compiled_distances(sink, lambda s, c: train(case, spool if state is None else state, ctx.device,
                                                              trains, s, c), compiled, mode)
    if row.sharded:
        distances.unsharded, distances.computed_dtype = trains.unsharded, trains.computed_dtype
    else:
        distances.forwards, distances.accumulated = dict(trains.forwards), dict(trains.accumulated)
        distances.bypassed = {step: names for step, names in trains.bypassed.items() if names}
        distances.grad_bytes = trains.grad_bytes
    return distances


def replica_mode(ctx: RankContext, case: Case, mode: str, shard_size: int, steps: int, settle: Any = None,
                 traced: bool = False) -> Any:
    """This rank's mode of a replicated row (``steps`` steps): DDP, or FSDP2 on the row's mesh
    (``traced``: a compiled run's)."""
    row = kind(mode)
    if not row.replicated:
        raise UsageError(f"mode {mode!r} does not run a replica on every rank; use one of {', '.join(REPLICA_MODES)}")
    if row.sharded:
        return FSDPMode(steps, ctx.rank, ctx.world_size, ctx.device, shard_size, case.fsdp, name=mode, settle=settle,
                        traced=traced)
    return DDPMode(steps, ctx.rank, ctx.world_size, ctx.device, case.comm_hook, case.comm_hook_state,
                   case.ddp_options, settle=settle, traced=traced)


def replica_run_name(mode: str, simulated: bool = False) -> RunName:
    """How a run of ``mode`` is shown while it runs (``ddp world_size=4 (gloo)``)."""
    return RunName(f"{mode} (simulated)" if simulated else mode, sized=True, simulated=simulated)


@names_run("profile", sized=True)
def profile_task(ctx: RankContext, case: Case, state: Any, steps: int, warmup: int, name: str = "ddp",
                 shard_size: int = 0) -> RankProfile:
    """Time ``warmup + steps`` iterations of the case under DDP (or ``name`` ``fsdp``,
    ``hsdp`` with ``shard_size``: FSDP2, :mod:`ddparity.harness.ranks.modes.timed_sharded`);
    keep the last ``steps``."""
    if not kind(name).sharded:
        mode = TimedMode(ctx.rank, ctx.world_size, ctx.device, steps, warmup, case.comm_hook, case.comm_hook_state,
                         case.ddp_options)
    else:
        mode = TimedShardedMode(ctx.rank, ctx.world_size, ctx.device, steps, warmup, name=name,
                                shard_size=shard_size, apply=case.fsdp)
    try:
        train(case, state, ctx.device, mode)
    finally:
        set_collective_timer(None)  # the warm rank process runs other tasks next
    return mode.profile
