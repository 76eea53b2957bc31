"""Randomness in a step, made comparable: the same dropout mask for the same sample in
every mode and on every rank, and every other random draw found and named.

A model with dropout trained on one device, on DDP shards and in reversed order (the
calibration twin) draws other masks for the same sample from torch's one generator, so
its runs differ by far more than rounding and no comparison is sharp. While a replica
trains, :class:`AlignedDropout` replaces ``torch.nn.functional``'s dropouts (``dropout``,
``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``, and the attention
dropout of ``scaled_dot_product_attention``, which ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer`` and transformers' attention call) with one whose mask
for a sample is drawn from a generator seeded by (case seed, step, the dropout's place in
the forward, the sample's index in the global batch). A sample's mask is therefore the
same wherever it is trained. Any other draw with one part per sample (a diffusion step's
noise and timesteps, stochastic depth, a router's jitter) is drawn the same way
(:mod:`ddparity.harness.ranks.sample_draws`), outside activation checkpointing (whose
recompute must repeat torch's own draw).

Which rows of a tensor are which samples: the replica's share of the global batch says
its samples (all, reversed, a shard); a forward called on a slice of the share (a
micro-batch, DataParallel's chunks) is matched to its rows through the storage the slice
views; a dropout input has its samples along dim 0 (also grouped, as attention's
``(batch * heads, L, S)``), or along dim 1 inside a module built with
``batch_first=False``. Where none of this tells the rows, the step cannot be compared
with dropout on, and a :class:`CaseError` says so.

:class:`RandomDraws` (the reference only) records every other draw from torch's
generators in a step (a draw for the whole batch, ``RReLU``, a dropout called through
``torch.dropout``); the reference then stops with an error that names them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

from ddparity.errors import CaseError
from ddparity.harness.ranks import traced
from ddparity.harness.ranks.draw_scope import Scope
from ddparity.harness.ranks.forward_rows import rows_of, slice_of
from ddparity.harness.ranks.replays import digest, in_backward, may_be_recomputed, replayed
from ddparity.harness.ranks.sample_draws import replacements

_local = threading.local()
_lock = threading.Lock()
_installed: dict[str, Any] = {}
_drawn: dict[tuple[Any, str], Any] = {}
_users = 0
class AlignedDropout:
    """Same-sample, same-mask dropout for one replica's training (see the module docstring)."""

    def __init__(self, model: Any, seed: int, enabled: bool = True) -> None:
        import torch

        self.scope = Scope(seed)
        self.most_calls = 0
        self.enabled = enabled
        self._handles: list[Any] = []
        if not enabled or isinstance(model, torch.jit.ScriptModule):
            # torch's own dropout: a profile times the training as it is; a scripted model
            # takes no hooks and calls no Python dropout (its draws are found as draws)
            self.enabled = False
            return
        self._handles.append(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._forward_ends, always_call=True))
        for module in model.modules():
            flag = getattr(module, "batch_first", None)
            if isinstance(flag, bool) and not isinstance(module, torch.jit.ScriptModule):
                attention = isinstance(module, torch.nn.MultiheadAttention)
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(self._enter_batch_flag, None if attention else flag)))
                self._handles.append(module.register_forward_hook(self._leave_batch_flag))
        _install()
        _local.scope = self.scope

    def begin(self, step: int, rows: Any, batch: Any, dims: set[int] | None = None) -> None:
        """A new step, on the samples ``rows`` (global indices of the share's rows; ``dims``:
        the dimensions the batch is batched along, 0 and any ``ddparity.batched``'s)."""
        import torch

        from ddparity.harness.ranks.batches import named_tensors

        if not self.enabled:
            return
        traced.take_traced()  # what another run's graph traced is not this step's
        scope = self.scope
        self.most_calls = max(self.most_calls, scope.drawn)
        scope.step, scope.rows, scope.drawn, scope.forward_calls = step, rows, 0, 0
        size = len(rows) if rows is not None else -1
        scope.in_forward, scope.micro, scope.cursors, scope.taken, scope.fed, scope.named = False, None, {}, {}, [], []
        scope.step_counts = torch.zeros(max(size, 0), dtype=torch.int64)
        scope.sources = [t for _, t in named_tensors(batch) if t.dim() and t.shape[0] == size]
        scope.forward_rows, scope.forward_inputs, scope.batch_first = None, None, []
        scope.dims = sorted(dims or {0})
        scope.replays = {}

    def end_step(self, step: int) -> None:
        """Raise a :class:`CaseError` where the step's own draws gave its samples unequal
        numbers of draws: a sample's draws would depend on how the share was cut."""
        if not self.enabled:
            return
        self.raise_if_traced(step)
        partial = self.scope.partial_sites()
        if partial:
            size = len(self.scope.rows)
            where = ", ".join(f"torch.{name} at {os.path.basename(file)}:{line} for {taken} of its {size} samples"
                              for (file, line, name), taken in partial)
            raise CaseError(
                f"the training step draws random numbers at step {step} for fewer rows than the samples at hand "
                f"({where}): not one part per sample of the share — a draw for the whole batch (one timestep for "
                f"every sample, a random vector of features), or for some micro-batches only — which no mode can "
                f"draw alike for every sample; draw one part per sample of every micro-batch (torch.randint(0, T, "
                f"(n,)) for n samples), draw from a torch.Generator you seed, or switch the draw off for the check")
        reordered = self.scope.out_of_order()
        if reordered is not None:
            (file, line, name), took, given = reordered
            raise CaseError(
                f"the training step's micro-batches at step {step} are not given to the model in the order its draws "
                f"took them: torch.{name} at {os.path.basename(file)}:{line} has no tensor to shape it like, so it "
                f"took the share's next rows ({took.start}:{took.stop}), while the micro-batch it was drawn for holds "
                f"rows {given.start}:{given.stop}; no mode would draw alike for those samples. Draw for the whole share "
                f"before the loop and slice it (t = torch.randint(0, T, (len(x),)); t[a:b] for the micro-batch x[a:b]), "
                f"draw shaped like the micro-batch (torch.randn_like(x[a:b])), or take the micro-batches in order")
        uneven = self.scope.uneven_step_draws()
        if uneven is not None:
            raise CaseError(
                f"the training step's per-sample random draws at step {step} are not one per sample each: some "
                f"samples were drawn for {uneven[0]} time(s), others {uneven[1]}, so a draw with no tensor to shape "
                f"it like (torch.randint(0, T, (n,)), torch.rand(n)) took the rows of another micro-batch than its "
                f"own; draw each micro-batch's numbers together (torch.randn_like(part) first, then its timesteps), "
                f"or draw for the whole share and slice")

    def raise_if_traced(self, step: int) -> None:
        """Raise a :class:`CaseError` where a graph the step compiled traced a stand-in (see
        :mod:`ddparity.harness.ranks.traced`): its masks were torch's own, drawn alike in no mode."""
        inside = traced.take_traced() if self.enabled else []
        if inside:
            raise CaseError(
                f"{', '.join(inside)} ran inside a graph the step compiled (torch.compile of the model in train_step "
                f"or from Case.model), traced within a torch function the graph keeps whole (such as "
                f"F.multi_head_attention_forward), where ddparity cannot give each sample the same mask in every "
                f"mode at step {step}; check the model eager (no torch.compile: ddparity.check(case, compile=...) "
                f"compares compiled runs of models without dropout), or with its dropout off for the check")

    def close(self) -> int:
        """Stop aligning; the most dropout calls one step made."""
        global _users
        for handle in self._handles:
            handle.remove()
        if not self.enabled:
            return 0
        _local.scope = None
        with _lock:
            _users -= 1
            if _users == 0:
                _uninstall()
        return max(self.most_calls, self.scope.drawn)

    # A hook's return value would replace the module's input or output: these return nothing.
    def _enter_batch_flag(self, flag: bool | None, module: Any, args: tuple) -> None:
        self.scope.batch_first.append(flag)

    def _leave_batch_flag(self, module: Any, args: tuple, output: Any) -> None:
        if self.scope.batch_first:
            self.scope.batch_first.pop()

    def _forward_starts(self, module: Any, args: tuple, kwargs: dict) -> None:
        scope = self.scope
        if getattr(_local, "scope", None) is not scope:
            return  # suspended (the twin's extra passes)
        scope.calls = 0  # every forward (micro-batch) numbers its dropouts from 0
        scope.in_forward = True
        scope.forward_calls += 1
        scope.forward_inputs = list(args) + list(kwargs.values())  # matched to rows at the first dropout only
        scope.forward_rows = None
        if scope.rows is not None:
            from ddparity.harness.ranks.batches import named_tensors

            first = next((t for _, t in named_tensors(scope.forward_inputs) if t.dim()), None)
            scope.fed.append(slice_of(len(scope.rows), scope.sources, first) if first is not None else None)

    def _forward_ends(self, module: Any, args: tuple, output: Any) -> None:
        self.scope.in_forward = False


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No alignment inside (forward passes that are not the step's: they keep torch's own
    dropout, and leave the step's dropout numbering alone)."""
    scope = getattr(_local, "scope", None)
    _local.scope = None
    try:
        yield
    finally:
        _local.scope = scope


def _forward_rows(scope: Scope) -> Any:
    """The samples of this forward's rows (matched at its first draw, then kept)."""
    if scope.forward_rows is None and scope.forward_inputs is not None:
        scope.forward_rows = rows_of(scope.rows, scope.sources, scope.dims, scope.forward_inputs)
        scope.forward_inputs = None
    return scope.forward_rows


def _noise(x: Any, p: float, feature: bool, where: str) -> Any:
    """The dropout noise for ``x`` (bernoulli(1 - p), not yet scaled), each sample's part
    from its own generator; None when no replica is being aligned in this thread."""
    import torch

    scope = getattr(_local, "scope", None)
    if scope is None:
        return None
    replay = replayed(scope.replays, x)
    if replay is not None:
        rows, place = replay  # activation checkpointing runs a forward's dropout again: its mask
    else:
        rows = _forward_rows(scope)
        place = scope.next_place()
        if may_be_recomputed():
            scope.replays.setdefault(digest(x), []).append((rows, place))
    b = len(rows) if rows is not None else 0
    inner = scope.batch_first[-1] if scope.batch_first else True
    dim, group = None, 1
    if b and inner is False and x.dim() >= 2 and x.shape[1] == b:
        dim = 1
    elif b and x.dim() and x.shape[0] == b:
        dim = 0
    elif b and x.dim() and x.shape[0] % b == 0 and inner is not False:
        dim, group = 0, x.shape[0] // b
    elif b and x.dim() >= 2 and x.shape[1] == b:
        dim = 1
    if dim is None or (feature and (dim != 0 or group != 1 or x.dim() < 3)):
        shape = tuple(x.shape)
        raise CaseError(
            f"{where} at step {scope.step} (dropout call {place} of the forward) cannot be given the same mask "
            f"per sample in every mode: its input of shape {shape} has no dimension of this forward's "
            f"{b or 'unknown number of'} samples" + ("" if b else " (the model was called with a tensor that is "
                                                     "not the batch ddparity gave the step, nor a slice of it)")
            + "; call the model on the batch or on slices of it (x[i:j], x.chunk(n)), or switch dropout off for "
            "the check (model.eval() in the model factory, or p=0)"
        )
    moved = x.movedim(dim, 0) if dim else x
    per_sample = (group, *moved.shape[1:]) if group > 1 else tuple(moved.shape[1:])
    if feature:
        per_sample = (moved.shape[1],) + (1,) * (moved.dim() - 2)
    keep = 1.0 - p
    noise = torch.stack([torch.empty(per_sample, dtype=torch.float32).bernoulli_(keep, generator=gen)
                         for gen in scope.generators(place, rows)])
    if group > 1:
        noise = noise.reshape(b * group, *moved.shape[1:])
    noise = noise.to(device=x.device, dtype=x.dtype if x.is_floating_point() else torch.float32)
    return noise.movedim(0, dim) if dim else noise


def _apply(x: Any, noise: Any, p: float, alpha: bool, inplace: bool) -> Any:
    """ATen's ``_dropout_impl`` with the given noise."""
    if not alpha:
        noise = noise.div_(1.0 - p)
        return x.mul_(noise) if inplace else x * noise
    a_const = 1.7580993408473766
    a = 1.0 / math.sqrt((a_const * a_const * p + 1) * (1 - p))
    b = noise.add(-1).mul_(a_const * a).add_(a_const * a * p)
    noise = noise.mul_(a)
    return (x.mul_(noise) if inplace else x * noise).add_(b)


def _dropout_like(name: str, feature: bool, alpha: bool) -> Any:
    original = _installed[name]

    def aligned(input: Any, p: float = 0.5, training: bool = not alpha, inplace: bool = False) -> Any:
        if not training or p == 0 or getattr(_local, "scope", None) is None or not 0 < p < 1:
            return original(input, p, training, inplace)
        noise = _noise(input, p, feature, f"F.{name}")
        return _apply(input, noise, p, alpha, inplace)

    return aligned


def _aligned_attention() -> Any:
    import torch

    original = _installed["scaled_dot_product_attention"]

    def attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        if not dropout_p or getattr(_local, "scope", None) is None:
            extra = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **extra)
        # the math of the fused kernel, with the aligned dropout on the attention weights
        if enable_gqa:
            key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
        factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        weights = (query @ key.transpose(-2, -1)) * factor
        if is_causal:
            causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
            weights = weights.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            weights = (weights.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                       else weights + attn_mask)
        weights = torch.softmax(weights, dim=-1)
        scope = _local.scope
        scope.batch_first.append(None)  # attention weights are batch-major
        try:
            noise = _noise(weights, dropout_p, False, "scaled_dot_product_attention's dropout")
        finally:
            scope.batch_first.pop()
        return _apply(weights, noise, dropout_p, False, False) @ value

    return attention


