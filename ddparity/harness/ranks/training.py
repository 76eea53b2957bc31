"""The one training loop, inside a rank process, and the :class:`Mode` protocol that every
way of training a replica implements.

:func:`train` builds the replica from the shared initial state, draws every global batch
from the case's data function, hands the mode this replica's share and lets the mode run
the step; the step's tensors go to the run's sink as they are made (the reference's to
the spool, every other run's compared with them there: :mod:`ddparity.harness.ranks.spool`). A mode (one per file in
:mod:`ddparity.harness.ranks.modes`) says

* how the replica is wrapped (``wrap``: the model itself, ``DataParallel``, ``DDP``);
* which share of each global batch it trains on (``share``: all, reversed, a shard);
* what happens as the step calls ``optimizer.step()`` (``before_optimizer``: the twin's
  nudge, DDP's phase);
* how a step runs and what is recorded (``step``: usually the case's own ``train_step``
  or ddparity's, through :func:`ddparity.harness.ranks.stepping.record_step`, then
  :func:`finish_step`).

While a replica trains, dropout gives every sample the same mask in every mode
(:mod:`ddparity.harness.ranks.randomness`), the reference watches for any other random draw,
and the lowest precision autocast computed in is noted for the calibration.

The modes: ``single`` (the reference), its ``twin``, ``dp``, ``ddp``, ``fsdp``/``hsdp``, ``timed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddparity.case import Case, load_target, make_optimizer, resolve_loss
from ddparity.errors import CaseError
from ddparity.harness.ranks.batches import batch_dims, batch_size, cast
from ddparity.harness.ranks.changed_outside import ChangedOutside
from ddparity.harness.ranks.compiling import EAGER, Compiled, Eager
from ddparity.harness.ranks.draws import RandomDraws
from ddparity.harness.ranks.randomness import AlignedDropout
from ddparity.harness.ranks.stacked_rnn import stack_rnns
from ddparity.harness.ranks.stepping import (
    AutocastWatch,
    OptimizerPrecision,
    OptimizerSettings,
    OptimizerWatch,
    StepContext,
    Ticks,
    default_step,
    gradient_hooks,
    never_stepped,
)
from ddparity.run_kinds import kind


class Sink(Protocol):
    """Where a run's tensors go as the step makes them: the reference's
    :class:`~ddparity.harness.ranks.spool.Writer`, every other run's
    :class:`~ddparity.harness.ranks.comparer.Comparer`, or
    :class:`~ddparity.harness.ranks.spool.NoSink` (profile's timed steps). One that says
    ``watches_the_optimizer`` is told of the optimizer's step too (an optimizer watcher)."""

    def grads(self, step: int, model: Any) -> None:
        """The gradients as the optimizer sees them (at ``optimizer.step()``)."""

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        """The loss, parameters, optimizer state and buffers as the step left them."""


@dataclass(slots=True, eq=False)
class Replica:
    """One replica in training: what a mode's step works with."""

    case: Case
    model: Any
    """The module whose gradients, parameters and buffers are recorded."""
    wrapped: Any
    """What the step calls: the model, or the model wrapped (DDP, DataParallel)."""
    optimizer: Any
    loss_fn: Callable[[Any, Any], Any]
    device: str
    ctx: StepContext
    step_fn: Any = None
    """``(model, batch, optimizer, ctx) -> loss``: the case's ``train_step``, or ddparity's
    (set by :func:`train` once the replica exists: ddparity's step uses it)."""
    watch: Any = None
    """The :class:`~ddparity.harness.ranks.stepping.OptimizerWatch` on the optimizer (set by :func:`train`)."""
    precision: Any = None
    """The :class:`~ddparity.harness.ranks.stepping.AutocastWatch` on the model (set by :func:`train`)."""
    shared_batch: Any = None
    """This step's share of the global batch before it is cast (``ddparity.whole`` marks kept)."""
    sink: Any = None
    """Where the step's tensors go: a :class:`Sink` (set by :func:`train`)."""
    stepped: list[bool] = field(default_factory=list)
    """Per step so far, whether the optimizer stepped."""


class Mode(Protocol):
    """One way of training a replica (see the module docstring)."""

    name: str
    """What ``ctx.mode`` says: the name of its row in :mod:`ddparity.run_kinds` (the twin
    is ``single``'s, profile's timed modes those they time)."""
    rank: int
    world_size: int
    steps: int
    """Iterations to run; past the case's own steps its batches are used again, in order."""
    recorder: Any
    """Where the loop reports its phases (the ledger's recorder, or a no-op)."""
    align_dropout: bool
    """Draw each sample's dropout mask as every mode does (off: profile's timed steps)."""
    watch_draws: bool
    """Watch for random draws dropout alignment does not cover (the reference: a run whose
    draws differ from the reference's cannot be compared)."""
    name_draws: bool
    """Name each such draw by its op and layer (a second, slower pass)."""

    def wrap(self, model: Any) -> Any:
        """What the step calls: the model, or the model wrapped."""

    def sync_off(self, wrapped: Any) -> Callable[[], Any] | None:
        """What ``ctx.no_sync()`` enters for ``wrapped`` (what :meth:`wrap` returned): a
        context factory in which backward communicates nothing (DDP's ``no_sync``, FSDP2's
        equivalent), or None where there is nothing to turn off."""

    def share(self, batch: Any, size: int | None) -> Any:
        """This replica's share of one global batch."""

    def before_optimizer(self, replica: Replica) -> None:
        """Called as the step calls ``optimizer.step()``, before the optimizer runs."""

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        """Run one step (usually :func:`ddparity.harness.ranks.stepping.record_step`, then
        :func:`finish_step`)."""


@dataclass
class Trained:
    """What training one replica says about itself (its tensors went to its sink)."""

    batch_sizes: list[int]
    dropout_calls: int
    """The most dropout calls one step made (each given the same mask per sample in every mode)."""
    autocast_dtype: str | None
    """The lowest precision autocast computed in ("bfloat16", "float16"), if any."""
    layer_types: dict[str, str] = field(default_factory=dict)
    """The class of every layer that keeps running statistics (BatchNorm's), by its name."""
    optimizer_dtype: str | None = None
    """A lower precision than the parameters' that the optimizer step computed in, if any."""
    changed_outside: dict[int, dict[str, str]] = field(default_factory=dict)
    """Per step, the parameters changed in place outside ``optimizer.step()``, with what holds them."""
    grad_hooks: list[str] = field(default_factory=list)
    """The parameters the user's model hooks the gradient of (:func:`stepping.gradient_hooks`)."""
    settings: dict[int, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    """Per step, the optimizer's settings as its step ended (:class:`stepping.OptimizerSettings`)."""


def train(case: Case, state: dict[str, Any] | str, device: str, mode: Mode, sink: Sink | None = None,
          compiled: Any = None) -> Trained:
    """Train one replica of ``case`` from ``state`` as ``mode`` says; its tensors go to
    ``sink`` as they are made (:mod:`ddparity.harness.ranks.spool`: the reference's are written,
    a run's compared with them), nothing is kept here. ``compiled``: a
    :class:`~ddparity.harness.ranks.compiling.Compiled`, when the step is to call
    ``torch.compile`` of what the mode wrapped (None: :data:`~ddparity.harness.ranks.compiling.EAGER`)."""
    run = compiled if compiled is not None else EAGER
    with run:
        return _train(case, state, device, mode, sink, run)


def _train(case: Case, state: dict[str, Any] | str, device: str, mode: Mode, sink: Sink | None,
           run: Eager | Compiled) -> Trained:
    import torch

    from ddparity.harness.ranks.spool import NoSink

    rec = mode.recorder
    rec.set_phase(-1, "build")
    model = prepared(case, state, device)
    hooked = gradient_hooks(model)
    own_hooks = not run.traced  # ddparity's hooks, dropouts and stacked RNNs on the model: eager runs only
    if mode.align_dropout and own_hooks:
        stack_rnns(model)  # their inter-layer dropout aligned too, before any mode wraps them
    wrapped = mode.wrap(model)
    ctx = StepContext(mode.rank, mode.world_size, mode.name, device, sync_off=mode.sync_off(wrapped))
    called = run.wrap(wrapped)
    replica = Replica(case, model, called, make_optimizer(case, wrapped.parameters()), resolve_loss(case.loss),
                      device, ctx, sink=sink if sink is not None else NoSink())
    reference = kind(mode.name).reference and own_hooks
    precision, outside = OptimizerPrecision(case.torch_dtype), ChangedOutside(model)
    settings = OptimizerSettings(replica.optimizer)
    replica.watch = OptimizerWatch(replica.optimizer, lambda: mode.before_optimizer(replica),
                                   lambda: replica.sink.grads(ctx.step, model),
                                   ((precision, outside, settings) if reference else (settings,))
                                   + ((replica.sink,) if getattr(replica.sink, "watches_the_optimizer", 0) else ()))
    replica.step_fn = user_step(case) or default_step(replica, compute_loss, forward)
    # the reference and its twin calibrate with the precision computed in; the other modes need not know
    replica.precision = AutocastWatch(model, device) if reference else None
    data = data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    sizes: list[int] = []
    drawn: list[tuple[Any, Any, Any]] = []  # kept only when the mode runs past the case's steps
    # compiled: torch's own dropout (a model that draws masks is not compared compiled, see
    # ddparity.verbs.compiled), so that Dynamo sees the model's own code, no hook of ours
    dropout = AlignedDropout(model, case.seed, enabled=mode.align_dropout and own_hooks)
    ticks = Ticks(model if own_hooks else None)  # a hook on every module: Dynamo would trace them all
    try:
        for step in range(mode.steps):
            rec.set_phase(step, "forward")
            if step < case.steps:
                batch = global_batch(data, step, generator, pair=case.train_step is None)
                size = batch_size(batch, step)
                sizes.append(size if size is not None else -1)
                rows = mode.share(torch.arange(size), size) if size else None  # which samples this replica has
                shared = mode.share(batch, size)
                batch = cast(shared, case, device)
                if mode.steps > case.steps:
                    drawn.append((shared, batch, rows))
            else:
                shared, batch, rows = drawn[step % case.steps]
            replica.shared_batch = shared
            dropout.begin(step, rows, batch, batch_dims(shared))
            if mode.watch_draws:
                naming = mode.name_draws
                with RandomDraws(name=naming) as draws:
                    mode.step(step, replica, batch)
                if draws.moved and not naming:  # name them: the same training again, up to here, op by op
                    train(case, state, device, type(mode)(step + 1, name_draws=True))  # type: ignore[call-arg]
                dropout.raise_if_traced(step)  # (a compiled graph's own draws: said as such)
                draws.raise_if_any(step, replica.model)
            else:
                mode.step(step, replica, batch)
            dropout.end_step(step)
    finally:
        calls = dropout.close()
        ticks.close()
        replica.watch.close()
        if replica.precision is not None:
            replica.precision.close()
    low = replica.precision.dtype if replica.precision is not None else None
    never_stepped(replica.stepped, mode.steps)
    rec.set_phase(mode.steps, "done")
    stats = {name: type(m).__name__ for name, m in model.named_modules()
             if any(b in ("running_mean", "running_var") for b, _ in m.named_buffers(recurse=False))}
    return Trained(sizes, calls, _named(low), stats, _named(precision.dtype), outside.changed, hooked,
                   settings.settings)


def _named(dtype: Any) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def finish_step(replica: Replica, step: int, loss: Any, stepped: bool) -> None:
    """The step's loss, parameters, optimizer state and buffers to the replica's sink, as
    the step left them."""
    replica.sink.after(step, loss, stepped, replica.model, replica.optimizer)


def finish_shared_step(mode: Mode, replica: Replica, step: int, loss: Any, stepped: bool) -> None:
    """:func:`finish_step` for a rank of a data-parallel world (DDP, FSDP2, HSDP): the loss
    recorded is the objective data parallelism optimises, the mean of the ranks' losses
    (all-reduced in float32 or the loss's own wider dtype: a float64 loss summed in float32
    differed from the reference by float32's rounding, 1e6 float64 tolerances)."""
    import torch
    import torch.distributed as dist

    global_loss = loss.detach().to(replica.device, torch.promote_types(loss.dtype, torch.float32), copy=True)
    dist.all_reduce(global_loss)
    mode.recorder.set_phase(step, "compare")
    finish_step(replica, step, (global_loss / mode.world_size).cpu(), stepped)


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
            f"Case(loss=lambda out, y: torch.nn.functional.{name}(out.{field}, y)), or your own "
            f"Case(train_step=...)"
        )
    loss = replica.loss_fn(outputs, targets)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CaseError(f"the loss must be a tensor with one element, got {got} (a reduction='none' loss? "
                        f"reduce it, e.g. .mean(), as your training does)")
    return loss


def user_step(case: Case) -> Callable[..., Any] | None:
    if case.train_step is None:
        return None
    return load_target(case.train_step) if isinstance(case.train_step, str) else case.train_step


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
    if next(model.parameters(), None) is None:
        raise CaseError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train, "
                        f"synchronise or compare; give a model with parameters")
    return model


