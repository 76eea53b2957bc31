"""Tolerances, named and explained.

``auto`` calibrates a noise floor from the reference itself. Data parallelism changes
*where* the batch is summed (per-shard partial sums, then an all-reduce), never *what* is
computed, so a correct DDP run differs from the reference only by floating-point
rounding. The reference is therefore run a second time, as a *calibration twin*:

* on every global batch in reversed sample order — the same mathematics for any model
  that treats the batch as a set (BatchNorm and mean or sum losses included, so their
  misuse is *not* absorbed into the floor), summed in another order;
* in float32 and float64, on a batch moved by an ulp of each element (the last bits
  kernels of another batch size change, which a cancelled sum is made of alone:
  :func:`~ddparity.harness.ranks.modes.twin.jittered`), or, for token ids, on the rows the
  embeddings look up (:func:`~ddparity.harness.ranks.modes.twin.jitter_embeddings`);
* with every gradient nudged towards zero, before each optimizer step, by the rounding a
  W-rank run may add: W ulps of the size of its summands (per-sample gradients through
  ``torch.func``, or per-shard ones where those are not defined). Rounding a sum scales
  with its terms, which can be far larger than a cancelling result; and Adam-like
  optimizers turn ulps of a near-zero gradient into visible update differences that
  later steps carry on.

The twin's distance to the reference, step by step and tensor by tensor, is then the
noise a correct run may show, including what the optimizer and later steps make of it.
The per-tensor tolerance is ``HEADROOM * max(twin distance, floor)``, the floor being an
ulp of the precision the ranks computed in or W ulps of the gradients' own dtype (where
DDP sums them), whichever is larger, of the summands' size (losses, gradients) or of the tensor (params,
buffers), and never less than that of the tensor itself (a batch-coupled loss has per-sample terms of
size 0) nor than the dtype's smallest normal number: a tolerance is never 0. Ulps are of
the lowest precision the run computed in (bf16 or fp16 autocast, a bf16 model). Where the
optimizer step computes in a lower precision than the gradients (Muon's bf16 Newton-Schulz
products), the twin's optimizer is given gradients moved by an ulp of that precision, after
they are recorded, and its own products rounded as a sharded run rounds them, which no
reordering of the batch shows (:mod:`~ddparity.harness.ranks.modes.twin_optimizer`); the
step-0 update is then judged as a whole too, by its factor (:data:`UPDATE_SHARE`).

Where the twin's first gradients differ from the reference's by more than rounding can
(at least half the size of a gradient that is well above rounding), the step depends on something beside the
batch as a set — the order of its samples, randomness, state — and no noise floor can be
calibrated: the tolerance says where (:class:`Uncalibrated`) and runs are compared only
up to that step, never passed on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ddparity.distances import RECORD_KINDS, Reference, distance, max_abs, summation_ulps  # noqa: F401 - the measures, re-exported

HEADROOM = 32.0
"""The twin samples *one* reordering; DDP is another. Across our sweep
(``benchmarks/tolerance_sweep.py``: the demo MLP, CNN and transformer block, and MLPs of
three shapes with SGD/Adam/AdamW in float32 and float64, at world sizes 2, 3, 4 and 8)
a correct DDP run came at most 3.8x the twin's distance (Adam). 32x leaves an 8x margin
above that and stays far below the error of real bugs: the bug fixtures land 271
(BatchNorm on 4 shards, first divergence) to 6.6e4 (summed loss) tolerances away."""


LOW_PRECISION_HEADROOM = 8.0
"""The headroom in bf16/fp16 (autocast or a low-precision model). Their ulps are 2^16
times float32's, so 32x the floor would be a tolerance of half the value compared at
four ranks, far above the rounding such runs show (gradients 0.4-1% apart, AdamW
parameters up to ~10% element-wise, at 2 and 4 ranks) and wide enough to pass a summed
loss. 8x keeps the tolerance a fraction of the value and still above that noise."""

SHARE_CAP = 0.25
"""The most a tolerance may be of the value compared, for a loss or gradient of step 0 (where
every mode starts from the same parameters; later, Adam may turn rounding into whole
steps) that is not a cancelled sum (no smaller than its summands). The floor grows with the world size (W ulps,
a worst case of summing W partials), and in bf16 W ulps times the headroom pass the value
itself from W = 16 on; a summed loss, a per-rank normalisation or a missed division by W
is off by at least half the value at any W >= 2, so a tolerance of a quarter still tells
it by 2x. Where the twin's own noise leaves no room under the cap (:data:`CAP_ROOM`), the
run is too imprecise to judge at that world size and says so (:class:`Uncalibrated`)."""

NEGLIGIBLE_SHARE = 1 / 64
"""The most a tensor may be of the largest of its kind and still count as rounding (so go
uncapped). Rounding is :func:`summation_ulps` ulps of the largest; in bf16 those reach the
largest itself from W = 128 on, where *every* tensor, the largest included, would count as
rounding and no cap would hold: a summed loss passed at simulated 128, 256 and 512. 1/64 is
bf16's rounding at 2 ranks, so nothing changes where the sweeps calibrated it."""

