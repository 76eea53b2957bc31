"""Eager against compiled, block by block: where a compiled single-device run differs from the
eager reference, the first block whose compiled output differs from its eager output on the
same input.

:func:`compiled_blocks_task` takes the model's first call of step 0 (its inputs as the step
passed them, the case's own ``train_step`` too), then compiles the model alone and compares
its output with eager's; where it differs, each direct child in the order it was called, on
the inputs it got in the eager forward, compiled alone; the first child that differs is
searched the same way, down to a block none of whose children differs alone (the difference
is in its own forward) or a leaf. A block differs where its compiled output is further from
the same block in float64 than :data:`NOISE_FACTOR` x eager's own distance to it (torch's
accuracy minifier's rule), and beyond :data:`FLOOR_EPS` machine epsilons; the block is
named with its graph breaks (``torch._dynamo.explain``).

:func:`compiled_replica_blocks_task` searches the same way on every rank of a compiled
data-parallel run that diverged: each rank trains eagerly in the run's mode up to the first
differing step and takes the model's first call of that step (its own shard, the model's
state then, FSDP2's parameters gathered whole), and its blocks, on a plain copy of the
model, are compiled against eager on that input.
"""

from __future__ import annotations

import copy
from typing import Any

from ddparity.case import Case
from ddparity.compile_spec import CompileSpec
from ddparity.harness.protocol import RankContext, names_run
from ddparity.harness.ranks.differing import FLOOR_EPS, NOISE_FACTOR, rel
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.rank import released
from ddparity.harness.ranks.tasks import replica_mode
from ddparity.harness.ranks.tracing import floats, type_name
from ddparity.harness.ranks.training import prepared, train
from ddparity.verdicts import ModuleFinding

DEPTH = 8
"""How deep the search goes into nested blocks."""
COPY_DEPTH = 6
"""How deep a call's inputs are copied into the objects they hold."""


