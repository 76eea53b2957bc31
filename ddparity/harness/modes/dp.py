"""Mode ``dp``: ``torch.nn.DataParallel`` over ``world_size`` devices — real when that
many CUDA devices exist, else emulated on one device (:mod:`ddparity.harness.dp_emulation`),
with DataParallel's pitfalls noted as they are met."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddparity.harness import dp_emulation
from ddparity.harness.recorder import DISABLED
from ddparity.harness.training import Replica, compute_loss, finish_step, snapshot
from ddparity.trace import StepRecord


@dataclass
class DataParallelMode:
    steps: int
    world_size: int
    device: str
    name: str = "dp"
    rank: int = 0
    recorder: Any = DISABLED
    notes: dict[str, str] = field(default_factory=dict)
    """DataParallel pitfalls found (name -> explanation)."""
    real: bool = False

    def wrap(self, model: Any) -> Any:
        import torch

        self.real = self.device.startswith("cuda") and torch.cuda.device_count() >= self.world_size > 1
        if self.real:
            return torch.nn.DataParallel(model, device_ids=list(range(self.world_size)))
        return model

    @property
    def simulated(self) -> bool:
        return not self.real and self.world_size > 1

    def share(self, batch: Any, size: int | None) -> Any:
        return batch  # DataParallel scatters the whole batch itself

    def step(self, step: int, replica: Replica, inputs: Any, targets: Any) -> StepRecord:
        model = replica.model
        replica.optimizer.zero_grad(set_to_none=True)
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
            (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {}))
        if self.real:
            outputs = replica.wrapped(*args, **kwargs)
            found = dp_emulation.DataParallelNotes()
            found.inspect_inputs(args, kwargs)
            found.inspect_module(model)
        else:
            outputs, found = dp_emulation.forward(model, self.world_size, args, kwargs)
        self.notes.update(found.items)
        loss = compute_loss(replica, outputs, targets)
        loss.backward()
        record = snapshot(model, loss)
        replica.optimizer.step()
        finish_step(record, model)
        return record
