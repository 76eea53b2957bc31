"""The calibration twin of mode ``single``: the same training, summed in another order,
with the rounding a W-rank run may add. Its distance to the reference is the noise floor
of ``tolerance="auto"`` (:mod:`ddparity.checks.tolerance` explains the reasoning).

Every global batch is trained in reversed sample order (the same mathematics for any
model that treats the batch as a set), and every gradient is nudged towards zero, before
the optimizer step, by W ulps of the size of its summands. The twin's distance to the
reference therefore contains both the reordering noise and what the optimizer and later
steps make of worst-case rounding (Adam turns ulps of a near-zero gradient into visible
update differences). It also records the size of the summands (per-sample, or per-shard)
for the tolerance floor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ddparity.case import Samples
from ddparity.distances import Entry, Reference, summation_ulps
from ddparity.harness.ranks.batches import (
    batch_dims,
    batch_size,
    cast,
    map_tensors,
    reverse_samples,
    sample_lists,
    shard,
)
from ddparity.harness.ranks.comparer import Comparer
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.modes.twin_optimizer import RoundedForTheOptimizer
from ddparity.harness.ranks.randomness import suspended
from ddparity.harness.ranks.stepping import lowest_precision, record_step
from ddparity.harness.ranks.training import Replica, call_args, finish_step, forward


@dataclass
class TwinMode(SingleMode):
    twin_world_size: int = 1
    """The largest world size the reference is compared with (W)."""

    watch_draws: bool = False
    dtype: Any = None
    """The torch dtype the case computes in: the jitter's ulp (:func:`jittered`)."""
    optimizer_dtype: str | None = None
    """A lower precision the reference's optimizer step computed in ("bfloat16"): the
    optimizer's input and its own products are rounded as a sharded run's are
    (:class:`~ddparity.harness.ranks.modes.twin_optimizer.RoundedForTheOptimizer`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._batch: Any = None
        self._scales: tuple[Any, dict] | None = None
        self._jitter_rows = False
        """Whether the embeddings' rows are jittered now (the step's own passes, not the
        summands' measurement)."""

    def wrap(self, model: Any) -> Any:
        if self.twin_world_size > 1 and self.dtype is not None:
            jitter_embeddings(model, self.dtype, lambda: self._jitter_rows)
        return model

    def share(self, batch: Any, size: int | None) -> Any:
        if not (self.twin_world_size and size):
            return batch
        batch = reverse_samples(batch, size)
        return jittered(batch, self.dtype) if self.twin_world_size > 1 and self.dtype is not None else batch

    def before_optimizer(self, replica: Replica) -> None:
        """Nudge the gradients the optimizer is about to use (and, with ddparity's own
        step, measure the size of their summands first)."""
        model, ws = replica.model, self.twin_world_size
        self._scales = None
        if ws <= 1:
            return
        if replica.case.train_step is None:
            self._jitter_rows = False
            with suspended():
                self._scales = self._magnitudes(replica)
        dtype = lowest_precision(replica.case.torch_dtype, replica.precision.dtype if replica.precision else None)
        nudge_towards_zero(model, self._scales[1] if self._scales else {}, ws, dtype)
        if self._scales is not None and hasattr(replica.sink, "note_scales"):
            replica.sink.note_scales(replica.ctx.step, *self._scales)
        self._scales = None  # a gradient-sized tensor per parameter: not kept past the step

    def _magnitudes(self, replica: Replica) -> tuple[Any, dict] | None:
        """The size of the summands DDP adds: per sample where the loss is a mean of
        per-sample losses, else per shard. A batch-coupled loss (contrastive, a
        normaliser over the batch) is not: its per-sample losses are not its terms, which
        shows as mean |sample loss| < |batch loss|."""
        model, ws, (inputs, targets) = replica.model, self.twin_world_size, self._batch
        with kept_python_state(model):
            # per-sample gradients vmap dim 0: not the samples of a ddparity.batched(dim=...) tensor, nor of a list
            plain = batch_dims(replica.shared_batch) == {0} and not sample_lists(replica.shared_batch)
            scales = sample_magnitudes(model, replica.loss_fn, inputs, targets) if plain else None
            if scales is not None and float(scales[0]) < (1 - 1e-3) * float(self._loss_size(replica)):
                scales = None
            raw = replica.shared_batch  # with its ddparity.whole marks, to cut as DDP does
            size = batch_size(raw)
            if scales is None and size and size % ws == 0:
                shards = [cast(shard(raw, rank, ws, size), replica.case, replica.device) for rank in range(ws)]
                try:
                    scales = shard_magnitudes(model, replica.loss_fn, shards)
                except Exception:  # ddparity's own measurement: the model's failure on a shard is
                    scales = None  # the W-rank run's to report, never the reference's
        return scales

    def _loss_size(self, replica: Replica) -> Any:
        """|loss| of the whole batch, computed without touching the model's buffers."""
        import torch
        from torch.func import functional_call

        model, (inputs, targets) = replica.model, self._batch
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        args, kwargs = call_args(inputs)
        with torch.no_grad():
            outputs = functional_call(model, (params, buffers), args, kwargs)
            return replica.loss_fn(outputs, targets).detach().abs().double().cpu()

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        self._batch = batch
        self._jitter_rows = True
        finish_step(replica, step, *record_step(step, replica, batch))

    def sink(self, comparer: Comparer) -> Any:
        """Where the twin's tensors go: ``comparer``, through :class:`RoundedForTheOptimizer`
        where the optimizer computes in a lower precision than the gradients and W > 1."""
        if self.optimizer_dtype is None or self.twin_world_size <= 1:
            return comparer
        return RoundedForTheOptimizer(comparer, self.optimizer_dtype)


