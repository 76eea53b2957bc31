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
        self.moved = False
        self._mode: Any = _NamingMode(self.found) if name else contextlib.nullcontext()

    def __enter__(self) -> RandomDraws:
        self._before = _generator_states()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self.moved = any(not a.equal(b) for a, b in zip(self._before, _generator_states()))

    def raise_if_any(self, step: int, model: Any = None) -> None:
        if not self.moved:
            return
        ops = ", ".join(f"aten.{name}" + (f" x{n}" if n > 1 else "") for name, n in sorted(self.found.items()))
        layers = unaligned_layers(model) if model is not None else []
        where = f" in {', '.join(layers)}" if layers else ""
        raise CaseError(
            f"the training step draws random numbers from torch's generator at step {step} ({ops or 'an op'}){where}, "
            f"outside the dropouts ddparity aligns: every mode and rank would draw other numbers for the same "
            f"sample, so no comparison could be trusted; use torch.nn.functional's dropouts (aligned per sample), "
            f"draw from a torch.Generator you seed per sample, or switch the draw off for the check"
            + (" (for these layers: dropout=0 for an RNN's inter-layer dropout, nn.LeakyReLU for RReLU, "
               "_random_samples or a plain pool for a FractionalMaxPool)" if layers else "")
        )


def unaligned_layers(model: Any) -> list[str]:
    """The layers of ``model`` that draw random numbers inside torch's own kernels, where
    ddparity cannot give every mode the same draw per sample: an RNN's inter-layer dropout
    (in the fused RNN kernel), RReLU's slopes, FractionalMaxPool's regions. Named in the
    error a draw raises, so that it says which class and why."""
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
        elif isinstance(m, (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)) and m._random_samples is None:
            why = "its pooling regions are drawn at random per sample"
        else:
            continue
        found.append(f"{name or 'the model'} (nn.{type(m).__name__}: {why})")
    return found


def _naming_mode_class() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class NamingMode(TorchDispatchMode):
        def __init__(self, found: dict[str, int]) -> None:
            super().__init__()
            self.found = found

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if _may_draw(func, args, kwargs):
                name = func.overloadpacket.__name__
                self.found[name] = self.found.get(name, 0) + 1
            return func(*args, **kwargs)

    return NamingMode


def _NamingMode(found: dict[str, int]) -> Any:  # noqa: N802 - reads as the class it makes
    return _naming_mode_class()(found)


def _may_draw(func: Any, args: tuple, kwargs: dict) -> bool:
    import torch

    if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
        return False
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args)) | kwargs
    if "dropout_p" in values:
        return bool(values["dropout_p"])
    if "train" in values and "p" in values:  # native_dropout
        return bool(values["train"]) and bool(values["p"])
    return True


def _generator_states() -> list[Any]:
    import torch

    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states
