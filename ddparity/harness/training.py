"""The one training loop, inside a rank process, and the :class:`Mode` protocol that every
way of training a replica implements.

:func:`train` builds the replica from the shared initial state, draws every global batch
from the case's data function, hands the mode this replica's share, lets the mode run
the step, and keeps what the mode recorded. A mode (one per file in
:mod:`ddparity.harness.modes`) says

* how the replica is wrapped (``wrap``: the model itself, ``DataParallel``, ``DDP``);
* which share of each global batch it trains on (``share``: all, reversed, a shard);
* how a step runs and what is recorded (``step``: forward, backward and the optimizer
  step, returning the :class:`~ddparity.trace.StepRecord` or nothing).

The modes: ``single`` (the reference), its calibration ``twin``, ``dp`` (DataParallel,
emulated or real), ``ddp`` (also each simulated rank of the threaded backend) and
``timed`` (the profile's timed passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ddparity.case import Case, load_target, make_optimizer, resolve_loss
from ddparity.errors import CaseError
from ddparity.trace import StepRecord, Trace


@dataclass(slots=True)
class Replica:
    """One replica in training: what a mode's step works with."""

    case: Case
    model: Any
    """The module whose gradients, parameters and buffers are recorded."""
    wrapped: Any
    """What forward calls: the model, or the model wrapped (DDP, DataParallel)."""
    optimizer: Any
    loss_fn: Callable[[Any, Any], Any]
    device: str


class Mode(Protocol):
    """One way of training a replica (see the module docstring)."""

    name: str
    rank: int
    world_size: int
    steps: int
    """Iterations to run; past the case's own steps its batches are used again, in order."""
    recorder: Any
    """Where the loop reports its phases (the ledger's recorder, or a no-op)."""

    def wrap(self, model: Any) -> Any:
        """What the step calls: the model, or the model wrapped."""

    def share(self, batch: Any, size: int | None) -> Any:
        """This replica's share of one global batch (the inputs, then the targets)."""

    def step(self, step: int, replica: Replica, inputs: Any, targets: Any) -> StepRecord | None:
        """Run one step (forward, backward, optimizer); the record, or None to keep nothing."""


def train(case: Case, state: dict[str, Any], device: str, mode: Mode) -> Trace:
    """Train one replica of ``case`` from ``state`` as ``mode`` says; its trace."""
    import torch

    rec = mode.recorder
    rec.set_phase(-1, "build")
    model = prepared(case, state, device)
    wrapped = mode.wrap(model)
    replica = Replica(case, model, wrapped, make_optimizer(case, wrapped.parameters()), resolve_loss(case.loss),
                      device)
    data = data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    trace = Trace(mode=mode.name, rank=mode.rank, world_size=mode.world_size)
    drawn: list[tuple[Any, Any]] = []  # kept only when the mode runs past the case's steps
    for step in range(mode.steps):
        rec.set_phase(step, "forward")
        if step < case.steps:
            inputs, targets = global_batch(data, step, generator)
            size = batch_size(inputs)
            trace.batch_sizes.append(size if size is not None else -1)
            inputs, targets = cast(mode.share(inputs, size), case, device), cast(mode.share(targets, size), case, device)
            if mode.steps > case.steps:
                drawn.append((inputs, targets))
        else:
            inputs, targets = drawn[step % case.steps]
        record = mode.step(step, replica, inputs, targets)
        if record is not None:
            trace.steps.append(record)
    rec.set_phase(mode.steps, "done")
    return trace


def run_step(replica: Replica, inputs: Any, targets: Any) -> Any:
    """Forward and backward of a plain step; the loss."""
    replica.optimizer.zero_grad(set_to_none=True)
    loss = compute_loss(replica, forward(replica.wrapped, inputs), targets)
    loss.backward()
    return loss


