"""compare(): first divergence and worst offenders on hand-made traces."""

from __future__ import annotations

import math

import torch

from ddparity.checks.equivalence import divergences, first_non_finite, worst
from ddparity.checks.tolerance import HEADROOM, auto_tolerance, distance, fixed_tolerance
from ddparity.distances import Distances, Entry, Reference

KEYS = [("loss", "loss"), ("grad", "a.weight"), ("grad", "b.bias"), ("param", "a.weight"), ("param", "b.bias"),
        ("buffer", "bn.running_mean")]


def make_reference(steps=3, value=1.0, noise=None, scale=None):
    """A reference of ``steps`` steps, every tensor of magnitude ``value``; ``noise`` and
    ``scale``: (step, kind, name) -> its twin's distance and summand size (default: none,
    and the value)."""
    noise, scale = noise or {}, scale or {}
    ref = Reference(stepped=[True] * steps, params=2)
    for step in range(steps):
        ref.steps.append({k: Entry(value, True, noise.get((step, *k), 0.0), scale.get((step, *k), value))
                          for k in KEYS})
    return ref


def make_run(steps=3, rank=0, bump=None):
    """A run at distance 0 from the reference everywhere but ``bump`` (step, kind, name, distance)."""
    run = Distances("ddp", rank, 2, steps=[{k: 0.0 for k in KEYS} for _ in range(steps)])
    if bump:
        step, kind, name, delta = bump
        run.steps[step][(kind, name)] = delta
    return run


def test_identical_traces_do_not_diverge_even_with_zero_tolerance():
    ref = make_reference()
    assert divergences(ref, [make_run(rank=0), make_run(rank=1)], fixed_tolerance(ref, 0.0)) == []


def test_first_divergence_names_step_kind_tensor_and_rank():
    ref = make_reference()
    runs = [make_run(rank=0), make_run(rank=1, bump=(1, "grad", "b.bias", 0.5))]
    found = divergences(ref, runs, fixed_tolerance(ref, 1e-3))
    first = found[0]
    assert (first.step, first.kind, first.name, first.rank) == (1, "grad", "b.bias", 1)
    assert math.isclose(first.max_abs, 0.5)
    assert math.isclose(first.max_rel, 0.5)
    assert math.isclose(first.tolerance, 1e-3)


def test_earlier_kind_wins_within_a_step():
    ref = make_reference()
    runs = [make_run(bump=(2, "param", "a.weight", 1.0)), make_run(rank=1, bump=(2, "loss", "loss", 1.0))]
    first = divergences(ref, runs, fixed_tolerance(ref, 1e-3))[0]
    assert (first.step, first.kind) == (2, "loss")


def test_worst_offenders_rank_by_excess_once_per_tensor():
    ref = make_reference()
    runs = [make_run(bump=(0, "grad", "a.weight", 0.1)), make_run(rank=1, bump=(0, "buffer", "bn.running_mean", 5.0))]
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


def test_a_run_that_never_compared_a_tensor_diverges_there():
    ref = make_reference()
    run = make_run()
    del run.steps[1][("grad", "b.bias")]
    found = divergences(ref, [run], fixed_tolerance(ref, 1e-3))
    assert [(d.step, d.kind, d.name, d.max_abs) for d in found] == [(1, "grad", "b.bias", math.inf)]


