"""Mode ``ddp``: this rank's contiguous shard of every global batch under
``DistributedDataParallel`` (real rank processes, or each simulated rank of the threaded
backend).

The rank reports its phase at every stage of a step, its DDP bucket all-reduces are
recorded (:mod:`ddparity.harness.recording.ddp_buckets`, wrapping the case's own comm hook, if any),
and the fingerprints of its replica are published after every optimizer step, so the
controller can judge hangs and desync. A simulated rank records the same into its own
recorder (:class:`~ddparity.harness.recording.threads.ThreadRecorder`).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

from ddparity.harness.ranks.batches import shard
from ddparity.harness.ranks.stepping import record_step
from ddparity.harness.ranks.training import Replica, finish_shared_step
from ddparity.harness.recording import ddp_buckets, recorder
from ddparity.harness.recording.fingerprint import fingerprint


@dataclass
class DDPMode:
    steps: int
    rank: int
    world_size: int
    device: str
    comm_hook: Any = None
    comm_hook_state: Any = None
    ddp_options: Any = None
    name: str = "ddp"
    settle: Any = None
    """Called once DDP is built (simulated ranks: wait until every thread has built its own)."""
    align_dropout: bool = True
    watch_draws: bool = False
    name_draws: bool = False
    traced: bool = False
    """A compiled run's: no hook of ours on the parameters (compiled autograd would trace it)."""

    def __post_init__(self) -> None:
        self.recorder = recorder.active()  # a simulated rank's own (a thread's)
        self._buckets: ddp_buckets.BucketLayout | None = None
        self._ddp: Any = None
        self._step = -1
        self.grad_bytes = 0
        self.forwards: dict[int, tuple[int, int]] = {}
        """Per step: DDP's forwards, and those with gradient sync on (what a missed sync and
        a bypassed DDP leave differently)."""
        self.accumulated: dict[int, int] = {}
        """Per step: the most forwards with sync on in a row with no parameter changed between
        them (micro-batches accumulated, what ``no_sync()`` would spare); an optimizer stepping
        between two, as a GAN's discriminator's does, starts a new row."""
        self._row = (-1, -1, 0)  # (step, the parameters' versions, forwards) of the row so far
        self.passes: SyncedPasses | None = None
        self.bypassed: dict[int, list[str]] = {}
        """Per step: the parameters whose gradient reached ``optimizer.step()`` from a backward
        that no DDP forward with sync on preceded (:class:`SyncedPasses`)."""

    def wrap(self, model: Any) -> Any:
        self.recorder.set_phase(-1, "ddp")
        ddp = self._ddp = distributed(model, self.device, self.ddp_options)
        _REDUCED[ddp] = reduced_parameters(ddp)  # DDP's indices: what required grad when it was built
        self.grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
        # Each rank its own hook state, as a rank process gets by unpickling (simulated ranks
        # share one process and would otherwise share one state).
        hook_state = copy.deepcopy(self.comm_hook_state)
        if self.comm_hook is not None or not ddp_buckets.BucketLayout.available(ddp):
            # the case's own hook (or DDP's default one) wrapped to record each bucket
            ddp.register_comm_hook(*ddp_buckets.ddp_comm_hook(self.comm_hook, hook_state))
        else:
            self._buckets = ddp_buckets.BucketLayout(ddp)
        ddp.register_forward_hook(recorder.untraced(self._after_forward))
        self.passes = None if self.traced else SyncedPasses.watch(ddp)
        if self.settle is not None:
            self.settle()
        return ddp

    def _after_forward(self, ddp: Any, args: Any, outputs: Any) -> None:
        """Backward is next; where DDP will all-reduce it (not under ``no_sync()``), the
        ledger learns its buckets first."""
        self.recorder.set_phase(self._step, "backward")
        calls, synced = self.forwards.get(self._step, (0, 0))
        self.forwards[self._step] = (calls + 1, synced + bool(ddp.require_backward_grad_sync))
        if ddp.require_backward_grad_sync:
            step, versions, row = self._row
            now = sum(p._version for p in ddp.parameters())
            self._row = (self._step, now, row + 1 if (step, versions) == (self._step, now) else 1)
            self.accumulated[self._step] = max(self.accumulated.get(self._step, 0), self._row[2])
        if self._buckets is not None and ddp.require_backward_grad_sync:
            self.recorder.ddp_buckets(self._buckets.current())
        if self.passes is not None:
            self.passes.armed = bool(ddp.require_backward_grad_sync)

    def sync_off(self, wrapped: Any) -> Any:
        return wrapped.no_sync

    def share(self, batch: Any, size: int | None) -> Any:
        return shard(batch, self.rank, self.world_size, size)

    def before_optimizer(self, replica: Replica) -> None:
        self.recorder.set_phase(self._step, "optimizer")
        if self.passes is not None:
            self.bypassed[self._step] = self.passes.unsynced()
        unreduced = unreduced_parameters(self._ddp, self._step, self.rank)
        if unreduced is not None:
            raise RuntimeError(unreduced)

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        self._step = step
        if self.passes is not None:
            self.passes.last.clear()
        try:
            loss, stepped = record_step(step, replica, batch)  # DDP's all-reduces end inside backward
        except RuntimeError as exc:
            named = unused_parameters(self._ddp, str(exc))
            if named is None:
                raise
            raise RuntimeError(named) from None
        finish_shared_step(self, replica, step, loss, stepped)
        self.recorder.set_phase(step, "fingerprint")
        part = None if step == self.steps - 1 else step  # everything at the last step
        rec_buffers = not self._ddp.broadcast_buffers
        self.recorder.fingerprints(step, fingerprint(replica.model, replica.optimizer, buffers=rec_buffers,
                                                     part=part))


