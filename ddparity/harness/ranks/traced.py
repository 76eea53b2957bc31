"""ddparity's stand-ins for torch functions (the aligned dropouts, the per-sample draws of
:mod:`ddparity.harness.ranks.randomness`) inside a model the step compiles itself
(``torch.compile(model)`` in ``train_step``, or returned by ``Case.model``).

Dynamo must run them eagerly, with a graph break, never trace them: each reads the rank's
draw scope and makes its masks from real tensors. Two things stood in the way. Dynamo
builds its table of torch's own functions from their names (``torch.nn.functional.dropout``
and the like), lazily, and again after every ``torch._dynamo.reset()``: built while the
stand-ins were installed, it listed them as torch's own, put them in the graph, and ran
them on fake tensors, which failed (an error that was ddparity's, shown as the user's).
So the stand-ins are wrapped in ``torch.compiler.disable`` (:func:`eager`), and the table
is built without them (:func:`hide`) for as long as they are installed. Where a graph
traces one all the same (inside a torch function Dynamo keeps whole), torch's own runs in
its place and the step is an error that says so (:func:`take_traced`), never a comparison
of masks no mode drew alike.
"""

from __future__ import annotations

import functools
from typing import Any

_hidden: set[int] = set()
_builder: Any = None
"""Dynamo's own table builder, while :func:`hide` stands in for it."""


_traced: set[str] = set()
"""The stand-ins a compiled graph traced (see :func:`eager`), until :func:`take_traced`."""


def eager(stand_in: Any, original: Any, label: str) -> Any:
    """``stand_in`` run eagerly inside compiled code (a graph break there). Where Dynamo
    traces it all the same — inside a function it keeps whole in the graph, such as
    ``F.multi_head_attention_forward``, which calls ``F.dropout`` on fake tensors — torch's
    ``original`` stands in (the graph then draws its own masks) and ``label`` is noted for
    :func:`take_traced`."""
    import torch

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _fake(args):
            _traced.add(label)
            return original(*args, **kwargs)
        return stand_in(*args, **kwargs)

    wrapped = torch.compiler.disable(guarded)
    _hidden.add(id(wrapped))
    return wrapped


def _fake(args: tuple) -> bool:
    """Whether ``args`` are being traced (fake or functional tensors, as Dynamo and AOT
    autograd trace with)."""
    import torch

    try:
        from torch._guards import detect_fake_mode

        return detect_fake_mode([a for a in args if isinstance(a, torch.Tensor)]) is not None
    except ImportError:  # (torch versions without it: every call is eager)
        return False


def take_traced() -> list[str]:
    """The stand-ins a compiled graph traced since the last call (and forget them)."""
    traced = sorted(_traced)
    _traced.clear()
    return traced


def hide() -> None:
    """Keep every :func:`eager` stand-in out of Dynamo's table of torch functions from now
    until :func:`show` (torch versions without that table are left as they are)."""
    global _builder
    try:
        import torch._dynamo.trace_rules as rules

        table = rules.get_torch_obj_rule_map
        original = table.__wrapped__
    except (ImportError, AttributeError):
        return
    if _builder is not None:
        return

    @functools.cache
    def without_stand_ins() -> Any:
        return {obj: rule for obj, rule in original().items() if id(obj) not in _hidden}

    table.cache_clear()  # built while the stand-ins were installed, it may list them
    _builder = table
    rules.get_torch_obj_rule_map = without_stand_ins


def show() -> None:
    """Dynamo's table builder back, as it was, and the stand-ins forgotten."""
    global _builder
    if _builder is not None:
        import torch._dynamo.trace_rules as rules

        _builder.cache_clear()
        rules.get_torch_obj_rule_map, _builder = _builder, None
    _hidden.clear()
