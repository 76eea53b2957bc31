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
  (:func:`~ddparity.harness.recording.timing.set_collective_timer`).

Bytes are those nccl-tests counts for each op (:mod:`ddparity.harness.ranks.collective_times`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ddparity.harness.ranks.collective_times import CollectiveTimes
from ddparity.harness.ranks.modes.fsdp import fsdp_no_sync, sharded
from ddparity.harness.ranks.modes.timed import TimedMode
from ddparity.harness.recording.timing import set_collective_timer
from ddparity.run_kinds import kind


@dataclass
class TimedShardedMode(TimedMode):
    shard_size: int = 0
    """S for ``hsdp`` (each parameter split S ways); ``fsdp`` splits W ways."""
    apply: Any = None
    """``Case.fsdp``: the user's own ``fully_shard`` calls."""

    def wrap(self, model: Any) -> Any:
        model, _ = sharded(model, self.device, self.world_size, self.shard_size if kind(self.name).mesh else None,
                           self.apply)
        self.times = CollectiveTimes(self.clock)  # FSDP2's collectives, and the step's own
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

    def comm_timings(self, origin: Any) -> list[Any]:
        return self.times.timings(origin)


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
