"""compare(): first divergence and worst offenders on hand-made traces."""

from __future__ import annotations

import math

import torch

from ddparity.checks.equivalence import divergences, first_non_finite, worst
from ddparity.checks.tolerance import HEADROOM, auto_tolerance, distance, fixed_tolerance
from ddparity.trace import StepRecord, Trace


def make_trace(steps=3, rank=0, bump=None, value=1.0):
    trace = Trace(mode="ddp", rank=rank, world_size=2)
    for step in range(steps):
        rec = StepRecord(
            loss=torch.tensor(value),
            grads={"a.weight": torch.full((2, 2), value), "b.bias": torch.full((2,), value)},
            params={"a.weight": torch.full((2, 2), value), "b.bias": torch.full((2,), value)},
            buffers={"bn.running_mean": torch.full((2,), value)},
        )
        if bump and bump[0] == step:
            _, kind, name, delta = bump
            target = rec.tensors(kind)
            if kind == "loss":
                rec.loss = rec.loss + delta
            else:
                target[name] = target[name] + delta
        trace.steps.append(rec)
    return trace


def test_identical_traces_do_not_diverge_even_with_zero_tolerance():
    ref = make_trace()
    assert divergences(ref, [make_trace(rank=0), make_trace(rank=1)], fixed_tolerance(ref, 0.0)) == []


def test_first_divergence_names_step_kind_tensor_and_rank():
    ref = make_trace()
    runs = [make_trace(rank=0), make_trace(rank=1, bump=(1, "grad", "b.bias", 0.5))]
    found = divergences(ref, runs, fixed_tolerance(ref, 1e-3))
    first = found[0]
    assert (first.step, first.kind, first.name, first.rank) == (1, "grad", "b.bias", 1)
    assert math.isclose(first.max_abs, 0.5)
    assert math.isclose(first.max_rel, 0.5)
    assert math.isclose(first.tolerance, 1e-3)


def test_earlier_kind_wins_within_a_step():
    ref = make_trace()
    runs = [make_trace(bump=(2, "param", "a.weight", 1.0)), make_trace(rank=1, bump=(2, "loss", "loss", 1.0))]
    first = divergences(ref, runs, fixed_tolerance(ref, 1e-3))[0]
    assert (first.step, first.kind) == (2, "loss")


def test_worst_offenders_rank_by_excess_once_per_tensor():
    ref = make_trace()
    runs = [make_trace(bump=(0, "grad", "a.weight", 0.1)), make_trace(rank=1, bump=(0, "buffer", "bn.running_mean", 5.0))]
    found = divergences(ref, runs, fixed_tolerance(ref, 1e-3))
    top = worst(found)
    assert [(d.kind, d.name) for d in top] == [("buffer", "bn.running_mean"), ("grad", "a.weight")]


def test_a_nan_equals_nothing_not_even_a_nan_but_equal_infinities_are_equal():
    a = torch.tensor([1.0, float("nan")])
    assert distance(a, a.clone()) == math.inf  # SPEC: a NaN never equals a NaN
    assert distance(torch.tensor([1.0, 2.0]), a) == math.inf
    mask = torch.tensor([0.0, float("-inf")])  # an attention mask kept as a buffer
    assert distance(mask, mask.clone()) == 0.0
    assert distance(mask, torch.tensor([0.0, float("inf")])) == math.inf
    assert distance(None, None) == 0.0
    assert distance(torch.ones(2), None) == math.inf
    assert distance(torch.ones(2), torch.ones(3)) == math.inf


