"""``torch.nn.DataParallel``'s semantics, emulated on one device (mode ``dp``, simulated).

Reproduces what DataParallel does with a forward pass, step for step, from its source
(``torch/nn/parallel/data_parallel.py``, ``scatter_gather.py``, ``replicate.py``):

* scatter: tensors are cut along dim 0 with ``Tensor.chunk(n)`` (the C++ ``_scatter``
  without chunk sizes), so chunks are ``ceil(B / n)`` long with a shorter last one, and a
  batch of fewer than ``n`` samples uses fewer replicas; tuples, lists, dicts and
  namedtuples are scattered element-wise; anything else is handed to every replica as is;
* with one device, DataParallel calls the module itself (no replicas);
* replicas are ``Module._replicate_for_data_parallel()`` copies whose parameters are the
  original ones (DataParallel broadcasts them and its backward sums the replicas'
  gradients into the originals: the same sum), but for embeddings with ``max_norm`` on
  replicas after the first, whose in-place renormalisation of a broadcast copy is lost; replica 0's buffers are the module's own
  (``broadcast_coalesced`` returns the source tensors for the source device), the other
  replicas get copies, so BatchNorm running statistics survive from replica 0 only;
  attributes a replica writes to ``self`` in forward are lost;
* gather: outputs are concatenated along dim 0 (tensors; tuples, lists, dicts and
  namedtuples element-wise); all-scalar outputs become a vector, as DataParallel does
  with a warning.

Not emulated: replicas run one after another on one device, sharing one RNG stream
(real DataParallel has one per GPU), so models that draw random numbers in forward
differ from real DP by construction.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(obj: Any, n: int) -> list[Any]:
    """DataParallel's scatter of ``obj`` over ``n`` devices (fewer if the batch is short)."""
    import torch

    def scatter_map(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return list(o.chunk(n, dim=0))
        if _is_namedtuple(o):
            return [type(o)(*args) for args in zip(*map(scatter_map, o))]
        if isinstance(o, tuple) and len(o) > 0:
            return list(zip(*map(scatter_map, o)))
        if isinstance(o, list) and len(o) > 0:
            return [list(i) for i in zip(*map(scatter_map, o))]
        if isinstance(o, dict) and len(o) > 0:
            return [type(o)(i) for i in zip(*map(scatter_map, o.items()))]
        return [o for _ in range(n)]

    return scatter_map(obj)


def scatter_kwargs(inputs: tuple, kwargs: dict, n: int) -> tuple[list[tuple], list[dict]]:
    """DataParallel's ``scatter_kwargs``: the shorter list padded with empty ones."""
    scattered = scatter(inputs, n) if inputs else []
    kw = scatter(kwargs, n) if kwargs else []
    if len(scattered) < len(kw):
        scattered.extend(() for _ in range(len(kw) - len(scattered)))
    elif len(kw) < len(scattered):
        kw.extend({} for _ in range(len(scattered) - len(kw)))
    return [tuple(s) for s in scattered], [dict(k) for k in kw]


def gather(outputs: list[Any]) -> Any:
    """DataParallel's gather of the replicas' outputs along dim 0."""
    import torch

    def gather_map(outs: Sequence[Any]) -> Any:
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if all(t.dim() == 0 for t in outs):
                return torch.stack(list(outs))  # DataParallel: "will instead unsqueeze"
            return torch.cat(list(outs), dim=0)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outs):
                raise ValueError("All dicts must have the same number of keys")
            gathered = {k: gather_map([d[k] for d in outs]) for k in out}
            rebuilt = type(out)((k, v) for k, v in gathered.items())  # torch's own call: a generator of pairs
            _refuse_unrebuilt(out, gathered, rebuilt)
            return rebuilt
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs)))
        return type(out)(map(gather_map, zip(*outs)))

    return gather_map(outputs)


def _refuse_unrebuilt(out: Any, gathered: dict[Any, Any], rebuilt: Any) -> None:
    """A dict-like output whose class does not take the (key, value) pairs DataParallel's
    gather rebuilds it from (diffusers' ``BaseOutput``: they become its first field) would
    reach the step broken under real DataParallel too: a :class:`CaseError` that says so,
    not the user's step failing on a generator."""
    from ddparity.errors import CaseError

    try:
        wrong = [(k, rebuilt.get(k)) for k, v in gathered.items() if rebuilt.get(k) is not v]
        wrong += [(k, rebuilt[k]) for k in rebuilt if k not in gathered]
    except Exception as exc:
        wrong = [("its fields", exc)]
    if not wrong:
        return
    name, (key, held) = type(out).__name__, wrong[0]
    raise CaseError(
        f"DataParallel's gather rebuilds the model's output, a {name}, as {name}((key, value) pairs) "
        f"(torch/nn/parallel/scatter_gather.py), which {name} does not take as its fields: under nn.DataParallel "
        f"its {key!r} would be {type(held).__name__}, not the gathered value, and the step would fail there as "
        f"well; return a tensor, a tuple or a plain dict from forward "
        f"under DataParallel (return_dict=False for diffusers' and transformers' models), or check this case in "
        f"modes single, ddp and fsdp (--modes single,ddp)")