def place_of_draw(samples: int, template: Any = None, site: Any = None) -> tuple[Scope, Any, int | list[int]] | None:
    """Where a draw of ``samples`` parts along dim 0 is aligned: this thread's scope, the
    samples' global indices and the draw's place (counted; in the step outside the forward,
    each row's); None where it is not (see :mod:`ddparity.harness.ranks.sample_draws`). In
    the step, a draw is for the rows its ``template`` views (``torch.randn_like(x[a:b])``),
    the whole share, or a micro-batch: the next rows of the share at its source line
    (``site``), else the rows a template last named."""
    scope = getattr(_local, "scope", None)
    if scope is None or in_backward():
        return None
    if scope.in_forward:
        if (scope.batch_first and scope.batch_first[-1] is False) or may_be_recomputed():
            return None
        rows = _forward_rows(scope)
        if rows is None or samples != len(rows):
            return None
        return scope, rows, scope.next_place()
    if scope.rows is None:
        return None
    part = slice_of(len(scope.rows), scope.sources, template) if template is not None else None
    if part is not None and part != slice(0, len(scope.rows)):
        scope.name_micro(part)
    elif samples == len(scope.rows):
        part = slice(0, samples)
    else:
        part = scope.next_rows(site, samples)
    if part is None or part.stop - part.start != samples:
        return None
    return scope, scope.rows[part], scope.next_step_places(part)


