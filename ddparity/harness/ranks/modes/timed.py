"""Mode ``timed``, the rank side of ``ddparity profile``: a case's DDP steps and its
gradient buckets, timed.

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
figures (``ddparity.checks.comm``). Batches cycle through the case's ``case.steps``
global batches (a data function may only know those).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ddparity.harness.optimizer_steps import nested_step
from ddparity.harness.ranks.batches import shard
from ddparity.harness.ranks.collective_times import IN_BUCKET_HOOK, CollectiveTimes
from ddparity.harness.ranks.modes.ddp import distributed
from ddparity.harness.ranks.training import Replica, compute_loss, forward
from ddparity.harness.recording import recorder
from ddparity.harness.recording.timing import set_collective_timer
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
    IN_BUCKET_HOOK.on = True
    try:
        with timer.recorder.tally() as sent:  # what the hook really sends (a compression hook: less)
            if timer.hook is None:
                fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group
            else:
                fut = timer.hook(timer.state, bucket)
    finally:
        IN_BUCKET_HOOK.on = False
    slot[3] = sent

    def done(f):  # noqa: ANN001, ANN202
        slot[2] = timer.clock.mark()
        return f.value()

    return fut.then(done)


def state_bytes(replica: Replica) -> dict[str, int]:
    """What this rank holds of the model's state, in bytes: parameters, gradients and
    optimizer state (a sharded tensor's local shard only)."""
    from ddparity.harness.shards import is_sharded

    def nbytes(t: Any) -> int:
        import torch

        if not isinstance(t, torch.Tensor):
            return 0
        local: Any = t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]  # a DTensor
        return int(local.numel() * local.element_size())

    params = list(replica.model.parameters())
    optimizer = sum(nbytes(v) for state in replica.optimizer.state.values() for v in state.values())
    return {"params": sum(nbytes(p) for p in params), "grads": sum(nbytes(p.grad) for p in params),
            "optimizer": optimizer}


class SavedBytes:
    """Bytes of the tensors autograd saves for backward while it is entered, each storage
    once and the model's own parameters and buffers not (``torch.autograd.graph.saved_tensors_hooks``:
    the pack hook returns the tensor itself, so nothing computed changes): a step's
    activation memory (under FSDP the unsharded parameters kept for backward too), measured
    on any device (on CPU torch keeps no allocator statistics)."""

    def __init__(self, model: Any = None) -> None:
        self._seen: dict[Any, int] = {}
        self._own = set()
        for t in [*model.parameters(), *model.buffers()] if model is not None else []:
            try:
                self._own.add((t.device, t.untyped_storage().data_ptr()))
            except (RuntimeError, NotImplementedError):
                pass

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: Any) -> Any:
        try:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in self._own:
                self._seen[key] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a DTensor, a subclass)
            pass
        return t

    def __enter__(self) -> SavedBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


DDP_LOGGED = ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
              "avg_backward_compute_comm_overlap_time", "bucket_sizes", "rebuilt_bucket_sizes", "has_rebuilt_buckets",
              "bucket_cap_bytes", "gradient_as_bucket_view")
"""What a profile keeps of DDP's own logging data (times in ns, sizes as DDP's text)."""


def ddp_logging(wrapped: Any) -> dict[str, Any]:
    """DDP's own logging data of this rank's DDP module (:data:`DDP_LOGGED`), or {} where
    there is none (FSDP; a torch without it)."""
    get = getattr(wrapped, "_get_ddp_logging_data", None)
    if get is None:
        return {}
    try:
        data = get()
    except Exception:  # noqa: BLE001 - the logger is torch's private API: its absence is no failure of the profile
        return {}
    return {k: data[k] for k in DDP_LOGGED if k in data}


