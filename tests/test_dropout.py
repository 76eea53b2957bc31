"""Dropout compared with dropout on: the same mask for the same sample in every mode and
rank, so a dropout model is compared as sharply as one without; other random draws named."""

from __future__ import annotations

import pytest
from torch import nn

from ddparity import Case, check
from ddparity.fixtures import dropout, models
from ddparity.harness.ranks.comparer import Comparer
from ddparity.harness.ranks.modes.ddp import DDPMode  # noqa: F401 - the modes below are the real ones
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.modes.twin import TwinMode
from ddparity.harness.ranks.spool import Writer
from ddparity.harness.ranks.training import initial_state, train
from ddparity.harness.spool_files import Spool, write_state
from tests.conftest import needs_newer_torch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("factory", list(dropout.CLEAN.values()), ids=list(dropout.CLEAN))
def test_dropout_models_pass_sharply_at_every_world_size(factory):
    report = check(factory(), modes=("single", "dp", "ddp"), world_sizes=(1, 2, 4))
    assert report.ok, report.render()
    assert report.runs[0].notes[0].startswith("random draws compared on: every mode and rank drew the same dropout mask")
    for run in report.runs[1:]:
        assert "float32" in run.tolerance


@needs_newer_torch
def test_dropout_models_pass_on_eight_simulated_ranks():
    report = check(dropout.every_dropout(), world_sizes=(8,), backend="threaded")
    assert report.ok, report.render()


@pytest.mark.parametrize("factory", list(dropout.BUGS.values()), ids=list(dropout.BUGS))
def test_bugs_stand_out_by_orders_of_magnitude_with_dropout_on(factory):
    report = check(factory(), world_sizes=(2, 4))
    for run in report.runs[1:]:
        assert run.status == "diverged", report.render()
        d = run.first_divergence
        assert d.step == 0 and d.max_abs > 100 * d.tolerance, d


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_region_recomputed_in_backward_draws_its_forwards_mask(reentrant):
    """Backward runs a checkpointed block's forward again; its aligned dropout must repeat
    the forward's mask (it drew the next place's, and the DataParallel emulation's last
    replica's rows: a false alarm in dp), as torch's own dropout does by restoring the RNG."""
    import torch

    from ddparity.harness.ranks.randomness import AlignedDropout

    x = torch.randn(8, 16)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = dropout.CheckpointedBlocks(reentrant)
        if not checkpointed:
            model.forward = lambda x, m=model: m.head(  # type: ignore[method-assign]
                (y := x + m.blocks[0](x)) + m.blocks[1](y))
        aligned = AlignedDropout(model, seed=0)
        try:
            aligned.begin(0, torch.arange(8), (x,))
            model(x.requires_grad_(reentrant)).square().sum().backward()
        finally:
            calls = aligned.close()
        assert calls == 2  # the recomputes are not new calls
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_the_twin_draws_the_same_masks_in_reversed_order():
    """The calibration twin trains on the reversed batch: with aligned masks its distance to
    the reference is rounding only (without them it would be the masks' difference)."""
    case = dropout.every_dropout()
    with Spool() as spool:
        write_state(spool.path, initial_state(case))
        writer, twin = Writer(spool.path), Comparer(spool.path, "twin", 0, 1, limit_s=60)
        ref = train(case, spool.path, "cpu", SingleMode(1), writer)
        again = train(case, spool.path, "cpu", TwinMode(1, twin_world_size=1), twin)  # reversed, not nudged
    assert ref.dropout_calls == again.dropout_calls == 11  # 7 dropouts + 4 in the transformer layer
    gaps = twin.finish().steps[0]
    assert gaps[("loss", "loss")] < 1e-5, gaps
    grads = {k: v for k, v in gaps.items() if k[0] == "grad"}
    assert grads and max(grads.values()) < 1e-5, grads


def _nested_noise() -> Case:
    return Case(model=lambda: nn.Sequential(nn.Linear(16, 16), dropout.NoisyInput()), data=models.vectors, steps=2,
                name="random: noise in a submodule's forward")


@pytest.mark.parametrize("factory, op", [(dropout.noisy_input, "aten.randn in the model (NoisyInput)"),
                                         (_nested_noise, "aten.randn in module 1 (NoisyInput)"),
                                         (dropout.rrelu, "aten.rrelu_with_noise")])