_DROPOUTS = {"dropout": (False, False), "dropout1d": (True, False), "dropout2d": (True, False),
             "dropout3d": (True, False), "alpha_dropout": (False, True), "feature_alpha_dropout": (True, True)}


def _install() -> None:
    global _users
    import torch.nn.functional as F

    with _lock:
        _users += 1
        if _installed:
            return
        for name in (*_DROPOUTS, "scaled_dot_product_attention"):
            _installed[name] = getattr(F, name)
        for name, (feature, alpha) in _DROPOUTS.items():
            setattr(F, name, traced.eager(_dropout_like(name, feature, alpha), _installed[name], f"F.{name}"))
        F.scaled_dot_product_attention = traced.eager(_aligned_attention(), _installed["scaled_dot_product_attention"],
                                                      "F.scaled_dot_product_attention")
        for (owner, name), replacement in replacements(place_of_draw).items():
            _drawn[(owner, name)] = original = getattr(owner, name)
            setattr(owner, name, traced.eager(replacement(original), original, f"torch.{name}"))
        traced.hide()


def _uninstall() -> None:
    import torch.nn.functional as F

    for name, original in _installed.items():
        setattr(F, name, original)
    for (owner, name), original in _drawn.items():
        setattr(owner, name, original)
    _installed.clear()
    _drawn.clear()
    traced.show()
