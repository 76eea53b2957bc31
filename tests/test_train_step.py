"""Your own training step (``Case(train_step=...)``) in every mode: accumulation with
``no_sync()``, clipping, schedules, models that compute their own loss, LBFGS, batches that
are not all batched; the bugs of real training loops flagged, and mistakes in the step
itself told as such."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ddparity import Case, check, profile, whole
from ddparity.fixtures import loops
from ddparity.fixtures.models import MLP
from tests.conftest import needs_newer_torch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("factory", list(loops.LOOP_CASES.values()), ids=list(loops.LOOP_CASES))
def test_clean_training_steps_pass_in_every_mode(factory):
    report = check(factory(), modes=("single", "dp", "ddp"), world_sizes=(1, 2, 4))
    assert report.ok, report.render()
    assert [(r.mode, r.world_size) for r in report.runs] == [
        ("single", 1), ("dp", 1), ("dp", 2), ("dp", 4), ("ddp", 1), ("ddp", 2), ("ddp", 4)]


def test_a_gan_with_two_optimizers_passes_without_no_sync_advice_and_its_bypass_is_a_desync():
    """Two forwards with sync on a step, the discriminator's own optimizer stepping between
    them. They read as micro-batches accumulated without no_sync(), advised for the first
    (which would leave the discriminator unsynchronised); under DataParallel the discriminator's
    step read as parameters changed outside optimizer.step(). What differs there: its [real;
    fake] rows, gathered replica after replica. The generator's pass bypassing DDP: a desync."""
    report = check(loops.gan(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2,))
    by = {r.mode: r for r in report.runs}
    assert [by[m].status for m in ("single", "ddp", "fsdp")] == ["pass"] * 3, report.render()
    assert not any(n.startswith("traffic:") for r in report.runs for n in r.notes), report.render()
    assert by["dp"].status == "diverged", report.render()
    assert any(n.startswith("DataParallel pitfall, outputs not one row per sample: forward's output has 32 row(s) "
                            "along dim 0 for a replica's 16 sample(s)") for n in by["dp"].notes), by["dp"].notes
    assert not any("outside optimizer.step()" in n for n in by["dp"].notes), by["dp"].notes
    where = by["dp"].first_divergence.module  # "every module agrees" was said of modules never compared
    assert where is not None and "32 rows for 16 samples" in where.uncompared, by["dp"].first_divergence
    assert "except modules never compared, their outputs' rows not one per sample of the rank's share: d" \
        in report.render()
    bypassed = check(loops.gan(bypass=True), modes=("ddp",), world_sizes=(2,))
    assert bypassed.runs[0].status == "desync" and bypassed.runs[0].desync.step == 0, bypassed.render()
    assert any(n.startswith("likely cause: the gradients of g.0.weight, g.0.bias, g.2.weight, g.2.bias (4 of 8 "
                            "parameters) reached optimizer.step() at step 0 from a backward that no DDP forward with "
                            "gradient sync on preceded") for n in bypassed.runs[0].notes), bypassed.runs[0].notes


@needs_newer_torch
def test_a_clean_step_passes_on_simulated_ranks():
    report = check(loops.accumulation(), world_sizes=(8,), backend="threaded")
    assert report.ok, report.render()
    assert report.runs[-1].simulated


def test_the_late_sync_flag_is_caught_from_the_first_step():
    report = check(loops.late_sync(), world_sizes=(2, 4))
    assert report.exit_code == 1, report.render()
    for run in report.runs[1:]:
        assert run.status == "desync", run  # no gradient is averaged: every replica its own
        assert run.desync.step == 0
        d = run.first_divergence
        assert (d.step, d.kind) == (0, "grad"), d
        assert d.max_abs > 100 * d.tolerance, d


def test_a_summed_loss_in_the_step_is_caught_with_its_cause():
    report = check(loops.summed_in_step(), world_sizes=(2,))
    run = report.runs[-1]
    assert run.status == "diverged", report.render()
    assert run.first_divergence.max_abs > 100 * run.first_divergence.tolerance
    assert any(note.startswith("likely cause: a loss summed") for note in run.notes), run.notes


def _step(**changes):
    base = loops.accumulation()
    return dataclasses.replace(base, **changes)


def test_a_step_that_never_steps_the_optimizer_is_an_error_that_says_so():
    def forgetful(model, batch, optimizer, ctx):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        return loss

    report = check(_step(train_step=forgetful), world_sizes=(2,))
    assert report.exit_code == 2
    assert all(r.status == "error" for r in report.runs)
    assert "never called optimizer.step()" in report.runs[0].reason