class SyncedPasses:
    """Whether each parameter's last gradient came from a backward that a DDP forward with
    gradient sync on preceded (DDP all-reduces that one) or not: a forward through the module
    DDP wraps (``model.module(x)``, ``model.module.head(h)``) or with sync off. Read by hooks
    that return nothing: each parameter's post-accumulate-grad hook, and a callback at the
    end of each backward (a backward nested in another, as a reentrant checkpoint runs, takes
    the outer one's state)."""

    def __init__(self, ddp: Any) -> None:
        self.armed = False
        """A DDP forward with sync on ran since the last backward ended."""
        self.last: dict[str, bool] = {}
        self._running: dict[int, bool] = {}  # the backward passes under way, by graph task
        for name, p in ddp.module.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook(name))

    @classmethod
    def watch(cls, ddp: Any) -> SyncedPasses | None:
        import torch

        return cls(ddp) if hasattr(torch._C, "_current_graph_task_id") else None

    def _hook(self, name: str) -> Any:
        import torch

        def accumulated(param: Any) -> None:
            task = torch._C._current_graph_task_id()
            if task not in self._running:
                self._running[task] = self.armed or any(self._running.values())
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._ended(task))
            self.last[name] = self._running[task]

        return accumulated

    def _ended(self, task: int) -> None:
        self._running.pop(task, None)
        if not self._running:
            self.armed = False

    def unsynced(self) -> list[str]:
        return [name for name, synced in self.last.items() if not synced]


def distributed(model: Any, device: str, options: dict[str, Any] | None) -> Any:
    """``model`` under ``DistributedDataParallel`` on ``device``, with the case's options."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, **(options or {}))


FIND_UNUSED = ("Case(ddp_options={\"find_unused_parameters\": True}) here, "
               "DistributedDataParallel(model, find_unused_parameters=True) in your training")
"""How to let DDP find parameters without a gradient, here and in the user's training."""


FROZEN_FIX = ("Freeze before DDP is built (wrap the model in DDP again after freezing), or let DDP find the frozen "
              f"ones: {FIND_UNUSED}")


