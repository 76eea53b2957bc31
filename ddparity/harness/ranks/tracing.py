"""The first differing module, recorded: one step's forward and backward module by module, in
a rank process.

A failing check re-runs its first differing step (:mod:`ddparity.harness.ranks.probes`): the
reference on one device, then each rank of the failing run, each training from the initial
state up to that step with a :class:`ModuleTrace` armed for it. The trace keeps, for every
module call of the step in the order calls finish,

* the call's floating-point inputs and outputs;
* the gradients w.r.t. them, as backward makes them (tensor hooks, which return nothing:
  what the user's code computes is left as it is; a later in-place op is no obstacle);
* for one call asked for, the aten ops it ran (a ``TorchDispatchMode``).

The parameters' gradients are not recorded again: the run compared every one of them at
every step already (its distances). A record read against the reference's:
:mod:`ddparity.harness.ranks.differing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One module call of the traced step."""

    name: str
    type: str
    index: int
    """The module's call number in the step (a module called twice: 0, then 1)."""
    params: list[str]
    """The full names of the module's own parameters (its children's not)."""
    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    in_grads: dict[int, Any] = field(default_factory=dict)
    out_grads: dict[int, Any] = field(default_factory=dict)
    forward: int = -1
    """The forward of the model (a micro-batch's: the step's first, second, ...) the call was
    made in; -1: outside any."""
    within: int = 0
    """The module's call number in that forward."""


class ModuleTrace:
    """Every module call of one step of a model (``target``), recorded on the CPU; also the
    run's sink (:class:`~ddparity.harness.ranks.training.Sink`), which records nothing more."""

    def __init__(self, target: int, inside: tuple[str, int] | None = None, size: int = 0) -> None:
        self.target = target
        self.size = size
        """The step's global batch size (0: not known)."""
        self.rows: Any = None
        """The global index of every row of the replica's share (set when the step starts)."""
        self._sources: list[Any] = []
        self.forwards: list[Any] = []
        """Each forward's samples (their global indices, or None where its input is no slice
        of the share), in the order the forwards started."""
        self.contents: list[Any] = []
        """Each forward's rows, by content (:func:`~ddparity.harness.ranks.forward_rows.content`):
        where its samples are untold, they are found by it in the reference's forwards."""
        self._within: dict[str, int] = {}
        self.inside = inside
        """(module, call): that call's aten ops recorded too (their outputs), in order."""
        self.ops: list[tuple[str, list[Any]]] = []
        self._ops: Any = None
        self._entered = 0
        self.armed = False
        self.calls: list[Call] = []
        self.backward: list[int] = []
        """Calls in the order their output gradients arrived."""
        self._handles: list[Any] = []
        self._counts: dict[str, int] = {}

    def attach(self, model: Any) -> None:
        import torch

        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: traced as a whole where its caller is
                continue
            own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
            self._handles.append(module.register_forward_hook(
                lambda m, args, kwargs, out, _n=name, _o=own: self._called(m, _n, _o, args, kwargs, out),
                with_kwargs=True))
            if not name:
                self._handles.append(module.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
            if self.inside is not None and name == self.inside[0]:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave))

    def arm(self, share: Any, batch: Any) -> None:
        """Record the next step: ``share`` the replica's way of taking its rows of a global
        batch (the mode's), ``batch`` its share of the step's batch."""
        import torch

        from ddparity.harness.ranks.batches import named_tensors

        self.armed = True
        if self.size > 0:
            self.rows = share(torch.arange(self.size), self.size)
            self._sources = [t for _, t in named_tensors(batch) if t.dim() and t.shape[0] == len(self.rows)]

    def _forward_starts(self, module: Any, args: Any, kwargs: Any) -> None:
        """A forward of the model: which samples it holds (a micro-batch's slice of the share
        is matched by storage, as aligned dropout matches it)."""
        from ddparity.harness.ranks.forward_rows import content, rows_of

        if self.armed:
            self._within = {}
            inputs = list(args) + list(kwargs.values())
            self.forwards.append(rows_of(self.rows, self._sources, [0], inputs))
            self.contents.append(content(inputs))
        return None

    def _enter(self, module: Any, args: Any) -> None:
        if self.armed:
            assert self.inside is not None
            if self._entered == self.inside[1]:
                self._ops = _op_recorder()
                self._ops.__enter__()
            self._entered += 1
        return None

    def _leave(self, module: Any, args: Any, out: Any) -> None:
        if self._ops is not None:
            self._ops.__exit__(None, None, None)
            self.ops, self._ops = self._ops.ops, None
        return None

    def _called(self, module: Any, name: str, own: list[str], args: Any, kwargs: Any, out: Any) -> None:
        if not self.armed:
            return None
        index = self._counts.get(name, 0)
        self._counts[name] = index + 1
        within = self._within.get(name, 0)
        self._within[name] = within + 1
        call = Call(name, type_name(module), index, own, forward=len(self.forwards) - 1, within=within)
        position = len(self.calls)
        self.calls.append(call)
        for j, t in enumerate(floats((args, kwargs))):
            call.inputs.append(kept(t))
            if t.requires_grad:
                t.register_hook(lambda g, _j=j: self._grad(call.in_grads, _j, g))
        for j, t in enumerate(floats(out)):
            call.outputs.append(kept(t))
            if t.requires_grad:
                t.register_hook(lambda g, _j=j, _p=position: self._out_grad(call, _p, _j, g))
        return None

    def _grad(self, into: dict[int, Any], j: int, grad: Any) -> None:
        if grad is not None:
            into[j] = kept(grad)

    def _out_grad(self, call: Call, position: int, j: int, grad: Any) -> None:
        if position not in self.backward:
            self.backward.append(position)
        self._grad(call.out_grads, j, grad)

    def grads(self, step: int, model: Any) -> None:
        """Nothing: the parameters' gradients are the run's own comparison's (every step's)."""

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        """Nothing."""

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def record(self) -> dict[str, Any]:
        """What the comparison needs, plain (``torch.save``-able)."""
        return {"calls": [vars(c) for c in self.calls], "backward": self.backward, "ops": self.ops,
                "forwards": self.forwards, "contents": self.contents}