def replicate(module: Any, n: int) -> list[Any]:
    """``n`` replicas sharing ``module``'s parameters; replica 0 shares its buffers too. The
    other replicas' embeddings with ``max_norm`` get copies of their weights (gradients
    flow back to the originals, as through DataParallel's broadcast): their forward
    renormalises the rows it looks up in place, and on the devices after the first
    DataParallel's broadcast copies take that change and are dropped."""
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    replicas: list[Any] = []
    for r in range(n):
        copies = [m._replicate_for_data_parallel() for m in modules]
        for m, copy in zip(modules, copies):
            for name, child in m._modules.items():
                copy._modules[name] = None if child is None else copies[index[id(child)]]
            renormalises = r > 0 and getattr(m, "max_norm", None) is not None
            for name, param in m._parameters.items():
                copy._parameters[name] = param.clone() if renormalises and param is not None else param
            for name, buf in m._buffers.items():
                copy._buffers[name] = buf if r == 0 or buf is None else buf.detach().clone()
        replicas.append(copies[0])
    return replicas


def forward(module: Any, n: int, inputs: tuple, kwargs: dict | None = None) -> tuple[Any, DataParallelNotes]:
    """One DataParallel forward of ``module`` over ``n`` emulated devices."""
    kwargs = kwargs or {}
    notes = DataParallelNotes()
    notes.inspect_inputs(inputs, kwargs, n)
    if not inputs and not kwargs:
        inputs = ((),)  # type: ignore[assignment]
    if n == 1:
        return module(*inputs, **kwargs), notes
    refuse_unscatterable(inputs, kwargs, n)
    scattered, scattered_kw = scatter_kwargs(inputs, kwargs, n)
    replicas = replicate(module, len(scattered))
    before = [_plain_state(r) for r in replicas]
    params = list(module.named_parameters())
    outputs = []
    for r, (rep, args, kw) in enumerate(zip(replicas, scattered, scattered_kw)):
        versions = [p._version for _, p in params]
        outputs.append(rep(*args, **kw))
        notes.inspect_outputs(args, kw, outputs[-1])
        if r:
            notes.inspect_params([name for (name, p), v in zip(params, versions) if p._version != v])
    for rep, state in zip(replicas, before):
        notes.inspect_state(state, _plain_state(rep))
    notes.inspect_module(module)
    return gather(outputs), notes


def emulated(module: Any, n: int, notes: dict[str, str]) -> Any:
    """``module`` wrapped as DataParallel over ``n`` emulated devices: a module whose
    forward is :func:`forward` (``.module`` is the model, as on DataParallel); the
    pitfalls met are added to ``notes``."""
    import torch

    class EmulatedDataParallel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            outputs, found = forward(self.module, n, inputs, kwargs)
            notes.update(found.items)
            return outputs

    return EmulatedDataParallel()


def _plain_state(module: Any) -> dict[str, Any]:
    """Every submodule's non-tensor-registry attributes, by qualified name (what a
    forward can write to ``self`` and lose in a replica)."""
    skip = {"_parameters", "_buffers", "_modules", "_is_replica", "training"}
    out = {}
    for prefix, m in module.named_modules():
        for key, value in vars(m).items():
            if key not in skip and not key.startswith("_"):
                out[f"{prefix}.{key}" if prefix else key] = id(value), value if isinstance(value, (int, float, str, bool)) else None
    return out


