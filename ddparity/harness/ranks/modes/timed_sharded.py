"""Modes ``fsdp`` and ``hsdp`` timed, the rank side of ``ddparity profile --modes fsdp,hsdp``:
FSDP2's steps, each of its collectives timed.

As with DDP (:mod:`.timed`), each measured iteration runs the same shard of the global
batch twice, each start behind a barrier:

* compute alone: every FSDP module unsharded beforehand (its all-gathers outside the
  timing), kept unsharded through forward and backward, gradients not reduced
  (``set_requires_gradient_sync(False)``) and dropped before resharding: no collective
  runs while it is timed;
* as in training: FSDP's all-gathers (forward, and again in backward when it reshards
  after forward) and reduce-scatters (and HSDP's all-reduce across replicas), each timed
  from its call to its completion by a process-wide collective timer
  (:func:`~ddparity.harness.recording.recorder.set_collective_timer`).

Bytes are those nccl-tests counts for each op: the gathered output of an all-gather, the
input of a reduce-scatter (both the whole tensor), the tensor of an all-reduce.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ddparity.harness.ranks.modes.fsdp import fsdp_no_sync, sharded
from ddparity.harness.ranks.modes.timed import TimedMode
from ddparity.harness.recording.recorder import set_collective_timer
from ddparity.measurements import BucketTiming
from ddparity.run_kinds import kind

OPS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
       "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
"""torch's names of FSDP's collectives, and the op each is (nccl-tests' names)."""
TOTAL = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
         "reduce_scatter_single": "input", "reduce_scatter_tensor": "input"}
"""The argument whose bytes are the op's size (the whole tensor, not one rank's part)."""


class CollectiveTimes:
    """Every collective of this process while set, timed from its call to its completion
    (a future's callback for an asynchronous one): ``[op, bytes, group size, start, end]``."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.marks: list[list[Any]] = []

    def call(self, op: str, arguments: dict[str, Any], run: Any) -> Any:
        import torch.distributed as dist

        if op in ("barrier", "monitored_barrier"):  # the timing's own (every start behind one): not the step's
            return run()
        tensor: Any = arguments.get(TOTAL.get(op, ""))
        if tensor is None:
            tensor = next(iter(arguments.values()), None)
        nbytes = int(tensor.numel() * tensor.element_size()) if hasattr(tensor, "numel") else 0
        group = arguments.get("group")
        slot = [OPS.get(op, op), nbytes, dist.get_world_size(group), self.clock.mark(), None]
        self.marks.append(slot)
        work = run()
        if work is not None and hasattr(work, "get_future"):
            def done(f: Any) -> None:
                slot[4] = self.clock.mark()

            work.get_future().then(done)
        else:
            slot[4] = self.clock.mark()
        return work

    def timings(self, origin: Any) -> list[BucketTiming]:
        clock = self.clock
        return [BucketTiming(i, nbytes, clock.seconds(origin, start), clock.seconds(origin, end), (op,), size)
                for i, (op, nbytes, size, start, end) in enumerate(self.marks) if end is not None]


@dataclass
class TimedShardedMode(TimedMode):
    shard_size: int = 0
    """S for ``hsdp`` (each parameter split S ways); ``fsdp`` splits W ways."""
    apply: Any = None
    """``Case.fsdp``: the user's own ``fully_shard`` calls."""

    def wrap(self, model: Any) -> Any:
        model, _ = sharded(model, self.device, self.world_size, self.shard_size if kind(self.name).mesh else None,
                           self.apply)
        self.times = CollectiveTimes(self.clock)
        set_collective_timer(self.times)  # this rank process runs the profile and nothing else meanwhile
        return model

    def sync_off(self, wrapped: Any) -> Any:
        return fsdp_no_sync(wrapped)

    @contextmanager
    def no_comm(self, wrapped: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
        saved = [_settings(m) for m in modules]  # the user's own (reshard_after_forward=False kept so)
        set_collective_timer(None)
        try:
            for m in modules:
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)
                m.set_requires_gradient_sync(False, recurse=False)
                m.unshard()
            yield
        finally:
            wrapped.zero_grad(set_to_none=True)  # the unsharded gradients: none may reach the next step
            for m, settings in zip(modules, saved):
                m.reshard()
                _restore(m, settings)
            set_collective_timer(self.times)

    def clear_comm(self) -> None:
        self.times.marks.clear()

    def comm_timings(self, origin: Any) -> list[BucketTiming]:
        return self.times.timings(origin)

    def _measured(self, step: int, replica: Any, timing: Any) -> None:
        super()._measured(step, replica, timing)
        if step == self.steps - 1:
            set_collective_timer(None)


_GROUP_SETTINGS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads")
"""What FSDP2's ``set_reshard_after_forward``, ``set_reshard_after_backward`` and
``set_requires_gradient_sync`` change on each parameter group (torch has no getters)."""


def _settings(module: Any) -> tuple[Any, list[dict[str, Any]]]:
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [{k: getattr(g, k) for k in _GROUP_SETTINGS}
                                               for g in state._fsdp_param_groups]


def _restore(module: Any, settings: tuple[Any, list[dict[str, Any]]]) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward = settings[0]
    for group, values in zip(state._fsdp_param_groups, settings[1]):
        for k, v in values.items():
            setattr(group, k, v)