class _CallAt:
    """A mode (``inner``) that keeps the model's state as step ``target`` starts and the inputs
    of the model's first call in it (the user's module, under any wrapper the mode puts on it)."""

    def __init__(self, inner: Any, target: int) -> None:
        self.inner, self.target = inner, target
        self.call: tuple[Any, Any] | None = None
        self.state: dict[str, Any] | None = None
        self._armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wrap(self, model: Any) -> Any:
        model.register_forward_pre_hook(self._keep, with_kwargs=True)
        return self.inner.wrap(model)

    def step(self, step: int, replica: Any, batch: Any) -> None:
        self._armed = step == self.target
        if self._armed:  # FSDP2's sharded parameters gathered whole, every rank in the same order; not in
            # forward (FSDP2's state_dict there puts its sharded parameters back mid-forward)
            self.state = {k: _whole(v).detach().clone() for k, v in replica.model.state_dict().items()}
        try:
            self.inner.step(step, replica, batch)
        finally:
            self._armed = False

    def _keep(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._armed and self.call is None:
            self.call = _copied((args, kwargs))
        return None


def _whole(t: Any) -> Any:
    """A tensor of the state, whole (a DTensor gathered from every rank: a collective)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _copied(obj: Any, fn: Any = None, depth: int = 0) -> Any:
    """``obj`` made afresh, every tensor in it detached and cloned (or ``fn`` of it): in its
    containers and in the attributes of the objects it holds, such as a transformers
    ``DynamicCache`` that each call of an attention block appends to. A call's inputs are kept
    so, and given so at every call of the search: no call sees what an earlier one appended."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj) if fn is not None else obj.detach().clone()
    if depth > COPY_DEPTH:
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, _copied(v, fn, depth + 1)) for k, v in obj.items())
    if isinstance(obj, (tuple, list)):
        items = [_copied(v, fn, depth + 1) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if hasattr(obj, "__dict__") and not callable(obj) and not isinstance(obj, (type, torch.nn.Module)):
        fresh = copy.copy(obj)
        fresh.__dict__.update({k: _copied(v, fn, depth + 1) for k, v in vars(obj).items()})
        return fresh
    return obj


def _float64(obj: Any) -> Any:
    return _copied(obj, lambda t: t.detach().double() if t.is_floating_point() else t.detach().clone())


def _out(module: Any, call: tuple[Any, Any]) -> list[Any]:
    args, kwargs = _copied(call)
    return [t.detach() for t in floats(module(*args, **kwargs))]


def _error(module: Any, call: tuple[Any, Any], backend: str) -> tuple[float, float]:
    """The compiled block's error and its tolerance (see the module docstring)."""
    import torch

    eager = _out(module, call)
    try:
        exact = _out(copy.deepcopy(module).double(), _float64(call))
    except Exception:  # a block that cannot run in float64: eager is the yardstick
        exact = eager
    torch._dynamo.reset()
    got = _out(torch.compile(module, backend=backend), call)
    torch._dynamo.reset()
    pairs = [(g, e, x) for g, e, x in zip(got, eager, exact) if g.shape == e.shape == x.shape]
    if len(got) != len(eager) or not pairs:
        return float("inf"), 0.0
    error = max(rel(g, x) for g, _, x in pairs)
    noise = max(rel(e, x) for _, e, x in pairs)
    eps = torch.finfo(pairs[0][1].dtype).eps if pairs[0][1].is_floating_point() else 1.2e-7
    return error, max(NOISE_FACTOR * noise, FLOOR_EPS * eps)


def _children_calls(module: Any, call: tuple[Any, Any]) -> list[tuple[str, Any, tuple[Any, Any]]]:
    """The blocks directly below ``module`` that its eager forward called (a child, or, for a
    container never called itself such as a ``ModuleList``, its children), each at its first
    call, in call order: (name within ``module``, block, inputs)."""
    calls: list[tuple[str, Any, tuple[Any, Any]]] = []
    handles = []
    import torch

    for name, child in module.named_modules():
        if not name or isinstance(child, torch.jit.ScriptModule):  # (which takes no hooks)
            continue

        def keep(m: Any, args: Any, kwargs: Any, _name: str = name) -> None:
            if all(n != _name for n, _, _ in calls):
                calls.append((_name, m, _copied((args, kwargs))))
            return None

        handles.append(child.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        _out(module, call)
    finally:
        for h in handles:
            h.remove()
    called = {n for n, _, _ in calls}
    return [(n, m, c) for n, m, c in calls
            if not any(n.startswith(other + ".") for other in called)]


def _breaks(module: Any, call: tuple[Any, Any]) -> list[str]:
    import torch

    try:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(module)(*call[0], **call[1])
        return [str(getattr(r, "reason", r)).splitlines()[0] for r in explained.break_reasons]
    except Exception:
        return []
    finally:
        torch._dynamo.reset()


def first_differing_block(module: Any, name: str, call: tuple[Any, Any], backend: str,
                          depth: int = 0) -> ModuleFinding | None:
    """The first block, ``module`` or within it, whose compiled output differs from its eager
    output on the same input (None: ``module``'s does not)."""
    error, tol = _error(module, call, backend)
    if not error > tol:
        return None
    children = _children_calls(module, call) if depth < DEPTH else []
    for child_name, child, child_call in children:
        found = first_differing_block(child, f"{name}.{child_name}" if name else child_name, child_call, backend,
                                      depth + 1)
        if found is not None:
            return found
    breaks = _breaks(module, call)
    said = [f"{len(breaks)} graph break(s) in it: " + "; ".join(breaks[:3]) if breaks else "no graph break in it"]
    if children:
        said.append("none of its children differs compiled alone: the difference is in its own forward")
    return ModuleFinding(step=0, rank=0, phase="compiled", module=name, type=type_name(module), differs="output",
                         error=error, tolerance=tol, note="; ".join(said))


@names_run("compiled block by block against eager (one device)")
def compiled_blocks_task(ctx: RankContext, case: Case, spool: str, spec: CompileSpec) -> ModuleFinding | None:
    """The first block whose compiled output (``spec``'s backend) differs from eager's on the
    inputs the model's first call of step 0 got (None: the whole model's forward agrees)."""
    return _searched(ctx, case, spool, _CallAt(SingleMode(1, watch_draws=False), 0), spec)


@names_run("compiled block by block against eager (each rank)", sized=True)
def compiled_replica_blocks_task(ctx: RankContext, case: Case, spool: str, mode: str, shard_size: int,
                                 spec: CompileSpec, step: int) -> ModuleFinding | None:
    """This rank's first block whose compiled output (``spec``'s backend) differs from eager's
    on the inputs this rank's first model call of step ``step`` got in ``mode`` (eager, from
    the initial state), with the model's state then (None: the whole forward agrees)."""
    return _searched(ctx, case, spool, _CallAt(replica_mode(ctx, case, mode, shard_size, step + 1), step), spec)


def _searched(ctx: RankContext, case: Case, spool: str, keeps: _CallAt, spec: CompileSpec) -> ModuleFinding | None:
    """Train as ``keeps`` says, then search a plain copy of the model, in the state it kept,
    on the call it kept."""
    import dataclasses

    import torch

    train(case, spool, ctx.device, keeps)  # type: ignore[arg-type]
    released()
    if keeps.call is None or keeps.state is None:
        return None
    model = prepared(case, spool, ctx.device)
    model.load_state_dict(keeps.state)
    computed = getattr(keeps.inner, "computed_dtype", None)  # FSDP2 under a MixedPrecisionPolicy: its param_dtype
    if computed is not None:
        model.to(getattr(torch, computed))  # as the run computed (the kept inputs are cast to it too)
    found = first_differing_block(model, "", keeps.call, spec.backend)
    return dataclasses.replace(found, step=keeps.target, rank=ctx.rank) if found is not None else None


__all__ = ["compiled_blocks_task", "compiled_replica_blocks_task", "first_differing_block"]