def unreduced_parameters(ddp: Any, step: int, rank: int) -> str | None:
    """Where this rank reached ``optimizer.step()`` with DDP's reduction unfinished (DDP's own
    local check: a bucket never all-reduced) because some parameters got no gradient in its
    backward, the parameters and the fix, in words; None otherwise. Parameters unused on some
    ranks only (experts no token of a shard was routed to) leave the other ranks waiting in
    that bucket's all-reduce: a hang, or the next collective mismatched (gloo aborted every
    rank on "Received data size doesn't match"), in training as here."""
    if ddp is None or not ddp.require_backward_grad_sync:
        return None
    try:
        ddp._check_reducer_finalized()
        return None
    except RuntimeError:
        pass
    wanted = reduced_parameters(ddp)
    missing = [n for n, p in wanted if p.grad is None]
    if not missing or len(missing) == len(wanted):  # no backward at all: not this cause
        return None
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    frozen = [n for n, p in wanted if p.grad is None and not p.requires_grad]
    if frozen == missing:
        return (f"DistributedDataParallel did not all-reduce every gradient of step {step} on rank {rank}: the step "
                f"set requires_grad=False on {shown} after DDP was built, and DDP all-reduces a bucket only once "
                f"every parameter that required grad when it was built has its gradient (in training: a hang, the "
                f"next collective mismatched, or DDP raises at the next forward). {FROZEN_FIX}")
    return (f"DistributedDataParallel did not all-reduce every gradient of step {step} on rank {rank}: "
            f"{len(missing)} parameter(s) received no gradient in this rank's backward ({shown}). They took no "
            f"part in this rank's loss (parameters that some batches use and others do not, such as "
            f"mixture-of-experts experts no token of this shard was routed to, or a branch the data picks), and DDP "
            f"all-reduces a bucket only once every parameter in it has its gradient: this rank never sent that "
            f"bucket, and ranks whose batch used them wait for it (in training: a hang, or the next collective "
            f"mismatched; where no rank used them, DDP raises at the next forward). Let DDP find them: "
            f"{FIND_UNUSED}; or make every parameter take part in every rank's loss (or remove the unused ones, or "
            f"set requires_grad=False on frozen ones)")


def unused_parameters(ddp: Any, error: str) -> str | None:
    """DDP's "did not receive grad" error (a parameter unused in the loss, found at the next
    forward) in words that name the parameters, by DDP's own indices (its parameters in
    ``named_parameters`` order, those that required grad when it was built, each once), and
    the fix; None for any other error. A parameter frozen since DDP was built is said to be."""
    import re

    found = re.search(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)", error)
    if found is None:
        return None
    reduced = reduced_parameters(ddp)
    indices = [int(i) for i in found.group(2).split()]
    unused = [reduced[i][0] if i < len(reduced) else f"#{i}" for i in indices]
    frozen = [reduced[i][0] for i in indices if i < len(reduced) and not reduced[i][1].requires_grad]
    head = (f"DistributedDataParallel found parameters that received no gradient in the previous step's backward "
            f"on rank {found.group(1)}: {', '.join(unused)} (DDP's parameter indices {found.group(2).strip()}). ")
    if frozen:
        return head + (f"The step set requires_grad=False on {', '.join(frozen)} after DDP was built, and DDP still "
                       f"waits for the gradient of every parameter that required one when it was built. {FROZEN_FIX}")
    return head + (f"They take no part in the loss, and DDP waits for every parameter's gradient before the next "
                   f"step. Either use them in the loss (or remove them, or set requires_grad=False on frozen ones "
                   f"before DDP is built), or let DDP find them: {FIND_UNUSED}")


_REDUCED: weakref.WeakKeyDictionary[Any, list[tuple[str, Any]]] = weakref.WeakKeyDictionary()
"""Per DDP module ddparity built: :func:`reduced_parameters` as they were then."""


def reduced_parameters(ddp: Any) -> list[tuple[str, Any]]:
    """The parameters DDP reduces, by name, in its own order (its parameter indices): those
    of ``named_parameters`` that required grad when it was built and that it was not told to
    ignore, each once."""
    if ddp in _REDUCED:
        return _REDUCED[ddp]
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    out, seen = [], set()
    for name, p in ddp.module.named_parameters():
        if p.requires_grad and name not in ignored and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out
