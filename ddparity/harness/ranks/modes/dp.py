"""Mode ``dp``: ``torch.nn.DataParallel`` over ``world_size`` devices — real when that
many CUDA devices exist, else emulated on one device (:mod:`ddparity.harness.ranks.dp_emulation`),
with DataParallel's pitfalls noted as they are met.

Dropout is aligned per sample in the emulation (its chunks are views of the batch, run in
this thread); real DataParallel runs its replicas in threads of its own, where torch's
dropout draws from each GPU's generator, so a dropout model differs there by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddparity.errors import CaseError
from ddparity.harness.ranks import dp_emulation
from ddparity.harness.ranks.batches import batch_dims, sample_lists
from ddparity.harness.ranks.stepping import record_step
from ddparity.harness.ranks.training import Replica, finish_step
from ddparity.harness.recording import recorder


def runs_real(device: str, world_size: int) -> bool:
    """Whether mode ``dp`` at ``world_size`` is real DataParallel on a process of
    ``device`` ("cuda" or "cpu"): that many CUDA devices exist; else it is emulated."""
    import torch

    return device.startswith("cuda") and torch.cuda.device_count() >= world_size > 1


def simulated(device: str, world_size: int) -> bool:
    """Whether mode ``dp`` at ``world_size`` on a process of ``device`` is emulated
    DataParallel over several devices (labelled simulated in every report)."""
    return world_size > 1 and not runs_real(device, world_size)


@dataclass
class DataParallelMode:
    steps: int
    world_size: int
    device: str
    name: str = "dp"
    rank: int = 0
    recorder: Any = None
    align_dropout: bool = True
    watch_draws: bool = False
    name_draws: bool = False
    notes: dict[str, str] = field(default_factory=dict)
    """DataParallel pitfalls found (name -> explanation)."""
    real: bool = False

    def __post_init__(self) -> None:
        self.recorder = recorder.active()  # phases only: progress for the controller
        self.recorder.pause()

    def sync_off(self, wrapped: Any) -> None:
        return None  # one process: nothing to communicate

    def wrap(self, model: Any) -> Any:
        import torch

        self.real = runs_real(self.device, self.world_size)
        if not self.real:
            return dp_emulation.emulated(model, self.world_size, self.notes)
        wrapped = torch.nn.DataParallel(model, device_ids=list(range(self.world_size)))

        def inspect(module: Any, args: tuple, kwargs: dict) -> None:
            dp_emulation.refuse_unscatterable(args, kwargs, self.world_size)
            found = dp_emulation.DataParallelNotes()
            found.inspect_inputs(args, kwargs, self.world_size)
            found.inspect_module(model)
            self.notes.update(found.items)

        def replica_outputs(replica: Any, args: tuple, kwargs: dict, outputs: Any) -> None:
            found = dp_emulation.DataParallelNotes()  # on each replica, in DataParallel's own threads
            found.inspect_outputs(args, kwargs, outputs)
            self.notes.update(found.items)

        wrapped.register_forward_pre_hook(inspect, with_kwargs=True)
        model.register_forward_hook(replica_outputs, with_kwargs=True)  # replicas keep their module's hooks
        return wrapped

    @property
    def simulated(self) -> bool:
        return simulated(self.device, self.world_size)

    def share(self, batch: Any, size: int | None) -> Any:
        if batch_dims(batch) != {0}:
            raise CaseError(
                "the batch has tensors batched along another dimension than 0 (ddparity.batched(..., dim=...)), "
                "which DataParallel scatters only with DataParallel(module, dim=...) for every tensor alike: not "
                "emulated; check this case in modes single, ddp, fsdp and hsdp (--modes single,ddp)")
        if sample_lists(batch):
            raise CaseError(
                "the batch holds lists of samples (ddparity.samples(...)), which DataParallel does not scatter as "
                "samples: it cuts every tensor of a list along that tensor's own dim 0 (an image's channels), so "
                "this layout cannot train under DataParallel (torchvision's detection references use DDP); check "
                "this case in modes single, ddp, fsdp and hsdp (--modes single,ddp)")
        return batch  # DataParallel scatters the whole batch itself

    def before_optimizer(self, replica: Replica) -> None:
        pass

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        try:
            recorded = record_step(step, replica, batch)
        except RuntimeError as exc:
            if self.world_size > 1 and "grad can be implicitly created only for scalar outputs" in str(exc):
                raise CaseError(
                    f"the training step called backward() on a tensor that is not a scalar: DataParallel gathers each "
                    f"replica's 0-d outputs (a model's own loss, out.loss) into one value per replica, a vector of "
                    f"{self.world_size} (real DataParallel warns that it will unsqueeze them); take their mean "
                    "before backward (out.loss.mean(), as transformers' Trainer does with several GPUs), which "
                    "changes nothing on one device or under DDP") from exc
            raise
        finish_step(replica, step, *recorded)