def _leaves(inputs: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Every leaf DataParallel's scatter reaches in a forward's arguments, by path
    (``inputs[0]``, ``kwargs['labels']``): tensors, and the objects it hands on whole."""

    def walk(o: Any, path: str) -> list[tuple[str, Any]]:
        if isinstance(o, (tuple, list)):
            return [leaf for i, v in enumerate(o) for leaf in walk(v, f"{path}[{i}]")]
        if isinstance(o, dict):
            return [leaf for k, v in o.items() for leaf in walk(v, f"{path}[{k!r}]")]
        return [(path, o)]

    return walk(tuple(inputs), "inputs") + walk(dict(kwargs), "kwargs")


def refuse_unscatterable(inputs: tuple, kwargs: dict, n: int) -> None:
    """Raise where DataParallel cannot scatter the arguments over ``n`` devices: a 0-d
    tensor, which its scatter cannot cut along dim 0 (real DataParallel raises
    "chunk expects at least a 1-dimensional tensor" from ``comm.scatter`` there), said with
    the argument's name and the fix."""
    import torch

    from ddparity.errors import CaseError

    scalars = [path for path, o in _leaves(inputs, kwargs) if isinstance(o, torch.Tensor) and o.dim() == 0]
    if scalars:
        raise CaseError(
            f"{', '.join(scalars[:3])} {'is a 0-d tensor' if len(scalars) == 1 else 'are 0-d tensors'}: "
            f"DataParallel scatters every tensor it is given along dim 0 over its {n} replicas and cannot cut a "
            "0-d one (real DataParallel raises 'chunk expects at least a 1-dimensional tensor' here); pass a "
            f"Python number, or one value per replica (t.expand({n}), as transformers' Trainer does under "
            "DataParallel)")


class DataParallelNotes:
    """Pitfalls of a model under DataParallel, each with an explanation."""

    def __init__(self) -> None:
        self.items: dict[str, str] = {}

    def inspect_inputs(self, inputs: tuple, kwargs: dict, n: int) -> None:
        import torch

        leaves = _leaves(inputs, kwargs)
        found = [f"{path} ({type(o).__name__})" for path, o in leaves  # a flag (a str, a bool) is never per sample
                 if not isinstance(o, (torch.Tensor, str, bytes, bool, enum.Enum)) and o is not None]
        if found:
            self.items["non-tensor inputs"] = (
                f"{', '.join(found[:3])} are not scattered: DataParallel hands every replica the same "
                "object, so a per-sample list or a batch-sized number is not split with the batch")
        cut = {path: (len(o), len(o.chunk(n, dim=0))) for path, o in leaves if isinstance(o, torch.Tensor) and o.dim()}
        if n > 1 and len({chunks for _, chunks in cut.values()}) > 1:
            short, full = min(cut, key=lambda p: cut[p][1]), max(cut, key=lambda p: cut[p][1])
            self.items["arguments cut short"] = (
                f"{short} has {cut[short][0]} row(s) along dim 0 where {full} has {cut[full][0]}: DataParallel cuts "
                f"each tensor into at most {n} chunks and zips them, so {short} makes {cut[short][1]} chunk(s) where "
                f"{full} makes {cut[full][1]}, and the chunks past the {cut[short][1]}th are dropped or reach a replica "
                f"without {short}")

    def inspect_outputs(self, inputs: tuple, kwargs: dict, outputs: Any) -> None:
        """One replica's outputs against its share: a tensor whose rows are not one per sample
        (a concatenation along dim 0 inside forward) is gathered replica after replica."""
        import torch

        rows = next((len(o) for _, o in _leaves(inputs, kwargs) if isinstance(o, torch.Tensor) and o.dim()), None)
        odd = [(path.replace("inputs[0]", "output", 1), len(o)) for path, o in _leaves((outputs,), {})
               if isinstance(o, torch.Tensor) and o.dim() and len(o) != rows]
        if rows is not None and odd and "outputs not one row per sample" not in self.items:
            path, count = odd[0]
            self.items["outputs not one row per sample"] = (
                f"forward's {path} has {count} row(s) along dim 0 for a replica's {rows} sample(s): DataParallel "
                f"gathers the replicas' outputs along dim 0 one replica after another, so rows that are not one per "
                f"sample (a concatenation along dim 0 inside forward, such as [real; fake]) come back in another "
                f"order than on one device ([real_0; fake_0; real_1; fake_1]) and no longer line up with the whole "
                f"batch's targets (rows flattened sample-major, (B*T, V) logits, keep the order); return one row per sample "
                f"(concatenate along another dim, or outside forward)")

    def inspect_state(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        changed = sorted(k for k in after if k not in before or after[k] != before[k])
        if changed:
            self.items["state on self"] = (
                f"forward writes {', '.join('self.' + k for k in changed[:3])}: under DataParallel it is "
                "written to a replica and lost after the step; keep it in a buffer or return it")

    def inspect_params(self, changed: list[str]) -> None:
        """``changed``: the parameters a replica after the first changed in place in its forward."""
        if changed:
            self.items["parameters changed in forward"] = (
                f"forward changes {', '.join(changed[:3])} in place on replicas after the first: under DataParallel "
                f"those changes land on their devices' broadcast copies and are lost after the forward (only the "
                f"first device's stays); this emulation made them on the parameters themselves, so where the change "
                f"depends on the batch a real DataParallel run differs from it; make the change from the whole batch, "
                f"or in the optimizer step")

    def inspect_module(self, module: Any) -> None:
        from torch import nn

        norms = [name for name, m in module.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
        if norms:
            self.items["per-replica BatchNorm"] = (
                f"BatchNorm ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) normalises each replica's "
                f"chunk with its own statistics, and only "
                "replica 0's running statistics are kept: use SyncBatchNorm under DDP, or eval-mode BatchNorm")
