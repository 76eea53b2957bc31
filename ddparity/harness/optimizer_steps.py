"""One ``optimizer.step()`` as the user called it, however many hooked ``step`` functions it
runs through.

torch runs an optimizer's step hooks in the ``step`` of every class it patched
(``Optimizer._patch_step_function`` wraps the ``step`` of each class an instance is built
of, once per process). A subclass whose ``step`` calls ``super().step()`` therefore runs
the hooks twice where an instance of its parent class was built earlier in the process,
and once otherwise: the same user code, counted as one step or two by what ran before it.
A wrapper optimizer (Lookahead) stepping its base optimizer is one step too. ddparity's
hooks act at the outermost call only (:func:`nested_step`)."""

from __future__ import annotations

import functools
import sys
from types import FrameType
from typing import Any


@functools.cache
def _hooked_step_code() -> Any:
    """The code of torch's wrapper around a patched ``step`` (the frame that runs the hooks)."""
    from torch.optim import Optimizer

    return Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def nested_step() -> bool:
    """Whether the step hook calling this runs in a ``step`` that another optimizer ``step``
    called (``super().step()`` inside a subclass's ``step``, or a wrapper such as Lookahead
    stepping its base optimizer), not in the call the training step made."""
    code = _hooked_step_code()
    frame: FrameType | None = sys._getframe(1)
    calls = 0
    while frame is not None:
        if frame.f_code is code:
            calls += 1
            if calls > 1:
                return True
        frame = frame.f_back
    return False