def _bucket(mark: list[Any], origin: Any, clock: _Clock) -> BucketTiming:
    index, start, end, sent, buffer_bytes = mark
    if sent is None:  # outside a rank nothing is counted: the bucket as DDP's default hook sends it
        sent = [("all_reduce", buffer_bytes)]
    return BucketTiming(index, sum(n for _, n in sent), clock.seconds(origin, start), clock.seconds(origin, end),
                        tuple(op for op, _ in sent))


@dataclass
class TimedMode:
    rank: int
    world_size: int
    device: str
    measured: int
    """Iterations measured, after ``warmup`` that are not."""
    warmup: int
    comm_hook: Any = None
    comm_hook_state: Any = None
    ddp_options: Any = None
    name: str = "ddp"
    align_dropout: bool = False
    """Torch's own dropout: a profile times the training as it is, and compares nothing."""
    watch_draws: bool = False
    name_draws: bool = False
    profile: RankProfile = field(init=False)

    def __post_init__(self) -> None:
        self.recorder = recorder.active()
        self.recorder.pause()  # no ledger store writes inside the timed steps; phases keep hang detection informed
        self.steps = self.warmup + self.measured
        self.clock = _Clock(self.device)
        self._torch = self.clock._torch
        self.profile = RankProfile(self.rank, self.world_size, self.device, samples=0)
        self.compute_times = CollectiveTimes(self.clock, own_only=True)
        self._count_activations, self._model = False, None

    def wrap(self, model: Any) -> Any:
        ddp = distributed(model, self.device, self.ddp_options)
        self.timer = _BucketTimer(self.comm_hook, copy.deepcopy(self.comm_hook_state), self.clock, self.recorder)
        ddp.register_comm_hook(self.timer, _timed_hook)
        self.times = CollectiveTimes(self.clock, own_only=True)  # the step's own, beside the buckets
        set_collective_timer(self.times)  # this rank process runs the profile and nothing else meanwhile
        return ddp

    def sync_off(self, wrapped: Any) -> Any:
        return wrapped.no_sync

    @contextmanager
    def compute_only(self, wrapped: Any) -> Any:
        """:meth:`no_comm`, the step's own collectives timed apart (communication, not compute)."""
        self.compute_times.marks.clear()
        with self.no_comm(wrapped):
            set_collective_timer(self.compute_times)
            try:
                yield
            finally:
                set_collective_timer(self.times)

    # what a sharded mode times otherwise (:mod:`.timed_sharded`)

    def no_comm(self, wrapped: Any) -> Any:
        """The context in which forward and backward communicate nothing of DDP's."""
        return wrapped.no_sync()

    def clear_comm(self) -> None:
        self.timer.marks.clear()
        self.times.marks.clear()

    def comm_timings(self, origin: Any) -> list[BucketTiming]:
        """This iteration's communication, from ``origin`` (the start of its forward)."""
        return [_bucket(mark, origin, self.clock) for mark in self.timer.marks if mark[2] is not None] + \
            self.times.timings(origin)

    def _measured(self, step: int, replica: Replica, timing: StepTiming) -> None:
        if step < self.warmup:
            return
        if step == self.warmup and self.clock.cuda:
            self._torch.cuda.reset_peak_memory_stats()
        self.profile.steps.append(timing)
        if step == self.steps - 1:
            counted = {k: v for k, v in self.profile.memory.items() if k == "activations"}  # (warm-up's count)
            self.profile.memory = {**state_bytes(replica), **counted}
            self.profile.ddp_logging = ddp_logging(replica.wrapped)
            if self.clock.cuda:
                self.profile.memory["peak_allocated"] = int(self._torch.cuda.max_memory_allocated())

    def share(self, batch: Any, size: int | None) -> Any:
        self.profile.samples = (size or 0) // self.world_size  # each rank's equal share
        return shard(batch, self.rank, self.world_size, size)

    def before_optimizer(self, replica: Replica) -> None:
        self._optimizer_marks.append(self.clock.mark())

    def _optimizer_stepped(self, optimizer: Any, *_: Any) -> None:
        if not nested_step():  # a subclass's super().step() ends inside the same step
            self._optimizer_marks.append(self.clock.mark())

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        self._count_activations, self._model = False, replica.model
        if step == 0:
            self._optimizer_marks: list[Any] = []
            replica.optimizer.register_step_post_hook(self._optimizer_stepped)
        if replica.case.train_step is not None:
            self._user_step(step, replica, batch)
        else:
            self._own_step(step, replica, *batch)

    def _timed(self, fn: Any, *args: Any) -> tuple[float, Any, Any]:
        """Seconds ``fn`` took, started on every rank at once; its start and end marks. In the
        first warm-up step's synced pass (never a measured one), the activations it saved
        for backward are counted (:class:`SavedBytes`)."""
        import torch.distributed as dist

        dist.barrier()
        self.clock.sync()
        first = self.clock.mark()
        if self._count_activations:
            with SavedBytes(self._model) as saved:
                fn(*args)
            self.profile.memory["activations"] = saved.nbytes
        else:
            fn(*args)
        last = self.clock.mark()
        self.clock.sync()
        return self.clock.seconds(first, last), first, last

    def _user_step(self, step: int, replica: Replica, batch: Any) -> None:
        """The case's own ``train_step``, run twice: under ``no_sync()`` (compute: up to its
        ``optimizer.step()``), then as it is (up to ``optimizer.step()``: forward, backward
        and the communication it did not hide; then the optimizer step), the optimizer's
        hooks marking where it starts and ends."""
        ddp, clock, ctx = replica.wrapped, self.clock, replica.ctx
        ctx.step = step

        def run() -> None:
            replica.watch.begin()
            replica.step_fn(ddp, batch, replica.optimizer, ctx)

        def until_optimizer(total: float, origin: Any) -> float:
            return clock.seconds(origin, self._optimizer_marks[0]) if self._optimizer_marks else total

        self.recorder.set_phase(step, "profile no_sync")
        self._optimizer_marks.clear()
        with self.compute_only(ddp):
            total, origin, _ = self._timed(run)
        no_sync, own = until_optimizer(total, origin), self.compute_times.timings(origin)
        self.recorder.set_phase(step, "profile forward")
        self.clear_comm()
        self._optimizer_marks.clear()
        self._count_activations = step == 0 and self.warmup > 0
        total, origin, _ = self._timed(run)
        self._count_activations = False
        marks = self._optimizer_marks
        sync = until_optimizer(total, origin)
        opt = clock.seconds(marks[0], marks[1]) if len(marks) >= 2 else 0.0
        self._measured(step, replica, StepTiming(sync, no_sync, opt, self.comm_timings(origin), own))

    def _own_step(self, step: int, replica: Replica, inputs: Any, targets: Any) -> None:
        rec, ddp = self.recorder, replica.wrapped

        def forward_backward(phase_step: int = -1) -> None:
            replica.optimizer.zero_grad(set_to_none=True)
            loss = compute_loss(replica, forward(ddp, inputs), targets)
            if phase_step >= 0:
                rec.set_phase(phase_step, "profile backward")  # a rank waiting here is ahead of one in forward
            loss.backward()

        rec.set_phase(step, "profile no_sync")
        with self.compute_only(ddp):
            no_sync, compute_origin, _ = self._timed(forward_backward)
        own = self.compute_times.timings(compute_origin)
        rec.set_phase(step, "profile forward")
        self.clear_comm()
        self._count_activations = step == 0 and self.warmup > 0
        sync, origin, _ = self._timed(forward_backward, step)
        self._count_activations = False
        rec.set_phase(step, "profile optimizer")
        replica.watch.begin()
        opt, _, _ = self._timed(replica.optimizer.step)
        self._optimizer_marks.clear()
        self._measured(step, replica, StepTiming(sync, no_sync, opt, self.comm_timings(origin), own))