def data_fn(case: Case) -> Any:
    return load_target(case.data) if isinstance(case.data, str) else case.data


def initial_state(case: Case) -> dict[str, Any]:
    """The state every mode and rank starts from: the factory's model at the case's seed."""
    import torch

    torch.manual_seed(case.seed)
    model = build_model(case)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def prepared(case: Case, state: dict[str, Any] | str, device: str) -> Any:
    import torch

    model = build_model(case)
    sync = [repr(n) if n else "the model" for n, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync and not device.startswith("cuda"):
        raise CaseError(
            f"the model has SyncBatchNorm ({', '.join(sync[:3])}{', ...' if len(sync) > 3 else ''}), which runs "
            f"only on GPUs, and this check runs on {device}: check it on GPUs (--backend nccl), or build the model "
            f"with nn.BatchNorm here (SyncBatchNorm is what makes BatchNorm under DDP match one device)"
        )
    if isinstance(state, str):  # a check's spool: the state memory-mapped from it
        from ddparity.harness.spool_files import load_state

        state = load_state(state)
    model.load_state_dict(state)
    del state
    cast_model(model, device, case.torch_dtype)
    torch.manual_seed(case.seed)  # any randomness in forward starts from the same point
    return model


def cast_model(model: Any, device: str, dtype: Any) -> None:
    """``model.to(device, dtype)``, but a complex tensor keeps its imaginary part: it
    becomes the complex dtype of ``dtype``'s precision (``module.to(torch.float32)`` would
    cast it to real and drop it), or stays as it is where there is none."""
    import torch

    complex_of = {torch.float64: torch.complex128, torch.float32: torch.complex64}.get(dtype)

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        if t.is_complex() and complex_of is not None:
            return t.to(device=device, dtype=complex_of)
        return t.to(device=device)

    model._apply(one)


def global_batch(data: Any, step: int, generator: Any, pair: bool = True) -> Any:
    """The global batch of ``step``: ``(inputs, targets)``, or (``pair=False``: the case
    has its own ``train_step``) any nest of tensors."""
    try:
        batch = data(step, generator)
    except Exception as exc:
        raise CaseError(f"the data function raised at step {step}: {type(exc).__name__}: {exc}") from exc
    if pair and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise CaseError(
            f"the data function must return (inputs, targets) for step {step}, got {type(batch).__name__} "
            f"(any other nest of tensors needs your own Case(train_step=...))"
        )
    return tuple(batch) if pair else batch


def call_args(inputs: Any) -> tuple[tuple, dict]:
    """How the built-in step calls the model with a batch's ``inputs``: a dict as keyword
    arguments, a plain tuple or list as positional arguments, anything else (a tensor, a
    NamedTuple, a dataclass, ...) as the one argument, whole, as ``ddp(inputs)`` passes it."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if type(inputs) in (tuple, list):
        return tuple(inputs), {}
    return (inputs,), {}


def forward(model: Any, inputs: Any) -> Any:
    args, kwargs = call_args(inputs)
    return model(*args, **kwargs)