LOSS_SLACK = 0.1
"""How far below its per-sample terms' mean size a loss may be and still count as no cancelled
sum (so be capped). The terms are measured in a per-sample pass where dropout draws torch's
own masks, not the step's: a clean dropout model's bf16 loss came 3.5% below them, went
uncapped, and its tolerance passed the loss's own size at 16 ranks. A loss whose terms do
cancel (of both signs) is far below their mean size."""

CAP_ROOM = 2.0
"""A capped tolerance must stay this many times above the twin's measured noise."""

UPDATE_SHARE = 0.25
"""How far from 1 the factor of each rank's step-0 update may be (least squares over every
parameter's move on that rank, its own shards under FSDP2, against the reference's move of
the same elements), judged where the optimizer computes in a lower
precision than the gradients. There the twin rounds the optimizer's products as a sharded
run does (:mod:`~ddparity.harness.ranks.modes.twin_optimizer`), a few % of the update, so the
parameters' tolerances at step 0 may exceed the update itself and a learning rate x W passed
them. A factor is what such rounding leaves alone: over seeds 0-7 of Muon under fsdp and
hsdp at 2 and 4 ranks, a correct rank's came within 0.006 of 1 and lr x W's within 0.02 of W;
a data-parallel bug that scales the update (lr x W, a summed loss under SGD, a rate doubled
on one rank) is off by at least 1 at W >= 2 on the ranks it reaches, so a quarter tells it by
4x. Not judged where the twin's own factor leaves no room under it (:data:`CAP_ROOM`)."""

COMPILED_ERROR_RATIO = 15.0
"""How far a compiled run's error against float64 may exceed the eager reference's own, per
tensor (:func:`compiled_tolerance`). torch's minifier allows 2x (3x in low precision) of the
*root mean square* error; ddparity compares the *largest* element's error, which a few fused
elements decide: inductor's GPT-2 (initializer range 1.0) came 4.5x the reference's own
float64 error on one bias (an AVX2 CPU); the fixed 0.1%-of-the-value floor this replaced failed
a clean compiled GPT-2 at 1.07x on an AVX512 CPU. 15x leaves a 3x margin above that and stays orders of magnitude
under a wrong decomposition's error."""
COMPILE_SHARE = 1e-3
"""Without a float64 run, the least tolerance of a compiled single-device run against the eager
reference, as a share of each tensor's largest value (see :func:`compiled_tolerance`)."""
OPTIMIZER_SHARE = 1e-2
"""The least tolerance of an optimizer state tensor, as a share of its largest value. The
state follows the gradients compared before it (Adam's second moment squares their
rounding: a correct 3-rank run came 1.07x over the calibrated tolerance, 4e-5 of the
value, in the random search of tests/test_check.py); what comparing it is for is state
lost, reset or another parameter's, off by the order of the state itself."""

UNCALIBRATED_SHARE = 0.5
"""A twin this far from the reference, relative to the value, is not rounding."""
ABOVE_ROUNDING = 1e4
"""A tensor larger than this many ulps of the largest tensor of its kind in the step is
well above rounding (so its twin distance is not); below, it may be a cancelled sum, such
as the gradient of a bias that BatchNorm follows."""


