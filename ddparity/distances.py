"""What crosses from the ranks to the controller about a run's training: numbers, never
tensors.

The reference writes its tensors once, to a private spool on disk
(:mod:`ddparity.harness.ranks.spool`); every other run compares its own tensors against them
where they are, step by step, and sends back one distance per (step, kind, tensor). So a
check's memory is the replicas' own, whatever the model's size and the number of steps,
and nothing big is pickled.

* :class:`Reference`: per step and tensor, the reference's largest magnitude and its
  calibration twin's distance and summand size (what a tolerance is made of);
* :class:`Distances`: one run's (one rank's) distance to the reference, per step and tensor.

Also the two measures of a tensor every comparison uses, :func:`max_abs` and
:func:`distance`, computed in bounded chunks on the tensor's own device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

RECORD_KINDS = ("loss", "grad", "param", "optimizer", "buffer")
"""The order in which one step's records are compared: the first that differs names the
kind of divergence (a wrong loss explains wrong gradients, which explain wrong params).
``optimizer``: each tensor of the optimizer's per-parameter state after the step
(``net.0.weight.exp_avg``), a sharded parameter's state sharded alike."""

CHUNK = 1 << 22
"""Elements measured at once: a 40 M-element embedding is compared without a second copy."""


def _chunks(t: Any) -> Any:
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK]


def _wide(t: Any) -> Any:
    """``t`` in a dtype whose subtraction does not round away a bf16/fp16 difference."""
    import torch

    if t.is_complex():
        return t.to(torch.complex128)
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return t.float()
    return t if t.is_floating_point() else t.double()


def max_abs(t: Any) -> float:
    """The largest |element| of ``t`` (NaN if it holds a NaN; 0 for None or empty)."""
    if t is None or not t.numel():
        return 0.0
    if t.is_complex():
        return max(float(c.abs().max()) for c in _chunks(t))
    if t.dtype.is_floating_point or t.dtype.is_signed:
        top, bottom = float(t.detach().max()), float(t.detach().min())
        if math.isnan(top) or math.isnan(bottom):
            return math.nan
        return max(abs(top), abs(bottom))
    return float(t.detach().max())


def distance(a: Any, b: Any) -> float:
    """Largest elementwise difference; equal infinities (a mask's ``-inf``) are equal, a
    NaN equals nothing, not even a NaN (infinite distance). ``a`` is moved to ``b``'s device."""
    import torch

    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    worst = 0.0
    for x, y in zip(_chunks(a), _chunks(b)):
        x, y = _wide(x.to(y.device)), _wide(y)
        diff = torch.sub(x, y)
        diff = diff.abs() if diff.is_complex() else diff.abs_()  # a complex difference's modulus
        top = float(diff.max())
        if top != top:  # a NaN: inf - inf of equal infinities is no difference, any other NaN is
            diff = diff.masked_fill_(x == y, 0.0)
            if torch.isnan(diff).any():
                return float("inf")
            top = float(diff.max())
        worst = max(worst, top)
    return worst


def moved(start: Any, expected: Any, got: Any) -> tuple[float, float, float]:
    """How a parameter moved from ``start`` in a run (``got``) and in the reference
    (``expected``): (d_run . d_ref, d_ref . d_ref, d_run . d_run), each chunk's dot product
    in float32 (float64 parameters in float64) summed in float64: 1 - cos^2 of two moves of
    31 M float32 elements reads to ~4e-9, in a third of a second. ``start`` None: the
    tensors themselves (a gradient against the reference's)."""
    import torch

    sums = [0.0, 0.0, 0.0]
    for a, b, c in zip(_chunks(start) if start is not None else itertools.repeat(None), _chunks(expected), _chunks(got)):
        if c.is_complex():  # a complex tensor as its real and imaginary parts: one real vector
            a, b, c = (torch.view_as_real(t) if t is not None else None for t in (a, b, c))
        dtype = torch.promote_types(_wide(c).dtype, torch.float32)
        ref, run = b.to(c.device, dtype).reshape(-1), c.to(dtype).reshape(-1)
        if a is not None:
            a = a.to(c.device, dtype).reshape(-1)
            ref, run = ref - a, run - a
        for i, (x, y) in enumerate(((run, ref), (ref, ref), (run, run))):
            sums[i] += float(torch.dot(x, y))
    return sums[0], sums[1], sums[2]