JITTER_SEED = 20240607
"""The twin's own generator for its jitter: the global RNG streams (dropout, the user's
draws) are the reference's."""


def jittered(batch: Any, dtype: Any) -> Any:
    """The batch's floating tensors in ``dtype`` (the case's, as the step will get them),
    every element that is not a whole number moved by an ulp of itself, up or down at
    random, where ``dtype`` is
    float32 or float64 (a lower precision's ulp is a perturbation far above what kernels of
    another size change: such a batch is left as it is).

    A W-rank run computes each shard with other kernel paths than the whole batch (GEMMs
    and reductions of another size), so its intermediate values differ from the
    reference's in their last bits. Where a gradient is a cancelled sum (a bias that a
    per-sample normalisation follows: analytically zero, numerically ulps of its terms),
    such last-bit differences are the whole value, and reordering the batch alone does not
    reproduce them: the twin computed such a bias gradient bit for bit the reference's
    while a correct 2-rank run differed by 70% of it. An ulp in every input perturbs the
    intermediate values as such kernel differences do, so the twin's distance holds them."""
    import torch

    if torch.finfo(dtype).eps > 1e-6:
        return batch
    generator = torch.Generator().manual_seed(JITTER_SEED)

    def nudge(t: Any) -> Any:
        if not t.is_floating_point() or not t.numel():
            return t
        t = t.to(dtype)
        signs = torch.randint(0, 2, t.shape, generator=generator).to(t.device, dtype) * 2 - 1
        # whole numbers stay: labels, masks, one-hots or a category column kept as floats may be
        # read as integers (2.9999998 .long() is 2)
        return t + t * torch.finfo(dtype).eps * signs * (t != t.round())

    return map_tensors(batch, nudge, samples=lambda s: Samples(map_tensors(s.items, nudge)))