@dataclass(frozen=True)
class Uncalibrated:
    """The first place where the twin differs from the reference by more than rounding."""

    step: int
    kind: str
    name: str
    noise: float
    value: float
    world_size: int = 0
    """Set when the run is too imprecise at this world size (the cap), not order-dependent."""
    bound: float = 0.0
    """Set when no step-0 loss or gradient has a tolerance below its own size: the rounding
    bound itself (the tolerance of ``name``), not the twin's noise, leaves nothing to judge."""

    def reason(self) -> str:
        if self.bound:
            return (f"too imprecise to judge at world size {self.world_size}: the rounding that summing "
                    f"{self.world_size} partials may add in this precision makes every tolerance of step 0 "
                    f"larger than the value it bounds ({self.kind} {self.name!r}: {self.bound:.3g}, "
                    f"{self.bound / self.value:.3g}x its size {self.value:.3g}), so no wrong loss or gradient "
                    f"would show; check in a higher precision (float32) or at a smaller world size")
        if self.world_size:
            return (f"too imprecise to judge at world size {self.world_size} from step {self.step} on: rounding "
                    f"noise in {self.kind} {self.name!r} (the calibration twin differs by {self.noise:.3g}, "
                    f"{self.noise / self.value:.0%} of its size {self.value:.3g}) leaves no tolerance that would "
                    f"still catch a summed loss or a missed division by the world size; check in a higher "
                    f"precision (float32) or at a smaller world size")
        return (f"no tolerance can be calibrated from step {self.step} on: the calibration twin (the same "
                f"training on the batch in reversed order) differs from the reference in {self.kind} "
                f"{self.name!r} by {self.noise:.3g}, {self.noise / self.value:.0%} of its size {self.value:.3g}, "
                f"far more than rounding; the step depends on the order of the samples in the batch (or on "
                f"randomness or state outside the batch), which data parallelism does not keep")


@dataclass(frozen=True)
class Tolerance:
    """Absolute tolerance per (step, kind, tensor name)."""

    description: str
    table: dict[tuple[int, str, str], float]
    uncalibrated: Uncalibrated | None = None
    loose: str | None = None
    """Why some kind is judged only loosely (every step-0 gradient's tolerance above its size
    while the loss is judged tightly): a note for the run, never a verdict."""
    eps: float = 0.0
    """The ulp of the precision the run was judged in (0: not known): how exactly a bug's
    numeric signature, such as a loss off by ``1 - 1/W``, can hold in it."""
    update: float = 0.0
    """How far from 1 the factor of the run's step-0 update may be (0: not judged; see
    :data:`UPDATE_SHARE`)."""

    def __call__(self, step: int, kind: str, name: str) -> float:
        return self.table.get((step, kind, name), 0.0)