def test_a_step_that_steps_twice_or_returns_no_loss_is_an_error_naming_it():
    def twice(model, batch, optimizer, ctx):
        for _ in range(2):
            optimizer.zero_grad()
            F.cross_entropy(model(batch["x"]), batch["y"]).backward()
            optimizer.step()
        return torch.zeros(())

    def no_loss(model, batch, optimizer, ctx):
        optimizer.zero_grad()
        F.cross_entropy(model(batch["x"]), batch["y"]).backward()
        optimizer.step()

    report = check(_step(train_step=twice), world_sizes=(2,))
    assert report.exit_code == 2 and "optimizer.step() 2 times at step 0" in report.runs[0].reason
    report = check(_step(train_step=no_loss), world_sizes=(2,))
    assert report.exit_code == 2 and "must return the step's loss as a scalar" in report.runs[0].reason
    assert "got NoneType" in report.runs[0].reason


def test_ctx_tells_the_step_where_it_runs():
    seen = []

    def spy(model, batch, optimizer, ctx):
        seen.append((ctx.mode, ctx.rank, ctx.world_size, ctx.step, ctx.device, type(model).__name__,
                     int(batch["x"].shape[0])))
        ctx.state["calls"] = ctx.state.get("calls", 0) + 1
        assert ctx.state["calls"] == ctx.step + 1  # one state for the whole run of a replica
        return loops.accumulate(model, batch, optimizer, ctx)

    from ddparity.harness.ranks.modes.ddp import DDPMode
    from ddparity.harness.ranks.modes.dp import DataParallelMode
    from ddparity.harness.ranks.modes.single import SingleMode
    from ddparity.harness.ranks.training import initial_state, train

    case = _step(train_step=spy, steps=2)
    state = initial_state(case)
    train(case, state, "cpu", SingleMode(2))
    train(case, state, "cpu", DataParallelMode(2, 2, "cpu"))
    assert seen == [("single", 0, 1, 0, "cpu", "MLP", 32), ("single", 0, 1, 1, "cpu", "MLP", 32),
                    ("dp", 0, 2, 0, "cpu", "EmulatedDataParallel", 32), ("dp", 0, 2, 1, "cpu",
                                                                         "EmulatedDataParallel", 32)]
    assert DDPMode  # (DDP's ctx is covered end to end: ctx.no_sync() is DDP's own in the accumulation case)


def test_the_builtin_step_with_an_optimizer_that_needs_a_closure_says_to_write_a_step():
    case = Case(model=MLP, data=loops.labelled_pair, optimizer=lambda p: torch.optim.LBFGS(p), steps=1)
    report = check(case, world_sizes=(2,))
    assert report.exit_code == 2
    reason = report.runs[0].reason
    assert "LBFGS needs a closure" in reason and "Case(train_step=fn)" in reason, reason


def test_unbatched_tensors_reach_every_replica_whole():
    report = check(loops.unbatched_inputs(), modes=("single", "ddp"), world_sizes=(2, 4))
    assert report.ok, report.render()


def test_a_batch_whose_size_cannot_be_told_names_the_tensors_and_the_fix():
    def tied(step, generator):
        return {"a": torch.randn(8, 16, generator=generator), "b": torch.randn(4, 16, generator=generator)}, \
            torch.zeros(())

    def step_fn(model, batch, optimizer, ctx):
        return loops.summed_step(model, batch, optimizer, ctx)

    report = check(Case(model=MLP, data=tied, train_step=step_fn, steps=1), world_sizes=(2,))
    assert report.exit_code == 2
    reason = report.runs[0].reason
    assert "batch[0]['a'] (dim 0 = 8)" in reason and "batch[0]['b'] (dim 0 = 4)" in reason, reason
    assert "ddparity.whole(" in reason


def test_whole_takes_only_tensors():
    from ddparity.errors import UsageError

    with pytest.raises(UsageError, match="takes a tensor"):
        whole([1, 2])


def test_profile_times_the_users_own_step():
    report = profile(loops.accumulation(), world_sizes=(2,), steps=2, warmup=1)
    assert report.exit_code == 0, report.render()
    [run] = [r for r in report.runs if r.world_size == 2]
    assert run.status == "ok", run
    assert run.step_s > 0 and run.compute_s > 0 and run.optimizer_s > 0 and run.bytes_per_step > 0
