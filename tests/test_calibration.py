"""A tolerance that is never zero, never NaN and never vacuous: low precision, batch-coupled
losses and stateful forwards calibrate without false alarms; where no noise floor can be
calibrated the report says why instead of passing."""

from __future__ import annotations

import pytest

from ddparity import check
from ddparity.fixtures import calibration

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("factory", list(calibration.CLEAN.values()), ids=list(calibration.CLEAN))
def test_hard_to_calibrate_clean_set_ups_pass(factory):
    report = check(factory(), world_sizes=(1, 2, 4))
    assert report.ok, report.render()


def test_low_precision_tolerances_stay_a_fraction_of_the_values_and_catch_a_summed_loss():
    report = check(calibration.autocast_bf16_summed(), world_sizes=(2, 4))
    for run in report.runs[1:]:
        assert run.status == "diverged", report.render()
        assert "bfloat16" in run.tolerance
        d = run.first_divergence
        assert d.max_abs > 2 * d.tolerance, d


def test_in_bf16_a_summed_loss_is_caught_at_every_world_size_and_the_clean_model_passes():
    """The tolerance grew with W (W bf16 ulps x headroom passed the value itself at 16):
    it is capped at a share of the value, and autocast's partials, summed in float32, no
    longer count W bf16 ulps."""
    sizes = (2, 4, 16, 32)
    for factory in (calibration.bf16_model_summed, calibration.autocast_bf16_summed_at_scale):
        report = check(factory(), world_sizes=sizes, modes=("ddp",), backend="auto")
        runs = [r for r in report.runs if r.mode == "ddp"]
        assert [r.world_size for r in runs] == list(sizes)
        for run in runs:
            assert run.status == "diverged", report.render()
            d = run.first_divergence
            assert d.step == 0 and d.max_abs > 2 * d.tolerance, d
    for factory in (calibration.bf16_model_at_scale, calibration.autocast_bf16_at_scale):
        report = check(factory(), world_sizes=sizes, modes=("ddp",), backend="auto")
        assert report.ok, report.render()


def test_an_order_dependent_model_is_never_passed_and_the_report_says_why():
    report = check(calibration.order_dependent(), world_sizes=(2,))
    assert report.exit_code == 2, report.render()
    [run] = [r for r in report.runs if r.mode == "ddp"]
    assert run.status == "error"
    assert "no tolerance can be calibrated from step 0 on" in run.reason
    assert "order of the samples" in run.reason


def test_a_skipped_grad_scaler_step_is_recorded_as_not_stepped():
    from ddparity.harness.ranks.modes.single import SingleMode
    from ddparity.harness.ranks.spool import Spool, Writer
    from ddparity.harness.ranks.training import initial_state, train

    case = calibration.grad_scaler_skipping()
    with Spool() as spool:
        writer = Writer(spool.path)
        trained = train(case, initial_state(case), "cpu", SingleMode(3), writer)
        reference = writer.finish()
    assert reference.stepped == [False, True, True]
    assert not reference.entries(0, "grad") and reference.entries(1, "grad")
    assert trained.autocast_dtype == "float16"
