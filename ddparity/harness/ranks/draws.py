"""Random draws outside the dropouts ddparity aligns: found (the generators' state moved),
named op by op when asked, and blamed on the layers that draw inside torch's kernels. Any
such draw makes every mode and rank draw other numbers for the same sample, so the run is
an error that says where, never a pass."""

from __future__ import annotations

import contextlib
from typing import Any

from ddparity.errors import CaseError
from ddparity.harness.ranks.stacked_rnn import FUSED_DRAW, STACKED


class RandomDraws:
    """The draws from torch's own generators while active: a draw is one when the
    generators' state moved. With ``name`` the ops that may draw are named too, by a
    dispatch mode (~2 ms a step on a small model, so only to explain a draw already found):
    those tagged ``nondeterministic_seeded`` and given no generator of their own, an
    attention kernel only with a dropout probability. Aligned dropout draws from
    generators of its own."""

    def __init__(self, name: bool = False) -> None:
        self.found: dict[str, int] = {}
        self.callers: dict[str, list[Any]] = {}
        """Per op named: the innermost modules whose forward drew it, in order (None: outside any)."""
        self.moved = False
        self.host: list[str] = []
        """The host generators the step drew from (Python's ``random``, numpy's global one)."""
        self._calls = ModuleCalls() if name else None
        self._mode: Any = (_NamingMode(self.found, self.callers, self._calls) if self._calls is not None
                           else contextlib.nullcontext())

    def __enter__(self) -> RandomDraws:
        self._before = _generator_states()
        self._graphs = _graphs_compiled()
        self._host = _host_states()
        if self._calls is not None:
            self._calls.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        if self._calls is not None:
            self._calls.__exit__(*exc)
        self.moved = any(not a.equal(b) for a, b in zip(self._before, _generator_states()))
        after = _host_states()
        self.host = [name for name, state in self._host.items() if after.get(name) != state]

    def raise_if_any(self, step: int, model: Any = None) -> None:
        if self.host and not self.moved:
            raise CaseError(f"the training step draws random numbers from {' and '.join(self.host)} at step {step}: "
                            f"every process draws other numbers there (its own state), so no comparison could be "
                            f"trusted; draw with torch (torch.rand, torch.randint, torch.randn_like: drawn per sample, "
                            f"the same in every mode), from a generator you seed per sample, or switch the draw off for "
                            f"the check (transformers' SpecAugment in wav2vec2, HuBERT: mask_time_prob=0, "
                            f"mask_feature_prob=0)")
        if not self.moved:
            return
        names = {id(m): n for n, m in model.named_modules()} if model is not None else {}

        layers = unaligned_layers(model) if model is not None else []

        def caller(op: str) -> str:
            found = [m for m in self.callers.get(op, []) if m is not None and id(m) in names]
            if not found or layers:  # the layers' own line says where, and why
                return ""
            kinds = ", ".join(dict.fromkeys(type(m).__name__ for m in found))
            if any(not names[id(m)] for m in found):
                return f" in the model ({kinds})"
            shown = ", ".join(names[id(m)] for m in found[:3]) + (" ..." if len(found) > 3 else "")
            return f" in module{'s' if len(found) > 1 else ''} {shown} ({kinds})"

        ops = ", ".join(f"aten.{name}" + (f" x{n}" if n > 1 else "") + caller(name)
                        for name, n in sorted(self.found.items()))
        where = f" in {', '.join(layers)}" if layers else ""
        host = f" (and from {' and '.join(self.host)})" if self.host else ""
        if not ops and _graphs_compiled() > self._graphs:  # a graph compiled in this step drew them
            raise CaseError(
                f"the training step draws random numbers from torch's generator{host} at step {step} inside a graph it "
                f"compiled (torch.compile of the model in train_step or from Case.model), whose dropout is compiled "
                f"into the graph, out of ddparity's reach: every mode and rank would draw other masks for the same "
                f"sample, so no comparison could be trusted; check the model eager (no torch.compile: "
                f"ddparity.check(case, compile=...) compares compiled runs of models without dropout), or with its "
                f"dropout off for the check")
        raise CaseError(
            f"the training step draws random numbers from torch's generator{host} at step {step} "
            f"({ops or 'an op'}){where}, "
            f"outside the dropouts ddparity aligns: every mode and rank would draw other numbers for the same "
            f"sample, so no comparison could be trusted; use torch.nn.functional's dropouts (aligned per sample), "
            f"draw from a torch.Generator you seed per sample, or switch the draw off for the check"
            + (" (for these layers: dropout=0 for an RNN's inter-layer dropout, nn.LeakyReLU for RReLU)"
               if layers else "")
            + ("; a draw with one part per sample is aligned like dropout (dim 0 the samples at hand: the forward's, "
               "or in the step outside the model the whole share or a micro-batch — a diffusion step's "
               "torch.randn_like(x) and torch.randint(0, T, (n,)), stochastic depth's (n, 1, ..., 1) draws: timm's "
               "DropPath, torchvision's stochastic_depth with mode='row'), but not a draw for the whole batch (one "
               "timestep for every sample, mode='batch'), nor one inside an activation-checkpointed region "
               "(drop_path_rate=0 for the check there)" if ALIGNED_OPS & set(self.found) else "")
        )


