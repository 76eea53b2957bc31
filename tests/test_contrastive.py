"""Contrastive losses across ranks (open_clip's ClipLoss): the features all-gathered with and
without their gradient, a local loss, each rank's shard alone. The gradient a gather without
gradient leaves is 1/W of one device's with the loss matching: the numbers of a loss divided
by W before backward, told apart by the step's collectives."""

from __future__ import annotations

import pytest

from ddparity import check
from ddparity.checks.causes import gathered_without_grad
from ddparity.fixtures import contrastive
from ddparity.records import GATHERED_WITH_GRAD, Entry

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def causes(report):
    return {(r.mode, r.world_size): next((n for n in r.notes if n.startswith("likely cause")), None)
            for r in report.runs if r.mode != "single"}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_open_clips_default_gather_is_caught_and_named_not_as_a_loss_over_w(optimizer):
    report = check(contrastive.clip(optimizer=optimizer), modes=("single", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["pass"] + ["diverged"] * 6, report.render()
    for (mode, ws), cause in causes(report).items():
        assert cause is not None and cause.startswith(f"likely cause: all 6 gradients are 1/{ws} of the reference's"), cause
        assert "all-gathered without their gradient (ddparity/fixtures/contrastive.py:" in cause, cause
        assert "torch.distributed.nn.functional.all_gather" in cause and "(loss / world_size)" not in cause, cause
        assert f"{mode.upper()}'s average" in cause


def test_open_clips_gather_with_grad_passes_with_a_global_or_a_local_loss():
    for local_loss in (False, True):
        case = contrastive.clip(gather_with_grad=True, local_loss=local_loss)
        report = check(case, modes=("single", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
        assert report.ok, report.render()
    threaded = check(contrastive.clip(gather_with_grad=True), modes=("ddp",), world_sizes=(8,), backend="threaded")
    assert threaded.ok, threaded.render()


def test_a_local_loss_gathered_without_grad_names_the_gather():
    report = check(contrastive.clip(local_loss=True), modes=("single", "ddp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["pass", "diverged", "diverged"], report.render()
    for cause in causes(report).values():
        assert cause.startswith("likely cause: the loss uses tensors all-gathered without their gradient"), cause


def test_a_contrastive_loss_on_each_shard_alone_is_named_by_the_probe():
    report = check(contrastive.clip_per_rank(), modes=("single", "ddp", "fsdp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["pass"] + ["diverged"] * 4, report.render()
    for cause in causes(report).values():
        assert cause.startswith("likely cause: the loss is not a mean or sum over samples: on one device the first "
                                "batch given twice gives 1.15x its loss"), cause


def test_a_metric_gathered_detached_is_no_cause_of_a_loss_over_w():
    report = check(contrastive.metric_gathered_loss_over_w(), modes=("single", "ddp"), world_sizes=(2, 4))
    for cause in causes(report).values():
        assert cause.startswith("likely cause: a mean loss divided by the world size"), cause


def _entry(op: str, site: str, via: str = "", grad: bool = False, phase: str = "backward", step: int = 0) -> Entry:
    return Entry("world", 0, op, op, f"{op}(tensor=float32[8, 8])" + (GATHERED_WITH_GRAD if grad else ""), site, via,
                 step, phase, 0.0, False)


def test_a_gather_counts_unanswered_only_without_a_collective_of_the_users_after_it():
    gather = _entry("all_gather", "clip.py:10 in gather", grad=True)
    fsdp = [_entry("all_gather_single", "train.py:5 in step", via="FSDP2"),
            _entry("reduce_scatter_single", "train.py:9 in step", via="FSDP2")]
    ours = _entry("all_reduce", "ddparity/harness/ranks/training.py:240 in finish_shared_step", phase="optimizer")
    assert gathered_without_grad([fsdp[0], gather, gather, fsdp[1], ours], 0) == ["clip.py:10 in gather"]
    assert gathered_without_grad([gather], 1) == []  # another step
    assert gathered_without_grad([_entry("all_gather", "m.py:3 in metric")], 0) == []  # a detached copy
    answered = _entry("all_reduce", "clip.py:30 in backward")  # a GatherLayer's backward all-reducing the grads
    assert gathered_without_grad([gather, answered], 0) == []
    autograd = _entry("all_to_all", "train.py:9 in step", via="torch.distributed.nn")
    assert gathered_without_grad([_entry("all_gather", "train.py:7 in step", via="torch.distributed.nn", grad=True),
                                  autograd], 0) == []


def test_a_0d_parameter_is_refused_by_the_default_sharding_with_the_fix_and_trains_under_ddp():
    """CLIP's logit_scale: fully_shard raised "doesn't support scalar parameters" from inside
    ddparity's default wrapping, reported as a crash of the user's ranks."""
    report = check(contrastive.clip(gather_with_grad=True, learned_scale=True), modes=("single", "ddp", "fsdp", "hsdp"),
                   world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "error", "error"], report.render()
    reason = report.runs[2].reason
    assert "0-d parameters: logit_scale" in reason and "nn.Parameter(t.reshape(1))" in reason, reason
    assert "ignored_params" in reason and report.exit_code == 2