def auto_tolerance(reference: Reference, world_size: int, dtype: Any, run_dtype: str | None = None,
                   policy_noise: list[dict[tuple[str, str], float]] | None = None) -> Tolerance:
    """Calibrated tolerance for a run of ``world_size`` ranks against ``reference`` (its
    entries carry their twin's distance and summand size; ``dtype``: the parameters';
    autocast's, when the reference ran in a lower one). ``run_dtype``: a lower precision
    the run itself computed and reduced in while the reference did not (FSDP's
    ``MixedPrecisionPolicy``: bf16 parameters, and gradients reduced in bf16 or fp32) —
    its ulps, in the computation and in the sum, bound the noise, as a bf16 autocast's do.
    ``policy_noise``: per step and tensor, the distance of a one-rank run under that same
    policy to the reference — the policy's own numerics (data-parallel bugs vanish at one
    rank; a tensor it lacks or gets infinitely wrong is not noise), counted as the twin's
    noise is."""
    import torch

    eps_sum = torch.finfo(dtype).eps  # DDP sums the gradients in their own dtype, the parameters'
    if run_dtype:
        low = getattr(torch, run_dtype)
        eps_sum = max(eps_sum, torch.finfo(low).eps)  # the reduce dtype is not seen: assume the low one
        dtype = low if torch.finfo(low).eps > torch.finfo(dtype).eps else dtype
    if reference.autocast_dtype:
        low = getattr(torch, reference.autocast_dtype)
        dtype = low if torch.finfo(low).eps > torch.finfo(dtype).eps else dtype
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    headroom = HEADROOM if eps < 1e-6 else LOW_PRECISION_HEADROOM
    walk = summation_ulps(world_size)
    slack = {"grad": max(1e-3, 2 * eps), "loss": max(LOSS_SLACK, 2 * eps)}
    table: dict[tuple[int, str, str], float] = {}
    uncalibrated = imprecise = None
    for step in range(len(reference.steps)):
        for kind in RECORD_KINDS:
            ref_e = reference.entries(step, kind)
            largest = max((e.value for _, e in ref_e), default=0.0)
            # a tensor this small is rounding (a softmax-invariant bias)
            negligible = min(walk * eps, NEGLIGIBLE_SHARE) * largest
            rounding = ABOVE_ROUNDING * negligible
            for name, e in ref_e:
                if not e.floating:
                    table[(step, kind, name)] = 0.0  # integers (counters) and None compare exactly
                    continue
                noise, value = e.noise, e.value
                if policy_noise is not None and step < len(policy_noise):
                    own = policy_noise[step].get((kind, name), 0.0)
                    noise = max(noise, own if math.isfinite(own) else 0.0)
                # Each rank computes its partial in the lowest precision (an ulp of it), and
                # summing W partials rounds by up to ~W ulps of the partials' size in the
                # gradients' dtype (not of the result's: partial gradients can cancel); the
                # larger of the two, the headroom covering their sum.
                scale = e.scale if kind in ("loss", "grad") and math.isfinite(e.scale) else 0.0
                floor = max(max(eps, walk * eps_sum) * max(scale, value), tiny)
                tolerance = headroom * max(noise, floor)
                if kind == "optimizer":
                    tolerance = max(tolerance, OPTIMIZER_SHARE * value)
                if (step == 0 and kind in ("loss", "grad") and value > negligible and value >= (1 - slack[kind]) * scale
                        and tolerance > SHARE_CAP * value):
                    tolerance = SHARE_CAP * value
                    if imprecise is None and CAP_ROOM * noise > tolerance:
                        imprecise = Uncalibrated(step, kind, name, noise, value, world_size)
                table[(step, kind, name)] = tolerance
                # At step 0 both start from the same parameters: their gradients differ by
                # reordering and the nudge only (later, Adam may turn rounding into whole steps).
                if (uncalibrated is None and step == 0 and kind == "grad" and noise >= UNCALIBRATED_SHARE * value
                        and value > rounding):
                    uncalibrated = Uncalibrated(step, kind, name, noise, value)
    imprecise = imprecise or _vacuous(reference, table, world_size, ("loss", "grad"))
    if imprecise is not None and (uncalibrated is None or imprecise.step < uncalibrated.step):
        uncalibrated = imprecise  # an order-dependent step says more than an imprecise one
    policy = f", the run's own {run_dtype} policy" if run_dtype else ""
    if reference.optimizer_dtype and world_size > 1:
        policy += f", an optimizer computing in {reference.optimizer_dtype}"
    loose = None
    if uncalibrated is None and _vacuous(reference, table, world_size, ("grad",)) is not None:
        loose = (f"gradients judged loosely: in {str(dtype).removeprefix('torch.')} at world size {world_size} the "
                 f"rounding bound of every step-0 gradient exceeds the gradient itself (they are mean-like sums of "
                 f"larger terms), so a gradient counts as diverged only beyond that; the loss is judged within a "
                 f"tolerance below its own size and the replicas' agreement bit for bit; a float32 check judges "
                 f"gradients more tightly")
    twin_update = reference.update_noise
    update = (UPDATE_SHARE if reference.optimizer_dtype and world_size > 1 and twin_update is not None
              and CAP_ROOM * abs(1 - twin_update[0]) <= UPDATE_SHARE else 0.0)
    return Tolerance(f"auto (calibrated noise floor x{headroom:g}, {dtype}{policy})", table, uncalibrated, loose, eps,
                     update)