def update_ratio(sums: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Over the ranks' step-0 sums of :func:`moved`: (c, 1 - cos^2), the factor the run's
    update is of the reference's (least squares) and how far from any one factor it is;
    None where nothing was measured or the reference did not move."""
    run_ref, ref_ref, run_run = (sum(s[i] for s in sums) for i in range(3))
    if not sums or ref_ref <= 0 or run_run <= 0 or not all(map(math.isfinite, (run_ref, ref_ref, run_run))):
        return None
    return run_ref / ref_ref, max(0.0, 1.0 - run_ref * run_ref / (ref_ref * run_run))


RANDOM_WALK_FROM = 16
"""The world size from which :func:`summation_ulps` grows as a random walk."""


def summation_ulps(world_size: int) -> float:
    """How many ulps (of the size of its summands) summing ``world_size`` partials may round a
    correct result by: ``W`` up to :data:`RANDOM_WALK_FROM` ranks (the worst case, what the
    tolerance sweeps calibrated), ``4 * sqrt(W)`` beyond. The roundings of a long sum are
    independent and add as a random walk, so their total grows like ``sqrt(W) u`` with high
    probability (Higham and Mary, "A new approach to probabilistic rounding error analysis",
    SIAM J. Sci. Comput. 2019); the worst case ``W u`` would pass the value itself in bf16 from
    W = 128 on (2^7 ulps of 2^-7), leaving no tolerance that tells anything from anything.
    The twin's nudge and the tolerance's floor both use this one figure."""
    if world_size <= RANDOM_WALK_FROM:
        return float(world_size)
    return math.sqrt(RANDOM_WALK_FROM * world_size)


def mismatch(expected: Any, got: Any) -> str:
    """Why :func:`distance` found ``got`` infinitely far from ``expected``, in words."""
    import torch

    if got is None:
        return "missing (the reference has one)"
    if expected is None:
        return "present (the reference has none)"
    if expected.shape != got.shape:
        return f"shape {list(got.shape)} (the reference's is {list(expected.shape)})"
    if bool(torch.isnan(got).any()):
        return "NaN (the reference's is a number)" if not bool(torch.isnan(expected).any()) else "NaN"
    return "infinite (the reference's is finite)"


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of the reference at one step."""

    value: float
    """Its largest magnitude (0 for a tensor that is None)."""
    floating: bool
    """Floating point (compared within a tolerance); integers and None compare exactly."""
    noise: float = 0.0
    """The calibration twin's distance to it (see :mod:`ddparity.checks.tolerance`)."""
    scale: float = 0.0
    """Losses and gradients: the size of the summands DDP adds (the twin's own magnitude
    where unknown)."""


@dataclass
class Reference:
    """The single-device reference, summarised: what runs are judged against."""

    steps: list[dict[tuple[str, str], Entry]] = field(default_factory=list)
    """Per step, ``(kind, name) -> Entry`` in comparison order (kind, then model order)."""
    stepped: list[bool] = field(default_factory=list)
    """Whether the optimizer stepped (a GradScaler skips steps whose gradients overflowed)."""
    batch_sizes: list[int] = field(default_factory=list)
    dropout_calls: int = 0
    """The most dropout calls one step made (each given the same mask per sample in every mode)."""
    autocast_dtype: str | None = None
    """The lowest precision autocast computed in ("bfloat16", "float16"), if any."""
    optimizer_dtype: str | None = None
    """A lower precision than the parameters' that the optimizer step computed in, if any
    (Muon's bf16 Newton-Schulz iteration)."""
    changed_outside: dict[int, dict[str, str]] = field(default_factory=dict)
    """Per step, the parameters the step changed in place outside ``optimizer.step()`` (by
    name, with what holds them: ``"Embedding(max_norm=1.0)"``)."""
    grad_hooks: list[str] = field(default_factory=list)
    """The parameters whose gradient the user's model hooks (``p.register_hook``)."""
    settings: dict[int, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    """Per step, the optimizer's numeric settings as its step ended, one value per param group."""
    update_noise: tuple[float, float] | None = None
    """The calibration twin's step-0 move against the reference's (:func:`update_ratio`:
    factor, 1 - cos^2): how far from one factor rounding alone leaves a correct update."""
    non_finite: tuple[int, str, str, float] | None = None
    """The first NaN or inf in the loss, gradients or parameters: (step, kind, name, value)."""
    params: int = 0
    """How many parameter tensors the model has."""
    layer_types: dict[str, str] = field(default_factory=dict)
    """The class of every layer that keeps running statistics (BatchNorm's), by its name."""

    def entries(self, step: int, kind: str) -> list[tuple[str, Entry]]:
        return [(name, e) for (k, name), e in self.steps[step].items() if k == kind]


@dataclass
class Distances:
    """One run's (one rank's) distance to the reference, per step and tensor."""

    mode: str
    rank: int
    world_size: int
    steps: list[dict[tuple[str, str], float]] = field(default_factory=list)
    mismatches: dict[tuple[int, str, str], str] = field(default_factory=dict)
    """Why a distance is infinite (a tensor missing, another shape, a NaN), by (step, kind, name)."""
    unsharded: list[str] = field(default_factory=list)
    """Under FSDP: the parameters left out of sharding (compared whole)."""
    computed_dtype: str | None = None
    """Under FSDP: a lower precision than the parameters' that the run computed in (its
    ``MixedPrecisionPolicy``'s ``param_dtype``), e.g. ``"bfloat16"``."""
    compiled: Any = None
    """A compiled run: what compiling did (a :class:`~ddparity.compile_spec.CompileSummary`)."""
    forwards: dict[int, tuple[int, int]] | None = None
    """Under DDP: per step, how many times DDP's own forward ran and how many of those with
    gradient sync on (a step absent: its forward never ran; None: not a DDP run)."""
    accumulated: dict[int, int] | None = None
    """Under DDP: per step, the most forwards with gradient sync on in a row with no parameter
    changed between them (micro-batches accumulated without ``no_sync()``)."""
    bypassed: dict[int, list[str]] | None = None
    """Under DDP: per step, the parameters whose gradient reached ``optimizer.step()`` from a
    backward that no DDP forward with gradient sync on preceded (steps with none left out)."""
    grad_bytes: int = 0
    """Under DDP: the bytes of gradient one all-reduce of every bucket sends (the
    parameters that require grad)."""
    moved: tuple[float, float, float] | None = None
    """How this rank's parameters moved in step 0 against the reference's (:func:`moved`,
    summed over them): what an update that differs with the same gradients is scaled by."""
    settings: dict[int, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    """Per step, this rank's optimizer settings as its step ended (the reference's :attr:`Reference.settings`)."""
    grad_dots: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    """By step, this rank's gradients (its shards under FSDP) against the reference's
    (:func:`moved` from nothing, summed over them): the one factor they are of it, if any."""

    def not_held(self, step: int, key: tuple[str, str]) -> None:
        """Optimizer state this rank does not hold (a ``ZeroRedundancyOptimizer``'s other
        partitions, a parameter it never stepped): nothing to compare, and no divergence
        (what it would have done shows in the parameters)."""
        while len(self.steps) <= step:
            self.steps.append({})
        self.steps[step][key] = 0.0

    def compare(self, step: int, key: tuple[str, str], expected: Any, got: Any) -> None:
        """Record ``got``'s distance to the reference's ``expected`` (and why, if infinite)."""
        while len(self.steps) <= step:
            self.steps.append({})
        far = self.steps[step][key] = distance(expected, got)
        if far == math.inf:
            self.mismatches[(step, key[0], key[1])] = mismatch(expected, got)