def test_other_random_draws_are_named_and_never_a_pass(factory, op):
    """Named by op and by the module whose forward drew (Switch Transformers' router jitter:
    "aten.uniform_ x2 in modules encoder.block.1.layer.1.mlp.router, ...")."""
    report = check(factory(), world_sizes=(2,))
    assert report.exit_code == 2, report.render()
    assert all(r.status == "error" for r in report.runs)
    reason = report.runs[0].reason
    assert "draws random numbers from torch's generator at step 0" in reason and op in reason, reason


def test_dropout_on_rows_that_are_not_the_batch_is_an_error_that_says_why():
    report = check(dropout.unmatched_rows(), world_sizes=(2,))
    assert report.exit_code == 2, report.render()
    reason = report.runs[0].reason
    assert "cannot be given the same mask per sample" in reason and "x.chunk(n)" in reason, reason


def test_aligned_dropout_leaves_torch_as_it_was():
    import torch.nn.functional as F

    before = F.dropout, F.scaled_dot_product_attention
    case = dropout.every_dropout()
    train(case, initial_state(case), "cpu", SingleMode(1))
    assert (F.dropout, F.scaled_dot_product_attention) == before


def test_stochastic_depth_per_sample_is_aligned_like_dropout():
    """timm's DropPath and torchvision's stochastic_depth (mode="row") draw one Bernoulli per
    sample with Tensor.bernoulli_, transformers' ConvNext/Swin/BEiT one uniform per sample with
    torch.rand: draws ddparity refused (every model with a drop-path rate was an error). Each sample's draw now comes from its own generator, as its dropout masks
    do: clean passes in every mode with stochastic depth on, a summed loss is still caught at
    step 0; a draw for the whole batch (mode="batch") stays an error that says which mode is
    aligned."""
    clean = check(dropout.stochastic_depth_case(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2, 4))
    assert clean.ok, clean.render()
    assert "(3 draw(s) a step: dropouts, stochastic depth" in clean.runs[0].notes[0]
    summed = check(dropout.stochastic_depth_case(summed=True), modes=("ddp", "fsdp"), world_sizes=(2, 4))
    for run in summed.runs:
        d = run.first_divergence
        assert run.status == "diverged" and d.step == 0 and d.max_abs > 1e3 * d.tolerance, summed.render()
    batch = check(dropout.stochastic_depth_case("batch"), modes=("single", "ddp"), world_sizes=(2,))
    assert all(r.status == "error" for r in batch.runs), batch.render()
    assert "aten.bernoulli_ in the model (DeepResidual)" in batch.runs[0].reason
    assert "stochastic_depth with mode='row'), but not a draw for the whole batch" in batch.runs[0].reason


def test_a_forwards_rows_are_told_by_view_by_copy_or_as_a_sample_list_and_never_by_how_many_arguments_it_has():
    """Four keyword tensors are not a ``ddparity.samples`` list of four samples (before, a
    micro-batch of 2 given as four arguments to a share of 4 read as all 4 samples); a copy's
    rows are the rows it equals, each exactly one; duplicates tell no sample."""
    import torch

    from ddparity.harness.ranks.forward_rows import copied_rows, rows_of

    rows, ids = torch.arange(4, 8), torch.arange(24).reshape(4, 6)
    mask, labels = torch.ones(4, 6, dtype=torch.long), ids.clone()
    idx = torch.tensor([3, 1])
    given = [ids[idx], mask[idx], labels[idx], torch.tensor(9)]
    assert rows_of(rows, [ids, mask, labels], [0], given).tolist() == [7, 5]
    assert rows_of(rows, [ids], [0], [ids[2:4]]).tolist() == [6, 7]  # a view: by its storage
    assert rows_of(rows, [ids], [0], [[ids[i] for i in range(4)]]).tolist() == [4, 5, 6, 7]  # a samples list
    assert copied_rows(4, [mask], mask[idx]) is None  # every row alike: which sample is which cannot be told
    assert copied_rows(4, [ids], ids[idx].float()) is None  # another dtype: computed, not copied
    assert copied_rows(4, [ids], ids[idx] + 1) is None