ALIGNED_OPS = {"randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "normal", "normal_", "uniform_",
               "bernoulli", "bernoulli_"}
"""The ops :mod:`ddparity.harness.ranks.sample_draws` aligns where a draw has one part per sample."""


def unaligned_layers(model: Any) -> list[str]:
    """The layers of ``model`` that draw random numbers inside torch's own kernels, where
    ddparity cannot give every mode the same draw per sample: an RNN's inter-layer dropout
    (in the fused RNN kernel), RReLU's slopes. (FractionalMaxPool draws its regions in
    Python, ``torch.rand((n, C, 2))``: aligned per sample.) Named in the error a draw
    raises, so that it says which class and why."""
    from torch import nn

    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, nn.RNNBase) and m.dropout and m.num_layers > 1 and not getattr(m, STACKED, False):
            why = f"its inter-layer dropout={m.dropout} runs inside torch's fused RNN kernel"
        elif isinstance(m, nn.RNNBase) and getattr(m, FUSED_DRAW, False):
            why = (f"its inter-layer dropout={m.dropout} runs inside torch's fused RNN kernel on a PackedSequence "
                   f"(ddparity aligns it, layer by layer, on tensors: batch-first, or time-major marked "
                   f"ddparity.batched(x, dim=1))")
        elif isinstance(m, nn.RReLU):
            why = "its negative slopes are drawn at random per element in training"
        else:
            continue
        found.append(f"{name or 'the model'} (nn.{type(m).__name__}: {why})")
    return found


def _naming_mode_class() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class NamingMode(TorchDispatchMode):
        def __init__(self, found: dict[str, int], callers: dict[str, list[Any]], calls: ModuleCalls) -> None:
            super().__init__()
            self.found, self.callers, self.calls = found, callers, calls

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if _may_draw(func, args, kwargs):
                name = func.overloadpacket.__name__
                self.found[name] = self.found.get(name, 0) + 1
                where, caller = self.callers.setdefault(name, []), self.calls.innermost()
                if not any(m is caller for m in where):
                    where.append(caller)
            return func(*args, **kwargs)

    return NamingMode


def _NamingMode(found: dict[str, int], callers: dict[str, list[Any]], calls: ModuleCalls) -> Any:  # noqa: N802
    return _naming_mode_class()(found, callers, calls)


class ModuleCalls:
    """The modules whose forward this thread is inside, innermost last, while active (global
    forward hooks: only in the naming pass, which explains a draw already found)."""

    def __init__(self) -> None:
        self.stack: list[Any] = []

    def innermost(self) -> Any:
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> ModuleCalls:
        import threading

        from torch.nn.modules import module

        thread = threading.get_ident()

        def enter(m: Any, args: Any) -> None:
            if threading.get_ident() == thread:
                self.stack.append(m)

        def leave(m: Any, args: Any, out: Any) -> None:
            if threading.get_ident() == thread and self.stack and self.stack[-1] is m:
                self.stack.pop()

        self._handles = [module.register_module_forward_pre_hook(enter),
                         module.register_module_forward_hook(leave, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()


def _may_draw(func: Any, args: tuple, kwargs: dict) -> bool:
    import torch

    if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
        return False
    schema = func._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    values = defaults | dict(zip([a.name for a in schema], args)) | kwargs  # a dropout_p left out is its default, 0
    if "dropout_p" in values:
        return bool(values["dropout_p"])
    if "train" in values and "p" in values:  # native_dropout
        return bool(values["train"]) and bool(values["p"])
    return True


def _host_states() -> dict[str, Any]:
    """Python's ``random`` state and, where numpy is imported, its global generator's."""
    import random
    import sys

    states: dict[str, Any] = {"Python's random module": random.getstate()}
    if "numpy" in sys.modules:
        kind, keys, *rest = sys.modules["numpy"].random.get_state()
        states["numpy's global generator (np.random)"] = (kind, keys.tobytes(), *rest)
    return states


def _generator_states() -> list[Any]:
    import torch

    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _graphs_compiled() -> int:
    """How many graphs Dynamo compiled in this process so far (a draw no op showed, in a step
    that compiled one, ran inside it)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0
