"""Mode ``single``: one device, the whole global batch. The reference every other run is
compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddparity.harness.recorder import DISABLED
from ddparity.harness.training import Replica, finish_step, run_step, snapshot
from ddparity.trace import StepRecord


@dataclass
class SingleMode:
    steps: int
    name: str = "single"
    rank: int = 0
    world_size: int = 1
    recorder: Any = DISABLED

    def wrap(self, model: Any) -> Any:
        return model

    def share(self, batch: Any, size: int | None) -> Any:
        return batch

    def step(self, step: int, replica: Replica, inputs: Any, targets: Any) -> StepRecord:
        record = snapshot(replica.model, run_step(replica, inputs, targets))
        replica.optimizer.step()
        finish_step(record, replica.model)
        return record