def test_auto_tolerance_is_calibrated_noise_times_headroom_with_an_ulp_floor():
    ref = make_trace()
    permuted = make_trace(bump=(1, "grad", "a.weight", 1e-4))
    tol = auto_tolerance(ref, permuted, world_size=4, dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    assert math.isclose(tol(1, "grad", "a.weight"), HEADROOM * 1e-4, rel_tol=1e-3)
    assert math.isclose(tol(0, "grad", "a.weight"), HEADROOM * 4 * eps * 1.0)
    tol64 = auto_tolerance(ref, make_trace(), world_size=4, dtype=torch.float64)
    assert tol64(0, "grad", "a.weight") < tol(0, "grad", "a.weight")


def test_the_first_non_finite_loss_gradient_or_parameter_of_the_reference_is_named():
    ref = make_trace()
    assert first_non_finite(ref) is None
    ref.steps[1].grads["a.weight"] = torch.tensor([[1.0, float("nan")]])
    ref.steps[1].buffers = {"mask": torch.tensor([float("-inf")])}  # buffers may hold infinities
    found = first_non_finite(ref)
    assert (found.step, found.kind, found.name) == (1, "grad", "a.weight") and math.isnan(found.value)
    assert "step 1" in found.reason() and "'a.weight'" in found.reason()
    assert divergences(ref, [ref], fixed_tolerance(ref, 0.0), until=found.step) == []


def test_a_tolerance_is_never_zero_for_floating_point_values():
    """A batch-coupled loss has per-sample terms of size 0, and a tensor can be exactly 0:
    the floor is still W ulps of the value, and never below the smallest normal number."""
    ref = make_trace(value=0.0)
    twin = make_trace(value=0.0)
    for record in twin.steps:
        record.loss_scale = torch.tensor(0.0, dtype=torch.float64)
        record.grad_scales = {"a.weight": torch.zeros(2, 2, dtype=torch.float64)}
    tol = auto_tolerance(ref, twin, world_size=4, dtype=torch.float32)
    assert all(value > 0 for value in tol.table.values())
    assert tol(0, "loss", "loss") == HEADROOM * torch.finfo(torch.float32).tiny
    scaled_twin = make_trace(value=3.0)
    for record in scaled_twin.steps:
        record.loss_scale = torch.tensor(0.0, dtype=torch.float64)
    coupled = auto_tolerance(make_trace(value=3.0), scaled_twin, world_size=4, dtype=torch.float32)
    assert math.isclose(coupled(0, "loss", "loss"), HEADROOM * 4 * torch.finfo(torch.float32).eps * 3.0)


def test_low_precision_computes_with_its_own_ulps_and_a_smaller_headroom():
    from ddparity.checks.tolerance import LOW_PRECISION_HEADROOM

    ref, twin = make_trace(), make_trace()
    ref.autocast_dtype = "bfloat16"
    tol = auto_tolerance(ref, twin, world_size=4, dtype=torch.float32)
    bf16 = torch.finfo(torch.bfloat16).eps
    assert math.isclose(tol(0, "grad", "a.weight"), LOW_PRECISION_HEADROOM * 4 * bf16)
    assert tol(0, "grad", "a.weight") < 0.5  # never as large as the value (1.0) it compares
    assert "bfloat16" in tol.description


def test_a_twin_far_from_the_reference_is_uncalibrated_not_a_wider_tolerance():
    ref = make_trace()
    twin = make_trace(bump=(0, "grad", "a.weight", 0.7))
    tol = auto_tolerance(ref, twin, world_size=2, dtype=torch.float32)
    assert (tol.uncalibrated.step, tol.uncalibrated.kind, tol.uncalibrated.name) == (0, "grad", "a.weight")
    assert "no tolerance can be calibrated from step 0 on" in tol.uncalibrated.reason()
    assert "70% of its size" in tol.uncalibrated.reason()
    # later parameters may legitimately differ by whole Adam steps (a bias that starts at 0)
    later = auto_tolerance(ref, make_trace(bump=(1, "param", "a.weight", 0.7)), world_size=2, dtype=torch.float32)
    assert later.uncalibrated is None and later(1, "param", "a.weight") > 0.7
    # a tensor at rounding level next to the others (a cancelled sum): its twin distance is rounding too
    ref, twin = make_trace(), make_trace()
    ref.steps[0].grads["b.bias"] = torch.full((2,), 1e-9)
    twin.steps[0].grads["b.bias"] = torch.full((2,), -1e-9)
    assert auto_tolerance(ref, twin, world_size=2, dtype=torch.float32).uncalibrated is None


def test_a_tolerance_is_never_nan_even_when_the_twins_magnitudes_blew_up():
    twin = make_trace()
    for record in twin.steps:
        record.loss_scale = torch.tensor(float("nan"), dtype=torch.float64)
        record.grad_scales = {"a.weight": torch.full((2, 2), float("inf"), dtype=torch.float64)}
    tol = auto_tolerance(make_trace(), twin, world_size=2, dtype=torch.float32)
    assert all(math.isfinite(v) and v > 0 for v in tol.table.values())