def test_auto_tolerance_is_calibrated_noise_times_headroom_with_an_ulp_floor():
    ref = make_reference(noise={(1, "grad", "a.weight"): 1e-4})
    tol = auto_tolerance(ref, world_size=4, dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    assert math.isclose(tol(1, "grad", "a.weight"), HEADROOM * 1e-4, rel_tol=1e-3)
    assert math.isclose(tol(0, "grad", "a.weight"), HEADROOM * 4 * eps * 1.0)
    tol64 = auto_tolerance(make_reference(), world_size=4, dtype=torch.float64)
    assert tol64(0, "grad", "a.weight") < tol(0, "grad", "a.weight")


def test_the_first_non_finite_value_the_reference_wrote_is_named():
    ref = make_reference()
    assert first_non_finite(ref) is None
    ref.non_finite = (1, "grad", "a.weight", math.nan)
    found = first_non_finite(ref)
    assert (found.step, found.kind, found.name) == (1, "grad", "a.weight") and math.isnan(found.value)
    assert "step 1" in found.reason() and "'a.weight'" in found.reason()
    assert divergences(ref, [make_run(bump=(1, "grad", "a.weight", math.inf))], fixed_tolerance(ref, 0.0),
                       until=found.step) == []


def test_a_tolerance_is_never_zero_for_floating_point_values():
    """A batch-coupled loss has per-sample terms of size 0, and a tensor can be exactly 0:
    the floor is still W ulps of the value, and never below the smallest normal number."""
    tol = auto_tolerance(make_reference(value=0.0, scale={(0, "loss", "loss"): 0.0}), world_size=4,
                         dtype=torch.float32)
    assert all(value > 0 for value in tol.table.values())
    assert tol(0, "loss", "loss") == HEADROOM * torch.finfo(torch.float32).tiny
    coupled = auto_tolerance(make_reference(value=3.0, scale={(0, "loss", "loss"): 0.0}), world_size=4,
                             dtype=torch.float32)
    assert math.isclose(coupled(0, "loss", "loss"), HEADROOM * 4 * torch.finfo(torch.float32).eps * 3.0)


def test_integers_and_missing_tensors_compare_exactly():
    ref = make_reference()
    ref.steps[0][("buffer", "bn.num_batches_tracked")] = Entry(1.0, False)
    ref.steps[0][("grad", "frozen.weight")] = Entry(0.0, False)  # no gradient in the reference
    tol = auto_tolerance(ref, world_size=2, dtype=torch.float32)
    assert tol(0, "buffer", "bn.num_batches_tracked") == 0.0 and tol(0, "grad", "frozen.weight") == 0.0


def test_low_precision_computes_with_its_own_ulps_and_a_smaller_headroom():
    from ddparity.checks.tolerance import LOW_PRECISION_HEADROOM

    ref = make_reference()
    ref.autocast_dtype = "bfloat16"
    tol = auto_tolerance(ref, world_size=4, dtype=torch.float32)
    bf16 = torch.finfo(torch.bfloat16).eps
    # autocast: each rank's partial rounds in bf16 once; DDP sums them in float32
    assert math.isclose(tol(0, "grad", "a.weight"), LOW_PRECISION_HEADROOM * bf16)
    assert "bfloat16" in tol.description
    # a bf16 model: the partials are summed in bf16 too, W ulps of it
    model = auto_tolerance(make_reference(), world_size=4, dtype=torch.bfloat16)
    assert math.isclose(model(0, "grad", "a.weight"), LOW_PRECISION_HEADROOM * 4 * bf16)
    # and never above a quarter of the value (1.0) where that would pass a summed loss
    for ws in (8, 16, 64):
        wide = auto_tolerance(make_reference(), world_size=ws, dtype=torch.bfloat16)
        assert wide(0, "grad", "a.weight") <= 0.25 and wide(0, "loss", "loss") <= 0.25 * 1.0
        assert wide.uncalibrated is None
    # a twin whose own noise leaves no room under the cap: too imprecise, said so, never a pass
    noisy = auto_tolerance(make_reference(noise={(0, "loss", "loss"): 0.2}), world_size=16, dtype=torch.bfloat16)
    assert (noisy.uncalibrated.step, noisy.uncalibrated.kind) == (0, "loss")
    assert noisy.uncalibrated.reason().startswith("too imprecise to judge at world size 16 from step 0 on")
    # later steps are not capped: Adam may turn rounding into whole steps there
    later = auto_tolerance(make_reference(noise={(1, "grad", "a.weight"): 0.2}), world_size=16, dtype=torch.bfloat16)
    assert later.uncalibrated is None and later(1, "grad", "a.weight") > 0.25


def test_a_twin_far_from_the_reference_is_uncalibrated_not_a_wider_tolerance():
    tol = auto_tolerance(make_reference(noise={(0, "grad", "a.weight"): 0.7}), world_size=2, dtype=torch.float32)
    assert (tol.uncalibrated.step, tol.uncalibrated.kind, tol.uncalibrated.name) == (0, "grad", "a.weight")
    assert "no tolerance can be calibrated from step 0 on" in tol.uncalibrated.reason()
    assert "70% of its size" in tol.uncalibrated.reason()
    # later parameters may legitimately differ by whole Adam steps (a bias that starts at 0)
    later = auto_tolerance(make_reference(noise={(1, "param", "a.weight"): 0.7}), world_size=2, dtype=torch.float32)
    assert later.uncalibrated is None and later(1, "param", "a.weight") > 0.7
    # a tensor at rounding level next to the others (a cancelled sum): its twin distance is rounding too
    ref = make_reference(noise={(0, "grad", "b.bias"): 2e-9})
    ref.steps[0][("grad", "b.bias")] = Entry(1e-9, True, 2e-9, 1e-9)
    assert auto_tolerance(ref, world_size=2, dtype=torch.float32).uncalibrated is None


def test_a_tolerance_is_never_nan_even_when_the_twins_magnitudes_blew_up():
    ref = make_reference(scale={(s, "grad", "a.weight"): math.inf for s in range(3)}
                         | {(s, "loss", "loss"): math.nan for s in range(3)})
    tol = auto_tolerance(ref, world_size=2, dtype=torch.float32)
    assert all(math.isfinite(v) and v > 0 for v in tol.table.values())


def test_an_infinite_distance_says_why():
    from ddparity.distances import mismatch

    one = torch.ones(3)
    assert mismatch(one, None) == "missing (the reference has one)"
    assert mismatch(None, one) == "present (the reference has none)"
    assert mismatch(one, torch.ones(2)) == "shape [2] (the reference's is [3])"
    assert mismatch(one, torch.tensor([1.0, math.nan, 1.0])) == "NaN (the reference's is a number)"
    run = Distances("ddp", 1, 2)
    run.compare(0, ("grad", "a.weight"), one, None)
    run.compare(0, ("grad", "b.bias"), one, one)
    assert run.steps == [{("grad", "a.weight"): math.inf, ("grad", "b.bias"): 0.0}]
    assert run.mismatches == {(0, "grad", "a.weight"): "missing (the reference has one)"}


def _moved_by(factor, rank=0, size=100.0):
    """A rank's step-0 sums of ``distances.moved`` for an update ``factor`` x the reference's
    (the same direction): (run . ref, ref . ref, run . run)."""
    run = make_run(rank=rank)
    run.moved = (factor * size, size, factor * factor * size)
    return run


def test_a_low_precision_optimizers_update_is_judged_as_a_whole_by_its_factor():
    """Where the optimizer computes in bf16 (Muon) the twin rounds its products as a sharded run
    does, and the parameters' tolerances may exceed the update itself: the update's factor is
    judged instead, on each rank's own shards, in the order of the kinds."""
    from ddparity.checks.equivalence import UPDATE_FACTOR
    from ddparity.checks.tolerance import UPDATE_SHARE

    ref = make_reference()
    ref.optimizer_dtype, ref.update_noise = "bfloat16", (0.97, 0.06)  # the twin's own factor: 3% off
    tol = auto_tolerance(ref, 2, torch.float32)
    assert tol.update == UPDATE_SHARE
    assert divergences(ref, [_moved_by(1.004), _moved_by(0.997, rank=1)], tol) == []  # a correct run's rounding
    found = divergences(ref, [_moved_by(2.01, rank=1, size=50.0), _moved_by(2.0)], tol)  # lr x 2
    assert [(d.step, d.kind, d.name, d.rank) for d in found] == [(0, "param", UPDATE_FACTOR, r) for r in (0, 1)]
    assert math.isclose(found[1].max_abs, 1.01) and found[0].tolerance == UPDATE_SHARE
    assert math.isclose(found[1].factor, 2.01) and math.isclose(found[1].to_json()["factor"], 2.01)
    assert "factor" not in divergences(ref, [make_run(rank=0, bump=(0, "loss", "loss", 1.0))], tol)[0].to_json()
    # each rank's own shards: a rate doubled on one rank of two averages to 0.75 over both, a quarter off
    [one] = divergences(ref, [_moved_by(0.5), _moved_by(1.0, rank=1)], tol)
    assert (one.rank, one.max_abs, one.factor) == (0, 0.5, 0.5)  # the sign kept: a smaller update
    # a loss off at step 0 stays first; a run compared up to step 0 only is not judged past it
    bumped = make_run(rank=0, bump=(0, "loss", "loss", 1.0))
    bumped.moved = _moved_by(2.0).moved
    assert [d.kind for d in divergences(ref, [bumped], tol)] == ["loss", "param"]
    assert divergences(ref, [_moved_by(2.0)], tol, until=0) == []


def test_the_update_factor_is_judged_only_where_the_optimizer_is_low_precision_and_the_twin_leaves_room():
    ref = make_reference()
    ref.update_noise = (0.97, 0.06)
    assert auto_tolerance(ref, 2, torch.float32).update == 0.0  # a float32 optimizer: its tensors judge it
    ref.optimizer_dtype = "bfloat16"
    assert auto_tolerance(ref, 1, torch.float32).update == 0.0  # one rank: nothing sharded rounds it
    ref.update_noise = (0.8, 0.3)  # the twin itself 20% off: no room under a quarter
    assert auto_tolerance(ref, 2, torch.float32).update == 0.0
    ref.update_noise = None  # the twin did not move
    assert auto_tolerance(ref, 2, torch.float32).update == 0.0
    assert divergences(ref, [_moved_by(2.0)], auto_tolerance(ref, 2, torch.float32)) == []