def jitter_embeddings(model: Any, dtype: Any, on: Any) -> None:
    """The rows every embedding of ``model`` looks up, moved by an ulp while ``on()``: the
    twin's :func:`jittered` for a batch of token ids (whole numbers, which it leaves as they
    are), whose floating-point input is the rows. Without it, a gradient that is a cancelled
    sum downstream of the tokens (Mixtral's router with one expert per token: a weight
    normalised by itself, analytically 1) came bit for bit the reference's in the twin, and a
    correct 2-rank run differed by 60% of it. The signs alternate along the last dimension:
    no random draw (the per-sample pass is vmapped; the reference's streams stay its own)."""
    import torch
    from torch import nn

    if torch.finfo(dtype).eps > 1e-6:
        return

    def nudge(module: Any, args: Any, output: Any) -> Any:
        if not on() or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        signs = (torch.arange(output.shape[-1], device=output.device) % 2).to(output.dtype) * 2 - 1
        # whole numbers stay, as in jittered: a one-hot table's rows may be read as integers
        return output + output * torch.finfo(output.dtype).eps * signs * (output != output.round())

    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            module.register_forward_hook(nudge)


@contextlib.contextmanager
def kept_python_state(model: Any) -> Iterator[None]:
    """Every submodule's plain attributes (numbers, flags: a call counter) as they were
    before the extra passes, so the twin's trajectory is the reference's."""
    saved = [(m, {k: v for k, v in vars(m).items() if isinstance(v, (int, float, bool))}) for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs in saved:
            for k, v in attrs.items():
                setattr(m, k, v)


def shard_magnitudes(model: Any, loss_fn: Any, batches: list[Any]) -> tuple[Any, dict]:
    """Mean over the shards ``batches`` (each ``(inputs, targets)``) of |shard loss| and
    |shard gradient|.

    DDP sums the shards' gradients; the rounding of that sum is bounded by the size of its
    terms, not of its result, which can be far smaller when the terms cancel. These are
    the terms' sizes. The model's gradients, buffers (BatchNorm statistics) and RNG
    state are restored, so the reference trajectory is untouched.
    """
    import torch

    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    loss_scale = torch.zeros((), dtype=torch.float64)
    grad_scale: dict[str, Any] = {}
    shards = len(batches)
    try:
        for inputs, targets in batches:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(forward(model, inputs), targets)
            loss.backward()
            loss_scale += loss.detach().abs().double().cpu() / shards
            for n, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.detach().to_dense() if p.grad.layout != torch.strided else p.grad.detach()
                    term = g.abs().to(torch.promote_types(g.dtype, torch.float32)).cpu() / shards
                    grad_scale[n] = grad_scale[n] + term if n in grad_scale else term
    finally:  # a shard the model refuses (BatchNorm on one sample) leaves no trace either
        for n, p in model.named_parameters():
            p.grad = grads[n]
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return loss_scale, grad_scale


SAMPLE_GRADIENTS_MAX = 1 << 26
"""The most per-sample gradient elements computed at once (256 MB in float32). Past that
(a 10 M-parameter model with a batch of 8) the summands' size is taken per shard instead:
W forward-backward passes on the shards cost one batch's, where per-sample gradients cost
a pass per sample (8 x 50 M elements: 20 s of a 50 s check)."""


def sample_magnitudes(model: Any, loss_fn: Any, inputs: Any, targets: Any) -> tuple[Any, dict] | None:
    """Mean over samples of |sample loss| and |per-sample gradient|, in one vmapped pass.

    Every reordering of the batch sum (by shards, by all-reduce) rounds in proportion to
    the size of these terms. Returns None where per-sample gradients are not defined or
    not computable by ``torch.func`` (BatchNorm in training, randomness, exotic inputs),
    or too large (:data:`SAMPLE_GRADIENTS_MAX`); the caller then falls back to shard
    magnitudes.
    """
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def one(params: dict, x: Any, y: Any) -> Any:
        batch = map_tensors(x, lambda t: t.unsqueeze(0))
        args, kwargs = call_args(batch)
        loss = loss_fn(functional_call(model, (params, buffers), args, kwargs), map_tensors(y, lambda t: t.unsqueeze(0)))
        return loss, loss

    samples = batch_size((inputs, targets)) if not isinstance(inputs, dict) else None
    if not samples or samples * sum(p.numel() for p in params.values()) > SAMPLE_GRADIENTS_MAX:
        return None
    try:
        per_grad, per_loss = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0))(params, inputs, targets)
    except Exception:  # not expressible per sample: use shards instead
        return None
    loss_scale = per_loss.detach().abs().double().mean().cpu()
    grad_scales = {n: g.detach().abs().double().mean(dim=0).cpu() for n, g in per_grad.items()}
    return loss_scale, grad_scales


