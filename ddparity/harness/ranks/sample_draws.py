"""Random draws with one part per sample, the same for the same sample in every mode and on
every rank, as aligned dropout's masks are (:mod:`ddparity.harness.ranks.randomness`): a
draw given no generator whose dim 0 is the samples at hand (inside the model's forward that
forward's, in the step around it the replica's whole share) is drawn sample by sample from
each sample's generator — a diffusion step's noise (``torch.randn_like(x)``) and timesteps
(``torch.randint(0, T, (n,))``), stochastic depth, a router's jitter. Each part has torch's
distribution. In the step, a micro-batch's draw is aligned too: one shaped like (or filling)
a slice of the share takes that slice's rows; a draw with no such template takes the next rows
of the share at its source line (the micro-batches of a loop, in order: diffusers'
``torch.randn(x.shape)`` then ``torch.randint(0, T, (n,))`` each micro-batch), and past the
share's end the rows the last slice named. Each sample's step draws are counted on their own,
so a sample drawn for in a micro-batch of 2 under DDP gets what it gets in a micro-batch of 4
on one device, and samples drawn for unequally in a step are an error. Any other draw (for the
whole batch, inside a ``batch_first=False`` module, checkpointing or backward) is left to
torch's generator, where it is found and named; micro-batches taken out of order with draws
that have no template would pair other samples' numbers (a divergence, never a pass).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ddparity.harness.ranks import traced

STEP_PLACES = 1 << 40
"""Where the step's own draws (outside the model's forward) are numbered from."""
_PLAIN = {"dtype", "device", "requires_grad", "layout", "pin_memory"}
"""Keyword arguments an aligned draw may be given (no ``out=``, no ``generator=``)."""

Place = Callable[[int, Any, Any], "tuple[Any, Any, int | list[int]] | None"]
"""(samples along dim 0, the tensor the draw is shaped like or fills, or None, the source line
that drew) -> (scope, the samples' global indices, the draw's place: one, or each sample's),
or None."""
Part = Callable[[tuple, Any, tuple], Any]
"""(one sample's shape, its generator, the draw's parameters) -> that sample's part."""


def _site(original: Any) -> tuple[str, int, str]:
    """The source line that called the draw (the caller of the replacement that calls this),
    and the draw's name."""
    frame = sys._getframe(2)
    while frame.f_back is not None and _wrapping(frame.f_code.co_filename):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, getattr(original, "__name__", "a draw")


def _wrapping(file: str) -> bool:
    """Whether ``file`` holds a frame between the user's call and the replacement: the eager
    guard of :mod:`ddparity.harness.ranks.traced` and torch.compiler.disable's wrapper."""
    return file == traced.__file__ or f"{os.sep}torch{os.sep}_dynamo{os.sep}" in file


def _per_sample(place_of: Place, shape: tuple, one: Part, params: tuple = (), template: Any = None,
                site: Any = None) -> Any:
    """The draw of ``shape`` sample by sample, or None where it is not aligned."""
    import torch

    found = place_of(shape[0], template, site) if shape and all(isinstance(s, int) for s in shape) else None
    if found is None:
        return None
    scope, rows, place = found
    return torch.stack([one(tuple(shape[1:]), gen, params) for gen in scope.generators(place, rows)])


def _plain(kwargs: dict[str, Any]) -> bool:
    import torch

    return set(kwargs) <= _PLAIN and kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory")


def _done(values: Any, kwargs: dict[str, Any], dtype: Any, device: Any = None) -> Any:
    values = values.to(device=kwargs.get("device") or device, dtype=kwargs.get("dtype") or dtype)
    return values.requires_grad_(True) if kwargs.get("requires_grad") else values


def _factory(place_of: Place, original: Any, one: Part, integer: bool = False) -> Any:
    """``torch.randn``/``rand``/``randint`` (``randint(high, size)``, ``randint(low, high, size)``)."""

    def aligned(*args: Any, generator: Any = None, **kwargs: Any) -> Any:
        import torch

        if integer:  # randint(high, size) or randint(low, high, size)
            params, size = ((0, args[0]), args[1]) if len(args) == 2 else (args[:2], args[2] if len(args) == 3 else None)
        else:
            params, size = (), args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        values = None
        if generator is None and _plain(kwargs) and size is not None and all(isinstance(p, int) for p in params):
            values = _per_sample(place_of, tuple(size), one, params, site=_site(original))
        if values is None:
            return original(*args, generator=generator, **kwargs)
        return _done(values, kwargs, torch.int64 if integer else torch.get_default_dtype())

    return aligned


def _like(place_of: Place, original: Any, one: Part, integer: bool = False) -> Any:
    """``torch.randn_like``/``rand_like``/``randint_like``: the template's shape, dtype, device."""

    def aligned(input: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        params = ((0, args[0]) if len(args) == 1 else tuple(args)) if integer else tuple(args)
        values = None
        if (isinstance(input, torch.Tensor) and _plain(kwargs) and len(params) == (2 if integer else 0)
                and all(isinstance(p, int) for p in params)):
            values = _per_sample(place_of, tuple(input.shape), one, params, input, _site(original))
        if values is None:
            return original(input, *args, **kwargs)
        return _done(values, kwargs, input.dtype, input.device)

    return aligned


def _in_place(place_of: Place, original: Any, one: Part, defaults: tuple) -> Any:
    """``Tensor.normal_``/``uniform_``/``bernoulli_`` (a number as probability), copied in."""

    def aligned(self: Any, *args: Any, generator: Any = None, **kwargs: Any) -> Any:
        import torch

        params = tuple(args) + defaults[len(args):]
        values = None
        if (generator is None and not kwargs and len(args) <= len(defaults) and not isinstance(self, torch.nn.Parameter)
                and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in params)):  # (init: torch's)
            values = _per_sample(place_of, tuple(self.shape), one, params, self, _site(original))
        if values is None:
            return original(self, *args, generator=generator, **kwargs)
        with torch.no_grad():
            return self.copy_(values)

    return aligned


def _bernoulli(place_of: Place, original: Any) -> Any:
    """``torch.bernoulli(probabilities)``: each sample's row of probabilities, its generator."""

    def aligned(input: Any, *args: Any, generator: Any = None, **kwargs: Any) -> Any:
        import torch

        values = None
        if generator is None and not args and not kwargs and isinstance(input, torch.Tensor) \
                and input.is_floating_point() and input.dim():
            rows = iter(input.detach().to("cpu", torch.float32))
            values = _per_sample(place_of, tuple(input.shape), lambda _, g, __: torch.bernoulli(next(rows), generator=g),
                                 template=input, site=_site(original))
        if values is None:
            return original(input, *args, generator=generator, **kwargs)
        return values.to(device=input.device, dtype=input.dtype)

    return aligned


def replacements(place_of: Place) -> dict[tuple[Any, str], Callable[[Any], Any]]:
    """The draws aligned, as (owner, name) -> a replacement made from the original, each
    asking ``place_of`` where a draw is aligned."""
    import torch

    def randn(part: tuple, g: Any, _: tuple) -> Any:
        return torch.randn(part, generator=g)

    def rand(part: tuple, g: Any, _: tuple) -> Any:
        return torch.rand(part, generator=g)

    def integers(part: tuple, g: Any, bounds: tuple) -> Any:
        return torch.randint(bounds[0], bounds[1], part, generator=g)

    def in_place(name: str) -> Part:
        return lambda part, g, params: getattr(torch.empty(part), name)(*params, generator=g)

    return {
        (torch, "randn"): lambda o: _factory(place_of, o, randn),
        (torch, "rand"): lambda o: _factory(place_of, o, rand),
        (torch, "randint"): lambda o: _factory(place_of, o, integers, integer=True),
        (torch, "randn_like"): lambda o: _like(place_of, o, randn),
        (torch, "rand_like"): lambda o: _like(place_of, o, rand),
        (torch, "randint_like"): lambda o: _like(place_of, o, integers, integer=True),
        (torch, "bernoulli"): lambda o: _bernoulli(place_of, o),
        (torch.Tensor, "normal_"): lambda o: _in_place(place_of, o, in_place("normal_"), (0.0, 1.0)),
        (torch.Tensor, "uniform_"): lambda o: _in_place(place_of, o, in_place("uniform_"), (0.0, 1.0)),
        (torch.Tensor, "bernoulli_"): lambda o: _in_place(place_of, o, in_place("bernoulli_"), (0.5,)),
    }
