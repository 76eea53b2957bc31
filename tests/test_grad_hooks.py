"""Hooks on the parameters' gradients, and parameters frozen after DDP was built. A clamp in
a ``p.register_hook`` was read as "every gradient scaled by one factor: a comm hook" (its max
relative error, 1, was the same in every tensor); a weight frozen after DDP was built was
named by the wrong parameter (DDP's indices read against what requires grad now) and told to
"set requires_grad=False", which is what the step did."""

from __future__ import annotations

import pytest

from ddparity import check
from ddparity.fixtures import grad_hooks, loops

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

MODES = ("single", "dp", "ddp", "fsdp", "hsdp")
PER_RANK = "each hook runs on a rank's own gradient, before DDP averages them"
NEVER_RUN = "never runs those hooks: fully_shard replaces every parameter with a sharded DTensor"


def _causes(run):
    return [n for n in run.notes if n.startswith(("likely cause", "candidate causes"))]


def test_a_clamp_in_a_gradient_hook_is_named_per_mode_and_a_clamp_in_the_step_passes():
    report = check(grad_hooks.clamped_by_hooks(), modes=MODES, world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "diverged", "diverged", "diverged"], report.render()
    for run in report.runs[2:]:
        [cause] = _causes(run)
        assert cause.startswith("likely cause: the model hooks its parameters' gradients (0.weight, 0.bias"), cause
        assert (PER_RANK if run.mode == "ddp" else NEVER_RUN) in cause and "clip_grad_value_" in cause, cause
        assert "comm hook that" not in cause and "same factor" not in cause
    assert check(grad_hooks.clamped_in_the_step(), modes=MODES, world_sizes=(2,)).ok


def test_a_linear_hook_is_right_under_ddp_and_lost_under_fsdp_and_a_logging_hook_passes():
    report = check(grad_hooks.scaled_by_hooks(), modes=("dp", "ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "diverged"], report.render()
    [cause] = _causes(report.runs[2])
    assert NEVER_RUN in cause, cause
    assert check(grad_hooks.logged_by_hooks(), modes=("ddp", "fsdp"), world_sizes=(2,)).ok


def test_the_reference_lists_the_hooked_parameters_as_the_user_built_them():
    from ddparity.harness.ranks.stepping import gradient_hooks

    assert gradient_hooks(grad_hooks._hooked(grad_hooks._log)()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert gradient_hooks(grad_hooks._mlp()) == []


def test_a_weight_frozen_after_ddp_was_built_is_named_with_the_fix():
    report = check(loops.frozen_after_wrapping(), modes=("ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["crash", "pass"], report.render()
    error = report.runs[0].crash.error
    assert "the step set requires_grad=False on net.0.weight after DDP was built" in error, error
    assert "Freeze before DDP is built" in error and "find_unused_parameters" in error
    assert check(loops.frozen_after_wrapping(find_unused=True), modes=("ddp",), world_sizes=(2, 4)).ok


def test_ddps_unused_parameter_error_names_parameters_by_what_required_grad_when_it_was_built():
    import torch
    from torch import nn

    from ddparity.harness.ranks.modes.ddp import _REDUCED, unused_parameters

    class Fake(nn.Module):  # stands for a built DDP: its .module, and the snapshot taken at wrapping
        def __init__(self):
            super().__init__()
            self.module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    ddp = Fake()
    _REDUCED[ddp] = [(n, p) for n, p in ddp.module.named_parameters()]
    ddp.module[0].weight.requires_grad_(False)
    text = unused_parameters(ddp, "Parameter indices which did not receive grad for rank 1: 0")
    assert text.startswith("DistributedDataParallel found parameters that received no gradient in the previous "
                           "step's backward on rank 1: 0.weight (DDP's parameter indices 0)"), text
    assert "requires_grad=False on 0.weight after DDP was built" in text
    assert torch.is_tensor(ddp.module[0].weight)


def test_a_compiled_run_that_differs_where_its_eager_twin_does_takes_the_twins_placed_cause():
    report = check(grad_hooks.clamped_by_hooks(), modes=("ddp",), world_sizes=(2,), compile="aot_eager")
    [eager, compiled] = report.runs
    assert compiled.compile is not None and compiled.status == "diverged", report.render()
    assert [n for n in compiled.notes if n.startswith("likely cause")] == _causes(eager), compiled.notes
    assert PER_RANK in _causes(eager)[0]


def test_each_ranks_own_factor_outranks_hooks_and_a_uniform_factor_under_ddp_is_not_theirs():
    from ddparity.checks.placed import reread
    from ddparity.verdicts import Divergence, ModuleFinding

    best = ModuleFinding(step=0, rank=0, phase="reduction")
    first = Divergence(step=0, kind="grad", name="w", rank=0, max_abs=1.0, max_rel=0.5, tolerance=1e-6)
    hooks = ["w"]
    own = reread([], best, first, [first], 2, "fsdp", True, lambda: 1.0, per_rank={0: (1.4, 1e-9), 1: (1.6, 1e-9)},
                 hooks=hooks)
    assert own[0].startswith("likely cause: at step 0 each rank's gradients were scaled after the reduction"), own
    lost = reread([], best, first, [first], 2, "fsdp", True, lambda: 1.0, per_rank={0: (2.0, 1e-9), 1: (2.0, 1e-9)},
                  hooks=hooks)
    assert NEVER_RUN in lost[0], lost
    guessed = ["likely cause: all 2 gradients are scaled by the same factor (relative error 1 in each, the loss "
               "matches): a comm hook ..."]
    uniform = reread(guessed, best, first, [first], 2, "ddp", True, lambda: 1.0,
                     per_rank={0: (2.0, 1e-9), 1: (2.0, 1e-9)}, hooks=hooks)
    assert len(uniform) == 1 and "by a comm hook" in uniform[0], uniform  # a linear hook commutes with the average
    clamp = reread(guessed, best, first, [first], 2, "ddp", True, lambda: 1.0,
                   per_rank={0: (0.7, 0.2), 1: (0.6, 0.3)}, hooks=hooks)
    assert len(clamp) == 1 and PER_RANK in clamp[0], clamp