def nudge_towards_zero(model: Any, grad_scales: dict[str, Any], world_size: int, dtype: Any) -> None:
    """Move every gradient towards zero by the rounding a correct W-rank run may add: an
    ulp of the precision each rank computed its partial in (``dtype``) or the ulps of the
    gradient's own dtype (in which DDP sums the partials) that summing ``world_size`` of them
    may add (:func:`~ddparity.distances.summation_ulps`), whichever is larger, of the size of
    its summands (of itself where that is unknown). Under autocast the partials round in bf16
    but are summed in float32: W bf16 ulps would grow past the value at large W."""
    import torch

    eps, walk = torch.finfo(dtype).eps, summation_ulps(world_size)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            inexact = p.grad.is_floating_point() or p.grad.is_complex()
            ulps = max(eps, walk * torch.finfo(p.grad.dtype).eps) if inexact else 0.0
            if p.grad.layout != torch.strided:
                p.grad = _nudged_sparse(p.grad, grad_scales.get(n), ulps)
                continue
            scale = grad_scales.get(n)
            direction = _towards_zero(p.grad)
            if scale is not None:
                size = scale.to(p.grad.device, p.grad.real.dtype)
            elif not p.grad.numel():
                continue
            else:
                # Summands unknown (the user's own step): the tensor's largest element is
                # their size, so an element that nearly cancels may change sign, as it may
                # under DDP (and Adam turns that into a whole step). In bf16/fp16 a sum
                # can round to exactly 0 on one side only: exact zeros move too.
                size = p.grad.abs().max()
                if eps > 1e-6:
                    direction = torch.where(p.grad == 0, -1.0, direction)
            p.grad.sub_(ulps * size * direction)


def _towards_zero(t: Any) -> Any:
    """The sign of each element; of a complex one, of its real and its imaginary part each
    (DDP sums them as two reals, and Adam steps each by its own sign)."""
    import torch

    if t.is_complex():
        return torch.complex(torch.sign(t.real), torch.sign(t.imag))
    return torch.sign(t)


def _nudged_sparse(grad: Any, scale: Any, ulps: float) -> Any:
    """A sparse gradient nudged towards zero in the rows it holds, still sparse (an
    optimizer such as ``SparseAdam`` takes nothing else)."""
    import torch

    g = grad.coalesce()
    values = g.values()
    if scale is not None:
        size = scale.to(values.device, values.real.dtype).to_dense()[g.indices()[0]]
    else:
        size = values.abs().max() if values.numel() else values.new_zeros(())
    return torch.sparse_coo_tensor(g.indices(), values - ulps * size * _towards_zero(values), g.shape)


def calibrated(reference: Reference, twin: Comparer) -> Reference:
    """``reference`` with its twin's distance (noise) and summand size (scale) in every entry."""
    for step, entries in enumerate(reference.steps):
        noises = twin.result.steps[step] if step < len(twin.result.steps) else {}
        for key, e in entries.items():
            noise = noises.get(key, 0.0)
            if noise == float("inf"):
                noise = 0.0  # shape/None mismatches are not noise
            scale = 0.0
            if key[0] in ("loss", "grad"):
                scale = twin.scales.get((step, *key), twin.values.get((step, *key), 0.0))
            entries[key] = Entry(e.value, e.floating, noise, scale)
    return reference