@dataclass
class Traced:
    """A mode (``inner``) whose step ``trace.target`` is recorded by ``trace`` (the rest of
    the mode is the inner one's)."""

    inner: Any
    trace: ModuleTrace

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wrap(self, model: Any) -> Any:
        self.trace.attach(model)  # on the user's modules, before any wrapper
        return self.inner.wrap(model)

    def step(self, step: int, replica: Any, batch: Any) -> None:
        if step == self.trace.target:
            self.trace.arm(self.inner.share, batch)
        try:
            self.inner.step(step, replica, batch)
        finally:
            self.trace.armed = False


COMMS = ("c10d", "_c10d_functional", "fsdp", "_dtensor")
"""Op namespaces of the wrappers' communication (an FSDP2 module's all-gather in its hooks):
not the user's computation, left out of a call's ops."""


def _op_recorder() -> Any:
    """A dispatch mode that keeps every aten op's name and floating outputs (on the CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, list[Any]]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if not name.startswith(COMMS):
                self.ops.append((name, [kept(t) for t in floats(out)]))
            return out

    return Ops()


def type_name(module: Any) -> str:
    """The module's own class name (FSDP2's ``FSDPLinear`` is a ``Linear``)."""
    mro = type(module).__mro__
    if any(c.__name__ == "FSDPModule" for c in mro):
        return next((c.__name__ for c in mro[1:] if not c.__name__.startswith("FSDP")), mro[0].__name__)
    return mro[0].__name__


def floats(obj: Any) -> list[Any]:
    """The floating-point tensors in a nest (tuples, lists, dicts, a transformers
    ``ModelOutput``), in order."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() or obj.is_complex() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in floats(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in floats(v)]
    return []


def kept(t: Any) -> Any:
    """A recorded tensor: detached, copied to the CPU."""
    return t.detach().to("cpu", copy=True)


__all__ = ["COMMS", "Call", "ModuleTrace", "Traced", "floats", "kept", "type_name"]
