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
