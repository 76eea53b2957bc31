"""Every collective of a profiled rank process timed from its call to its completion
(:func:`~ddparity.harness.recording.timing.set_collective_timer`), each told as the training
step's own or as what torch issued for it (FSDP2's all-gathers and reduce-scatters; a DDP
bucket's comm hook, timed as the bucket by :mod:`ddparity.harness.ranks.modes.timed`).

Bytes are those nccl-tests counts for each op: the gathered output of an all-gather (the
whole list of ``all_gather``), the input of a reduce-scatter (both the whole tensor), the
tensor of an all-reduce.
"""

from __future__ import annotations

import threading
from typing import Any

from ddparity.harness.recording.calls import issuer
from ddparity.measurements import BucketTiming

OPS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
       "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
"""torch's names of FSDP's collectives, and the op each is (nccl-tests' names)."""
TOTAL = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
         "reduce_scatter_single": "input", "reduce_scatter_tensor": "input"}
"""The argument whose bytes are the op's size (the whole tensor, not one rank's part)."""


TORCH_OWN = ("FSDP2", "DDP")
"""Issuers (:data:`~ddparity.harness.recording.calls.TORCH_ISSUERS`) whose collectives are the
wrapper's, not the step's."""


class CollectiveTimes:
    """The collectives of this process while set (:func:`~ddparity.harness.recording.timing.set_collective_timer`),
    each timed from its call to its completion (a future's callback for an asynchronous one):
    ``[op, bytes, group size, start, end, own]``. ``own_only``: the training step's own only
    (not DDP's or FSDP2's, which torch issues for it, nor a DDP bucket's comm hook's, timed
    as buckets); the timing's barriers never."""

    def __init__(self, clock: Any, own_only: bool = False) -> None:
        self.clock, self.own_only = clock, own_only
        self.marks: list[list[Any]] = []

    def call(self, op: str, arguments: dict[str, Any], run: Any) -> Any:
        import torch.distributed as dist

        if op in ("barrier", "monitored_barrier") or getattr(IN_BUCKET_HOOK, "on", False):
            return run()
        site, via = issuer(2)
        own = via not in TORCH_OWN and not site.startswith("ddparity/harness/")
        if self.own_only and not own:
            return run()
        tensor: Any = arguments.get(TOTAL.get(op, ""))
        if tensor is None:
            tensor = next(iter(arguments.values()), None)
        parts = tensor if isinstance(tensor, (list, tuple)) else [tensor]  # all_gather's list: the gathered whole
        nbytes = sum(int(t.numel() * t.element_size()) for t in parts if hasattr(t, "numel"))
        group = arguments.get("group")
        slot = [OPS.get(op, op), nbytes, dist.get_world_size(group), self.clock.mark(), None, own]
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
        return [BucketTiming(i, nbytes, clock.seconds(origin, start), clock.seconds(origin, end), (op,), size, own)
                for i, (op, nbytes, size, start, end, own) in enumerate(self.marks) if end is not None]


IN_BUCKET_HOOK = threading.local()
"""Set while a DDP bucket's comm hook runs: its collectives are timed as the bucket."""
