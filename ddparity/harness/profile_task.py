"""Rank side of ``ddparity profile``: time a case's DDP steps and its gradient buckets.

Each measured iteration runs the same global batch shard three ways, every one started
together behind a barrier (and a device synchronisation on CUDA):

* ``no_sync``: forward and backward under ``DistributedDataParallel.no_sync()`` — the
  compute alone, no gradient all-reduce;
* ``sync``: forward and backward as in training, DDP's bucket all-reduces overlapping the
  backward pass; each bucket is timed from its launch to its completion (a comm hook
  wrapping the case's hook, or DDP's averaging all-reduce as its default hook does);
* ``optimizer``: the optimizer step on the synchronised gradients.

``sync - no_sync`` is the communication the backward pass did not hide (exposed); the
buckets' busy time is the communication itself. The controller turns these into the
figures (``ddparity.checks.comm``).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from ddparity.case import Case, make_optimizer, resolve_loss
from ddparity.harness.modes import _cast, _data_fn, _forward, _global_batch, _prepared, batch_size, shard
from ddparity.harness.protocol import RankContext
from ddparity.measurements import BucketTiming, RankProfile, StepTiming


class _Clock:
    """Wall time on CPU; CUDA events on a GPU (a comm hook's callback runs when the work
    is enqueued there, not when it finishes)."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self._torch = torch

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()

    def mark(self) -> Any:
        if self.cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end)) / 1000.0
        return float(end - start)


class _BucketTimer:
    """Comm-hook state: the wrapped hook and its state, and this step's bucket marks."""

    def __init__(self, hook: Any, state: Any, clock: _Clock, recorder: Any) -> None:
        self.hook, self.state, self.clock, self.recorder = hook, state, clock, recorder
        self.marks: list[list[Any]] = []  # [index, start mark, end mark, [(op, bytes)] or None, bucket bytes]


def _timed_hook(timer: _BucketTimer, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    slot = [bucket.index(), timer.clock.mark(), None, None, buffer.numel() * buffer.element_size()]
    timer.marks.append(slot)
    with timer.recorder.tally() as sent:  # what the hook really sends (a compression hook: less)
        if timer.hook is None:
            fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group
        else:
            fut = timer.hook(timer.state, bucket)
    slot[3] = sent

    def done(f):  # noqa: ANN001, ANN202
        slot[2] = timer.clock.mark()
        return f.value()

    return fut.then(done)


def _bucket(mark: list[Any], origin: Any, clock: _Clock) -> BucketTiming:
    index, start, end, sent, buffer_bytes = mark
    if sent is None:  # outside a rank nothing is counted: the bucket as DDP's default hook sends it
        sent = [("all_reduce", buffer_bytes)]
    return BucketTiming(index, sum(n for _, n in sent), clock.seconds(origin, start), clock.seconds(origin, end),
                        tuple(op for op, _ in sent))


def profile_task(ctx: RankContext, case: Case, state: dict[str, Any], steps: int, warmup: int) -> RankProfile:
    """Time ``warmup + steps`` iterations of the case under DDP; keep the last ``steps``.

    Batches cycle through the case's ``case.steps`` global batches (a data function may
    only know those).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.harness import recorder

    rec = recorder.active()
    rec.pause()  # no ledger store writes inside the timed steps; phases keep hang detection informed
    rec.set_phase(-1, "build")
    model = _prepared(case, state, ctx.device)
    device_ids = [torch.device(ctx.device).index] if ctx.device.startswith("cuda") else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, **case.ddp_options)
    clock = _Clock(ctx.device)
    timer = _BucketTimer(case.comm_hook, copy.deepcopy(case.comm_hook_state), clock, rec)
    ddp.register_comm_hook(timer, _timed_hook)
    optimizer = make_optimizer(case, ddp.parameters())
    loss_fn = resolve_loss(case.loss)
    data = _data_fn(case)
    batches = []
    generator = torch.Generator().manual_seed(case.seed)
    for step in range(case.steps):
        inputs, targets = _global_batch(case, data, step, generator)
        batches.append((_cast(shard(inputs, ctx.rank, ctx.world_size), case, ctx.device),
                        _cast(shard(targets, ctx.rank, ctx.world_size), case, ctx.device)))

    def forward_backward(inputs: Any, targets: Any, step: int = -1) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_forward(ddp, inputs), targets)
        if step >= 0:
            rec.set_phase(step, "profile backward")  # a rank waiting here is ahead of one still in forward
        loss.backward()

    def timed(fn: Any, *args: Any) -> tuple[float, Any]:
        """Seconds ``fn`` took, started on every rank at once, and its start mark."""
        dist.barrier()
        clock.sync()
        first = clock.mark()
        fn(*args)
        last = clock.mark()
        clock.sync()
        return clock.seconds(first, last), first

    profile = RankProfile(ctx.rank, ctx.world_size, ctx.device, samples=batch_size(batches[0][0]) or 0)
    for i in range(warmup + steps):
        rec.set_phase(i, "profile no_sync")
        inputs, targets = batches[i % len(batches)]
        with ddp.no_sync():
            no_sync, _ = timed(forward_backward, inputs, targets)
        rec.set_phase(i, "profile forward")
        timer.marks.clear()
        sync, origin = timed(forward_backward, inputs, targets, i)
        rec.set_phase(i, "profile optimizer")
        opt, _ = timed(optimizer.step)
        if i < warmup:
            continue
        buckets = [_bucket(mark, origin, clock) for mark in timer.marks if mark[2] is not None]
        profile.steps.append(StepTiming(sync, no_sync, opt, buckets))
    rec.set_phase(warmup + steps, "done")
    return profile
