"""One training step, the user's or ddparity's own, run and recorded the same way in every
mode.

A step is ``step_fn(model, batch, optimizer, ctx)``: the user's ``Case(train_step=...)``,
or :func:`default_step` (zero the gradients, forward, the case's loss, backward,
``optimizer.step()``). What is recorded does not depend on which: hooks on the optimizer
(:class:`OptimizerWatch`) hand the gradients to the run's sink as the optimizer sees them
when ``optimizer.step()`` is called — after any accumulation, unscaling or clipping the
step did — and the parameters and buffers when the step returns (the sink writes the
reference's to the spool, or compares a run's with them: :mod:`ddparity.harness.ranks.spool`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddparity.errors import CaseError
from ddparity.harness.optimizer_steps import nested_step


@dataclass(eq=False)
class StepContext:
    """What a ``train_step`` is told about where it runs (its ``ctx`` argument)."""

    rank: int
    world_size: int
    mode: str
    """``"single"``, ``"dp"`` or ``"ddp"``."""
    device: str
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    """Lives for the whole run of one replica: an LR scheduler, a GradScaler."""
    sync_off: Callable[[], Any] | None = field(default=None, repr=False)

    def no_sync(self) -> Any:
        """DDP's ``no_sync()`` under DDP (gradients accumulate locally, no all-reduce); a
        context that does nothing in the other modes."""
        return self.sync_off() if self.sync_off is not None else contextlib.nullcontext()


class OptimizerWatch:
    """Hooks on a replica's optimizer: how often ``step()`` was called in this training
    step, and the moment its gradients are final (at the call; after it for an optimizer
    given a closure, such as LBFGS, which computes them inside), when ``on_grads`` is
    called (the run's sink records or compares them there, in place). ``watchers`` (the
    reference's :class:`OptimizerPrecision` and :class:`ChangedOutside`) are told as each
    step begins and ends and as its first ``optimizer.step()`` starts and returns."""

    def __init__(self, optimizer: Any, before_step: Callable[[], None], on_grads: Callable[[], None],
                 watchers: tuple[Any, ...] = ()) -> None:
        self.before_step = before_step
        self.on_grads = on_grads
        self.calls = 0
        self._closure = False
        self.watchers = watchers
        import torch

        # eager even inside a compiled optimizer.step() (torch.compile(optimizer.step), as torch's
        # tutorial compiles it): Dynamo traced the recording and the reference's gradients came
        # out with other shapes ([32, 8] for a [32, 32] weight)
        self._handles = [optimizer.register_step_pre_hook(torch.compiler.disable(self._pre)),
                         optimizer.register_step_post_hook(torch.compiler.disable(self._post))]

    def begin(self, step: int = 0) -> None:
        self.calls, self._closure = 0, False
        for w in self.watchers:
            w.begin(step)

    def end(self) -> None:
        for w in self.watchers:
            w.end()

    def _pre(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if nested_step():
            return
        self.calls += 1
        if self.calls > 1:
            return
        self._closure = bool(args and callable(args[0])) or callable(kwargs.get("closure"))
        self.before_step()
        if not self._closure:
            self.on_grads()
        for w in self.watchers:
            w.pre()  # after ddparity's own recording: the optimizer's own work alone

    def _post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if self.calls != 1 or nested_step():
            return
        for w in reversed(self.watchers):
            w.post()  # in the reverse order of pre(): a watcher's TorchFunctionMode is the innermost
        if self._closure:
            self.on_grads()

    def close(self) -> None:
        for w in self.watchers:
            w.close()  # an optimizer step that raised: its watch ends here
        for handle in self._handles:
            handle.remove()


class OptimizerPrecision:
    """The lowest floating precision the first ``optimizer.step()`` computed in, where it is
    lower than the parameters' (``dtype``, None otherwise). An optimizer may compute in bf16
    what is not element-wise (Muon's Newton-Schulz iteration casts each update to bf16):
    under FSDP its matrix products run on shards, summed in another order, and rounding
    that no reordering of the batch shows moves the update. Seen through a
    ``TorchFunctionMode`` over that one call (the first step only: its code is every step's)."""

    def __init__(self, params_dtype: Any) -> None:
        import torch

        self.dtype: Any = None
        self._eps = torch.finfo(params_dtype).eps if params_dtype is not None and params_dtype.is_floating_point else 0.0
        self._mode: Any = None
        self._done = False

    def begin(self, step: int) -> None:
        pass

    def end(self) -> None:
        pass

    def pre(self) -> None:
        if self._done or self._mode is not None:
            return
        self._mode = results_through(lambda func, out: self._seen(out))
        self._mode.__enter__()

    def post(self) -> None:
        if self._mode is not None:
            mode, self._mode, self._done = self._mode, None, True
            mode.__exit__(None, None, None)

    close = post

    def _seen(self, out: Any) -> Any:
        import torch

        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                eps = torch.finfo(t.dtype).eps
                if eps > self._eps and (self.dtype is None or eps > torch.finfo(self.dtype).eps):
                    self.dtype = t.dtype
        return out


def results_through(fn: Callable[[Any, Any], Any]) -> Any:
    """A ``TorchFunctionMode`` (the caller enters and exits it) in which every op's result is
    ``fn(func, result)``: a watcher's view of the optimizer's own work."""
    from torch.overrides import TorchFunctionMode

    class Through(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            return fn(func, func(*args, **(kwargs or {})))

    return Through()


class OptimizerSettings:
    """The optimizer's numeric settings as each step's ``optimizer.step()`` ends (lr,
    momentum, betas, weight decay, a scheduler's ``initial_lr``, what the step itself set,
    such as Prodigy's ``d``: one value per param group), per step. Where a rank's differ from
    one device's (a scheduler stepped on the rank's own loss, the linear scaling rule, a rate
    computed from the rank's own shards), they name the cause outright
    (:mod:`ddparity.checks.optimizer_settings`)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self.settings: dict[int, dict[str, tuple[float, ...]]] = {}
        self._step = 0

    def begin(self, step: int) -> None:
        self._step = step

    def pre(self) -> None:
        pass

    def post(self) -> None:
        from ddparity.harness.optimizer_settings import settings_of

        self.settings[self._step] = settings_of(self._optimizer)

    end = close = pre


def gradient_hooks(model: Any) -> list[str]:
    """The parameters of ``model`` (as the user built it, before any hook of ddparity's) with a
    hook on their gradient: ``p.register_hook`` (run on the gradient autograd computes, so on
    each DDP rank's own before the average, and not at all under FSDP2, which replaces the
    parameters) or ``p.register_post_accumulate_grad_hook`` (FSDP2 drops those too)."""
    return [name for name, p in model.named_parameters()
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]


class AutocastWatch:
    """The lowest precision autocast ran any module of a replica in (bf16, fp16), for the
    calibration: rounding noise scales with the precision computed in, not with the
    parameters' dtype."""

    def __init__(self, model: Any, device: str) -> None:
        self.dtype: Any = None
        self._device = device.split(":")[0]
        import torch

        self._handles = [m.register_forward_pre_hook(self._seen) for m in model.modules()
                         if not isinstance(m, torch.jit.ScriptModule)]

    def _seen(self, module: Any, args: Any) -> None:
        import torch

        try:
            enabled = torch.is_autocast_enabled(self._device)
            dtype = torch.get_autocast_dtype(self._device) if enabled else None
        except (TypeError, AttributeError):  # torch < 2.4: per-device functions
            cpu = self._device == "cpu"
            enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
            dtype = (torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()) if enabled else None
        if dtype is not None and (self.dtype is None or torch.finfo(dtype).eps > torch.finfo(self.dtype).eps):
            self.dtype = dtype

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class Ticks:
    """Every module's forward and every gradient accumulated ticks the rank's recorder:
    progress the controller sees while one long step of a large model computes."""

    def __init__(self, model: Any) -> None:
        from ddparity.harness.recording import recorder

        rec = recorder.active()
        self._handles: list[Any] = []
        if rec is recorder.DISABLED or model is None:  # None: a compiled run ticks as it compiles
            return
        import torch

        tick = rec.tick
        self._handles = [m.register_forward_hook(lambda *_: tick()) for m in model.modules()
                         if not isinstance(m, torch.jit.ScriptModule)]  # (which take no hooks)
        self._handles += [p.register_post_accumulate_grad_hook(lambda _: tick())
                          for p in model.parameters() if p.requires_grad]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def lowest_precision(*dtypes: Any) -> Any:
    """The dtype with the largest epsilon among those given (None ignored)."""
    import torch

    known = [d for d in dtypes if d is not None]
    return max(known, key=lambda d: torch.finfo(d).eps) if known else None


def record_step(step: int, replica: Any, batch: Any) -> tuple[Any, bool]:
    """Run ``replica``'s step function on ``batch`` (its gradients reach the replica's sink
    as the optimizer steps); the loss it returned (a CPU scalar) and whether it stepped."""
    ctx, watch = replica.ctx, replica.watch
    ctx.step = step
    watch.begin(step)
    loss = replica.step_fn(replica.wrapped, batch, replica.optimizer, ctx)
    watch.end()
    if watch.calls > 1:
        raise CaseError(
            f"train_step called optimizer.step() {watch.calls} times at step {step}; ddparity compares one "
            f"optimizer step per train_step call: accumulate inside it (ctx.no_sync() for the micro-batches "
            f"before the last) and step once"
        )
    stepped = bool(watch.calls)
    replica.stepped.append(stepped)
    return scalar_loss(loss, step), stepped


def scalar_loss(loss: Any, step: int) -> Any:
    import torch

    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor(float(loss), dtype=torch.float64)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CaseError(
            f"train_step must return the step's loss as a scalar (a 0-d tensor or a number), got {got} at step "
            f"{step}; return the loss the step optimised (for accumulation: the mean of the micro-batches' losses)"
        )
    return loss.detach().reshape(()).to("cpu", copy=True)


def never_stepped(stepped: list[bool], steps: int) -> None:
    """A run whose step function never called ``optimizer.step()`` is an error: nothing
    would be compared but the loss."""
    if steps and stepped and not any(stepped):
        raise CaseError(
            f"train_step never called optimizer.step() in {steps} step(s): call optimizer.step() (or "
            f"scaler.step(optimizer)) once per train_step; ddparity records the gradients as the optimizer sees "
            f"them there (a GradScaler skips the steps whose gradients overflowed: if that is why, give the case "
            f"more steps or the scaler a lower init_scale)"
        )


def default_step(replica: Any, compute_loss: Callable[..., Any], forward: Callable[..., Any]) -> Callable[..., Any]:
    """ddparity's own step for a case without ``train_step``: zero the gradients, forward,
    the case's loss, backward, ``optimizer.step()``."""
    optimizer = replica.optimizer
    needs = [p for p in inspect.signature(optimizer.step).parameters.values()
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.name == "closure" for p in needs):
        raise CaseError(
            f"the optimizer {type(optimizer).__name__} needs a closure (optimizer.step(closure)), and ddparity's "
            f"built-in step calls optimizer.step(); give the case your own step, e.g. Case(train_step=fn) with fn "
            f"calling optimizer.step(closure) where closure zeroes the gradients, computes the loss, calls "
            f"backward() and returns the loss"
        )

    def step(model: Any, batch: Any, optimizer: Any, ctx: StepContext) -> Any:
        inputs, targets = batch
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(replica, forward(model, inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    return step
