"""Mode ``single``: one device, the whole global batch. The reference every other run is
compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddparity.harness.ranks.stepping import record_step
from ddparity.harness.ranks.training import Replica, finish_step
from ddparity.harness.recording import recorder


@dataclass
class SingleMode:
    steps: int
    name: str = "single"
    rank: int = 0
    world_size: int = 1
    recorder: Any = None
    align_dropout: bool = True
    watch_draws: bool = True
    """Stop at any random draw outside the aligned dropouts (the reference watches)."""
    name_draws: bool = False
    """Name the ops that draw (a slower run, to explain a draw found)."""

    def __post_init__(self) -> None:
        self.recorder = recorder.active()  # phases, so a long reference run is progress, not a hang
        self.recorder.pause()

    def wrap(self, model: Any) -> Any:
        return model

    def sync_off(self, wrapped: Any) -> None:
        return None

    def share(self, batch: Any, size: int | None) -> Any:
        return batch

    def before_optimizer(self, replica: Replica) -> None:
        pass

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        finish_step(replica, step, *record_step(step, replica, batch))
