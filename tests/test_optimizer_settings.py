"""The cause read from the optimizer's own settings: each rank's lr, momentum, betas and
weight decay as each step's ``optimizer.step()`` ended, against one device's. A
``ReduceLROnPlateau`` stepped on each rank's own loss was caught before, with "rank 1 alone
drifts" or "candidate causes ... an optimizer whose settings differ"; now the setting, the
step and every rank's value are named."""

from __future__ import annotations

import pytest
import torch

from ddparity import check
from ddparity.checks.optimizer_settings import settings_apart
from ddparity.fixtures import loops
from ddparity.verdicts import Divergence

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_a_plateau_scheduler_on_each_ranks_loss_is_named_with_every_ranks_rate_and_the_mean_passes():
    report = check(loops.plateau_on_the_loss(), modes=("dp", "ddp", "fsdp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs][:2] == ["pass", "pass"], report.render()
    for run in report.runs[2:]:
        assert run.status in ("desync", "diverged"), report.render()
        [cause] = [n for n in run.notes if n.startswith(("likely cause", "candidate causes"))]
        assert cause.startswith("likely cause: the optimizer's lr differs between the ranks as step 2's "
                                "optimizer.step() ends (rank 0 "), cause
        assert "ReduceLROnPlateau given the rank's loss" in cause and "one device 0.25" in cause, cause
        assert f"rank {run.world_size - 1} " in cause
    clean = check(loops.plateau_on_the_loss("mean"), modes=("ddp", "fsdp"), world_sizes=(2, 4))
    assert clean.ok, clean.render()


def test_settings_are_read_per_group_with_pairs_and_tensor_rates():
    from ddparity.harness.optimizer_settings import settings_of

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": torch.tensor(0.5)}], lr=0.1, betas=(0.8, 0.9))
    got = settings_of(adam)
    assert got["lr"] == (0.1, 0.5) and got["betas[0]"] == (0.8, 0.8) and got["betas[1]"] == (0.9, 0.9)
    assert "params" not in got and "amsgrad" not in got  # a flag is no number


def _first(step, kind):
    return Divergence(step=step, kind=kind, name="w", rank=1, max_abs=1.0, max_rel=1.0, tolerance=1e-6)


def test_a_setting_explains_only_an_update_it_came_before():
    reference = {0: {"lr": (0.1,)}, 1: {"lr": (0.1,)}}
    ranks = {0: {0: {"lr": (0.1,)}, 1: {"lr": (0.1,)}}, 1: {0: {"lr": (0.1,)}, 1: {"lr": (0.05,)}}}
    assert settings_apart(reference, ranks, _first(1, "loss"), 2, "ddp") is None  # step 1's loss came first
    assert settings_apart(reference, ranks, _first(1, "param"), 2, "ddp").startswith(
        "likely cause: the optimizer's lr differs between the ranks as step 1's")
    assert settings_apart(reference, ranks, None, 2, "ddp", desync_step=1) is not None
    assert settings_apart(reference, ranks, _first(0, "param"), 2, "ddp") is None
    scaled = {r: {0: {"lr": (0.2,)}, 1: {"lr": (0.2,)}} for r in (0, 1)}
    assert settings_apart(reference, scaled, _first(0, "param"), 2, "fsdp").startswith(
        "likely cause: the learning rate multiplied by the world size (2)")
    momentum = {r: {0: {"lr": (0.1,), "momentum": (0.5,)}} for r in (0, 1)}
    named = settings_apart({0: {"lr": (0.1,), "momentum": (0.9,)}}, momentum, _first(0, "param"), 2, "ddp")
    assert named.startswith("likely cause: the optimizer's momentum differs from one device's on every rank"), named


def test_a_setting_computed_from_each_ranks_own_shards_is_named_under_fsdp_and_the_whole_norm_passes():
    from ddparity.fixtures import optimizers

    report = check(optimizers.normalized_sgd(local=True), modes=("ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "diverged"], report.render()
    [cause] = [n for n in report.runs[1].notes if n.startswith("likely cause")]
    assert cause.startswith("likely cause: the optimizer's scale differs between the ranks as step 0's "
                            "optimizer.step() ends (rank 0 "), cause
    assert "computed by the optimizer from the rank's own shards: a sum over p.grad.to_local()" in cause, cause
    assert check(optimizers.normalized_sgd(), modes=("fsdp", "hsdp"), world_sizes=(2, 4)).ok


class _ClippedSGD(torch.optim.SGD):
    """A subclass as users write one: its own work, then the parent's step."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        return super().step(closure)


def test_a_subclass_calling_super_step_is_one_step_to_ddparitys_hooks_whatever_was_built_before():
    """torch runs the step hooks in every ``step`` it patched: once ``SGD.step`` is (any SGD
    built in the process), a subclass's ``super().step()`` runs them a second time, inside
    the first. Counted as two, the training step was refused ("called optimizer.step() 2
    times") in a rank process that had trained a plain SGD before, and passed in a fresh one."""
    from ddparity.harness.ranks.stepping import OptimizerWatch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # SGD.step hooked, as in a warm rank
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = _ClippedSGD([w], lr=0.1)
    seen = []
    watch = OptimizerWatch(optimizer, lambda: seen.append("before"), lambda: seen.append("grads"))
    for step in range(2):
        watch.begin(step)
        w.grad = torch.full((3,), 4.0)
        optimizer.step()
        watch.end()
        assert watch.calls == 1
    assert seen == ["before", "grads"] * 2
    watch.close()


def test_zero_redundancy_passes_under_ddp_and_is_refused_under_fsdp2_with_the_fix():
    """ZeRO-1 over Adam: the same training under DDP (its step runs Adam inside its own
    step: one step to the hooks); under FSDP2 torch raised from inside it ("c10d.broadcast_
    does not have a sharding strategy"), read as a crash with a generic cause. Now an
    error before its first step that names the optimizer to give FSDP2 instead."""
    from ddparity.fixtures import optimizers

    report = check(optimizers.zero_redundancy(), modes=("ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    by = {(r.mode, r.world_size): r for r in report.runs}
    assert by["ddp", 2].status == by["ddp", 4].status == "pass", report.render()
    for key in (("fsdp", 2), ("fsdp", 4), ("hsdp", 4)):
        assert by[key].status == "error", report.render()
        assert "ZeroRedundancyOptimizer cannot step FSDP2's sharded parameters" in by[key].reason, by[key].reason
        assert "Give FSDP2 the optimizer ZeroRedundancyOptimizer wraps (Adam) directly" in by[key].reason
    assert report.exit_code == 2
