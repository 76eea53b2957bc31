"""Steps whose numbers are not the usual ones: complex parameters (a Fourier neural
operator) and a gradient penalty (a second backward through the model). Before, a complex
parameter was cast to real on the way in (its imaginary part dropped, the model's own error
shown), the comparison could not take its difference, and the calibration twin's nudge
raised inside ``torch.sign`` (reported as the batch's fault); a gradient penalty under FSDP2
crashed inside torch with nothing said of why. Quantization-aware training's observers, which
take their range from each rank's shard, were placed but not named; TorchScript blocks
crashed in ddparity's own module hooks (shown as the model's error)."""

from __future__ import annotations

import pytest
import torch

from ddparity import check
from ddparity.distances import distance, moved
from ddparity.fixtures import numerics

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SUMMED = "likely cause: a loss summed over the batch (reduction='sum')"


def test_complex_parameters_stay_complex_in_the_case_dtype():
    from ddparity.harness.ranks.training import cast_model

    for dtype, expected in ((torch.float32, torch.complex64), (torch.float64, torch.complex128),
                            (torch.bfloat16, torch.complex64)):
        model = numerics.FNO1d()
        before = model.spectral[0].weight.detach().clone()
        cast_model(model, "cpu", dtype)
        assert model.spectral[0].weight.dtype == expected and model.lift.weight.dtype == dtype
        assert torch.equal(model.spectral[0].weight.detach().imag.double(), before.imag.double())  # kept


def test_complex_tensors_are_measured_by_their_modulus_and_as_two_reals():
    a = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    b = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    assert distance(a, b) == pytest.approx(3.0)
    assert distance(a, a.clone()) == 0.0
    start = torch.zeros(2, dtype=torch.complex64)
    run_ref, ref_ref, run_run = moved(start, a, 2 * a)
    assert (run_ref, ref_ref, run_run) == pytest.approx((14.0, 7.0, 28.0))


def test_the_twin_nudges_a_complex_gradients_real_and_imaginary_parts_each_towards_zero():
    from ddparity.harness.ranks.modes.twin import nudge_towards_zero

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    p.grad = torch.tensor([1e-6 + 1j, -1 - 1e-6j, 0j], dtype=torch.complex64)
    before = p.grad.clone()
    nudge_towards_zero(torch.nn.ParameterList([p]), {}, 2, torch.float32)
    moved_by = before - p.grad
    assert torch.all(torch.sign(moved_by.real) == torch.sign(before.real))
    assert torch.all(torch.sign(moved_by.imag) == torch.sign(before.imag))
    assert moved_by[0].real > 0 and moved_by[1].imag < 0 and moved_by[2] == 0  # a tiny part moves by the same ulps


def test_a_fourier_neural_operator_passes_and_its_summed_loss_is_named():
    modes = ("dp", "ddp", "fsdp")
    clean = check(numerics.fourier_operator(), modes=modes, world_sizes=(2,))
    assert clean.ok, clean.render()
    report = check(numerics.fourier_operator(summed=True), modes=("ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["diverged", "diverged"], report.render()
    for run in report.runs:
        assert run.first_divergence.step == 0 and any(n.startswith(SUMMED) for n in run.notes), run.notes


def test_a_gradient_penalty_passes_guarded_crashes_with_its_cause_unguarded_and_its_summed_loss_is_caught():
    assert check(numerics.gradient_penalty(), modes=("dp", "ddp", "fsdp"), world_sizes=(2,)).ok
    raw = check(numerics.gradient_penalty(guarded=False), modes=("ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in raw.runs] == ["pass", "crash"], raw.render()
    [cause] = [n for n in raw.runs[1].notes if n.startswith("likely cause")]
    assert "a second backward through parameters FSDP had already resharded" in cause
    assert "model.set_reshard_after_backward(False) before the first backward" in cause
    summed = check(numerics.gradient_penalty(summed=True), modes=("ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in summed.runs] == ["diverged", "diverged"], summed.render()


@pytest.mark.breadth
@pytest.mark.parametrize("fixture", ["fourier_operator", "gradient_penalty"])
def test_every_mode_at_2_and_4(fixture):
    make = getattr(numerics, fixture)
    clean = check(make(), modes=("single", "dp", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    assert clean.ok, clean.render()
    buggy = check(make(summed=True), modes=("ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    for run in buggy.runs:
        assert run.status == "diverged" and any(n.startswith(SUMMED) for n in run.notes), buggy.render()


def test_quantization_observers_on_shards_are_named_and_frozen_observers_pass():
    modes = ("dp", "ddp", "fsdp")
    report = check(numerics.quantization_aware(), modes=modes, world_sizes=(2,))
    assert [r.status for r in report.runs] == ["diverged"] * 3, report.render()
    for run in report.runs:
        [cause] = [n for n in run.notes if n.startswith("likely cause")]
        assert cause.startswith("likely cause: quantization observers on shards (") and "FakeQuantize" in cause
        assert "disable_observer" in cause, cause
    clean = check(numerics.quantization_aware(frozen=True), modes=modes, world_sizes=(2,))
    assert clean.ok, clean.render()


def test_scripted_blocks_are_checked_under_ddp_and_dataparallel_and_fsdp_says_why_not():
    from ddparity.fixtures import layouts

    report = check(layouts.scripted_blocks(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "pass", "error"], report.render()
    reason = report.runs[3].reason
    assert "fully_shard cannot shard a model that holds TorchScript modules: 'blocks.0' (Block)" in reason, reason
    assert "--modes single,dp,ddp" in reason
    summed = check(layouts.scripted_blocks(summed=True), modes=("ddp",), world_sizes=(2,))
    assert summed.runs[0].status == "diverged" and any(n.startswith(SUMMED) for n in summed.runs[0].notes)