def compute_loss(replica: Replica, outputs: Any, targets: Any) -> Any:
    """The case's loss of ``outputs``; a named loss given a model output that is not a
    tensor (a transformers ``ModelOutput``, a dict, a tuple) is a :class:`CaseError`
    that says what to write instead, not torch's TypeError."""
    import torch

    name = replica.case.loss
    if isinstance(name, str) and not isinstance(outputs, torch.Tensor):
        own = " (it computed its own loss: use out.loss)" if getattr(outputs, "loss", None) is not None else ""
        field = "logits" if getattr(outputs, "logits", None) is not None else "<the tensor>"
        raise CaseError(
            f"the model returned a {type(outputs).__name__} object, not a tensor, so the named loss {name!r} cannot "
            f"use it{own}; give the loss as a function of the output, e.g. "
            f"Case(loss=lambda out, y: torch.nn.functional.{name}(out.{field}, y))"
        )
    return replica.loss_fn(outputs, targets)


def snapshot(module: Any, loss: Any) -> StepRecord:
    """The step's record as the optimizer is about to step: the loss and every gradient."""
    return StepRecord(
        loss=loss.detach().to("cpu", copy=True),
        grads={
            n: (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
            for n, p in module.named_parameters()
        },
    )


def finish_step(record: StepRecord, module: Any) -> None:
    """Complete the record after the optimizer step: every parameter and buffer."""
    record.params = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}
    record.buffers = {n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers()}


# -- the case's parts ----------------------------------------------------------------------


def build_model(case: Case) -> Any:
    import torch

    factory = load_target(case.model) if isinstance(case.model, str) else case.model
    try:
        model = factory()
    except Exception as exc:
        raise CaseError(f"the model factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise CaseError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def data_fn(case: Case) -> Any:
    return load_target(case.data) if isinstance(case.data, str) else case.data


def initial_state(case: Case) -> dict[str, Any]:
    """The state every mode and rank starts from: the factory's model at the case's seed."""
    import torch

    torch.manual_seed(case.seed)
    model = build_model(case)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def prepared(case: Case, state: dict[str, Any], device: str) -> Any:
    import torch

    model = build_model(case)
    sync = [repr(n) if n else "the model" for n, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync and not device.startswith("cuda"):
        raise CaseError(
            f"the model has SyncBatchNorm ({', '.join(sync[:3])}{', ...' if len(sync) > 3 else ''}), which runs "
            f"only on GPUs, and this check runs on {device}: check it on GPUs (--backend nccl), or build the model "
            f"with nn.BatchNorm here (SyncBatchNorm is what makes BatchNorm under DDP match one device)"
        )
    model.load_state_dict(state)
    model.to(device=device, dtype=case.torch_dtype)
    torch.manual_seed(case.seed)  # any randomness in forward starts from the same point
    return model


def global_batch(data: Any, step: int, generator: Any) -> tuple[Any, Any]:
    try:
        batch = data(step, generator)
    except Exception as exc:
        raise CaseError(f"the data function raised at step {step}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise CaseError(
            f"the data function must return (inputs, targets) for step {step}, got {type(batch).__name__}"
        )
    return batch[0], batch[1]


def forward(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


# -- batches -------------------------------------------------------------------------------


def map_tensors(obj: Any, fn: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def batch_size(obj: Any) -> int | None:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.shape[0]) if obj.dim() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        size = batch_size(item)
        if size is not None:
            return size
    return None


def shard(obj: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s contiguous, equal share of every tensor along dim 0."""

    def cut(t: Any) -> Any:
        if t.dim() == 0:
            return t
        per = t.shape[0] // world_size
        return t[rank * per : (rank + 1) * per]

    return map_tensors(obj, cut)


def reverse_samples(obj: Any, size: int) -> Any:
    """The same batch in reversed sample order (tensors whose dim 0 is the batch)."""
    return map_tensors(obj, lambda t: t.flip(0) if t.dim() and t.shape[0] == size else t)


def cast(batch: Any, case: Case, device: str) -> Any:
    def move(t: Any) -> Any:
        t = t.to(device)
        return t.to(case.torch_dtype) if t.is_floating_point() else t

    return map_tensors(batch, move)
