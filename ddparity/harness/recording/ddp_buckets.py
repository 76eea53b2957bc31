"""DDP's gradient buckets, as the collective ledger records them.

DDP's reducer issues one all-reduce per gradient bucket from C++, where the ledger's
patched ``torch.distributed`` functions never see it. Two ways to record them: from the
bucket layout, at the start of backward (:class:`BucketLayout`, free), or through a comm
hook that wraps the case's own (:func:`ddp_comm_hook`, where the case has a hook, or
DDP offers no layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddparity.harness.recording.recorder import active
from ddparity.records import BUCKET_VIA


class BucketLayout:
    """The gradient buckets of one DDP model, as (meta) tensors of their shape and dtype.

    DDP's reducer issues one all-reduce per bucket from C++. Registering a Python comm
    hook to see them would cost an extra pass over every gradient (the reducer divides
    while copying into the bucket only when no hook is registered: 7% of a step in our
    benchmark), so instead the ledger records them from the layout, at the start of
    backward, before the reducer issues them. The layout is read at the first two
    backwards only: DDP rebuilds its buckets once, after the first iteration.
    """

    def __init__(self, ddp: Any) -> None:
        self._ddp = ddp
        self._reads = 0
        self._layout: list[Any] = []

    @staticmethod
    def available(ddp: Any) -> bool:
        return hasattr(getattr(ddp, "reducer", None), "_get_zeros_like_grad_buckets")

    def _sparse(self) -> bool:
        return any(getattr(m, "sparse", False) is True for m in self._ddp.module.modules())

    def current(self) -> list[Any]:
        if self._reads < 2:
            self._reads += 1
            if self._sparse():
                # sparse gradients have no flat bucket buffer (and the reducer cannot copy one):
                # DDP reduces them apart, which the ledger leaves out on every rank alike
                self._layout = []
            else:
                self._layout = [b.buffer().to("meta") for b in self._ddp.reducer._get_zeros_like_grad_buckets()]
        return self._layout


@dataclass(frozen=True, slots=True)
class _HookState:
    hook: Callable[..., Any] | None
    state: Any


def ddp_comm_hook(hook: Callable[..., Any] | None = None, state: Any = None) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` to register on a DDP model so that its bucket all-reduces are
    recorded (labelled with the bucket). Wraps the user's hook, or DDP's default
    averaging all-reduce when there is none."""
    return _HookState(hook, state), _ledger_hook


def _ledger_hook(state: _HookState, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with active().via(f"{BUCKET_VIA} {bucket.index()}"):
        if state.hook is None:
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group
        return state.hook(state.state, bucket)