def _vacuous(reference: Reference, table: dict[tuple[int, str, str], float], world_size: int,
             kinds: tuple[str, ...]) -> Uncalibrated | None:
    """Where no floating tensor of ``kinds`` at step 0 has a tolerance below its own size (a
    tolerance that would pass its being 0, doubled or of the other sign), the one with the
    smallest tolerance for its size, as an :class:`Uncalibrated`; else None."""
    if not reference.steps:
        return None
    tightest: tuple[float, str, str, float, float, float] | None = None
    for (kind, name), e in reference.steps[0].items():
        if kind not in kinds or not e.floating or not e.value > 0 or not math.isfinite(e.value):
            continue
        share = table[(0, kind, name)] / e.value
        if share < 1:
            return None
        if tightest is None or share < tightest[0]:
            tightest = (share, kind, name, e.noise, e.value, table[(0, kind, name)])
    if tightest is None:
        return None
    _, kind, name, noise, value, bound = tightest
    return Uncalibrated(0, kind, name, noise, value, world_size, bound)


def compiled_tolerance(tol: Tolerance, reference: Reference, dtype: Any,
                       exact: list[dict[tuple[str, str], float]] | None = None) -> Tolerance:
    """``tol`` for a compiled single-device run against the eager reference, by the rule of
    torch's accuracy minifier (``torch._dynamo.utils.same``): a compiled run is as accurate
    as eager when its error against a float64 run is within a small multiple of eager's own.
    ``exact``: per step and tensor, the reference's distance to the same training in float64
    (its rounding error, measured); a compiled run within :data:`COMPILED_ERROR_RATIO` + 1
    times that of the reference is within the ratio of float64 itself. A compiler reorders and
    fuses floating-point math inside ops (matmul blocking, fused softmax, a LayerNorm's
    reductions), by how much depends on the model and on the CPU's vector ISA; a compile that
    changes the math (a wrong decomposition) moves values by orders of magnitude more.
    Without ``exact`` (the float64 run could not run), at least :data:`COMPILE_SHARE` of each
    tensor's largest value (or 16 ulps of ``dtype``), said in the description."""
    import torch

    table = dict(tol.table)
    if exact is not None:
        for (step, kind, name), bound in tol.table.items():
            if step < len(exact):
                error = exact[step].get((kind, name), 0.0)
                if math.isfinite(error):
                    table[(step, kind, name)] = max(bound, (COMPILED_ERROR_RATIO + 1) * error)
        return Tolerance(f"{tol.description}, compiled: at least {COMPILED_ERROR_RATIO + 1:g}x the reference's own "
                         f"error against float64", table, tol.uncalibrated, tol.loose, tol.eps)
    eps = torch.finfo(dtype).eps
    if reference.autocast_dtype:
        eps = max(eps, torch.finfo(getattr(torch, reference.autocast_dtype)).eps)
    share = max(COMPILE_SHARE, 16 * eps)
    for step in range(len(reference.steps)):
        for kind in RECORD_KINDS:
            for name, e in reference.entries(step, kind):
                if e.floating and (step, kind, name) in table:
                    table[(step, kind, name)] = max(table[(step, kind, name)], share * e.value)
    return Tolerance(f"{tol.description}, compiled: at least {share:.2g} of each tensor (no float64 run)", table,
                     tol.uncalibrated, tol.loose, tol.eps)


def fixed_tolerance(reference: Reference, relative: float) -> Tolerance:
    """``relative`` times each tensor's largest magnitude; ``0`` demands bit-exactness."""
    table: dict[tuple[int, str, str], float] = {}
    for step, entries in enumerate(reference.steps):
        for (kind, name), e in entries.items():
            table[(step, kind, name)] = relative * e.value
    return Tolerance(f"fixed relative {relative:g}", table)


def larger_floors(floors: list[list[dict[tuple[str, str], float]]]) -> list[dict[tuple[str, str], float]]:
    """Per step and tensor, the larger of the noise floors' distances."""
    out: list[dict[tuple[str, str], float]] = []
    for steps in floors:
        for step, distances in enumerate(steps):
            if step == len(out):
                out.append({})
            for key, far in distances.items():
                out[step][key] = max(out[step].get(key, 0.0), far)
    return out
