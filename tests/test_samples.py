"""Lists of samples (``ddparity.samples``): detection-style images of their own sizes and
per-image target dicts, each rank given its slice of the list as a DistributedSampler
would, the model given a plain list; clean, with a planted bug, and what DataParallel
cannot do with them."""

from __future__ import annotations

import functools

import pytest
import torch

from ddparity import Case, check, profile, samples
from ddparity.case import Samples
from ddparity.errors import UsageError
from ddparity.fixtures import inputs
from ddparity.harness.ranks.batches import batch_size, cast, reverse_samples, shard
from ddparity.harness.ranks.modes.twin import jittered

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_a_list_of_samples_is_cut_reversed_and_unwrapped_as_a_list():
    items = [torch.full((2, 3), float(i)) for i in range(8)]
    batch = (samples(items), torch.arange(8))
    assert batch_size(batch) == 8  # the list's length, not its items' dim 0
    mine = shard(batch, 1, 4, 8)
    assert [float(t[0, 0]) for t in mine[0].items] == [2.0, 3.0] and mine[1].tolist() == [2, 3]
    assert [float(t[0, 0]) for t in reverse_samples(batch, 8)[0].items] == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    plain = cast(mine, Case(model=torch.nn.Identity, data=None, train_step=lambda *a: None), "cpu")
    assert type(plain[0]) is list and all(t.shape == (2, 3) for t in plain[0])
    # the built-in step calls model(images): the list is its one argument, not its arguments
    builtin = cast(mine, Case(model=torch.nn.Identity, data=None), "cpu")
    assert type(builtin[0]) is tuple and len(builtin[0]) == 1 and type(builtin[0][0]) is list


def test_lists_of_samples_must_agree_and_a_tie_names_the_marker():
    from ddparity.errors import CaseError

    with pytest.raises(CaseError, match=r"batch\[0\] \(8 items\), batch\[1\] \(6 items\)"):
        batch_size((samples([torch.zeros(1)] * 8), samples([torch.zeros(1)] * 6)))
    with pytest.raises(CaseError, match=r"ddparity\.samples\(\.\.\.\)"):
        batch_size(([torch.zeros(3, 4)] * 2, [torch.zeros(1)] * 2))
    with pytest.raises(UsageError, match="non-empty list of samples"):
        samples([])
    with pytest.raises(UsageError, match="got Tensor"):
        samples(torch.zeros(3))
    assert isinstance(samples((torch.zeros(1),)), Samples)


def test_the_twin_jitters_float32_and_float64_inputs_by_an_ulp_and_leaves_bf16_alone():
    x = torch.rand(64, 8) + 1.0
    moved = jittered((x, samples([x[0]]), torch.arange(3)), torch.float32)
    delta = (moved[0] - x).abs() / x
    assert delta.max() <= 2 * torch.finfo(torch.float32).eps and (delta > 0).float().mean() > 0.9  # an ulp or two
    assert torch.equal(moved[2], torch.arange(3))  # integers: as they were
    assert not torch.equal(moved[1].items[0], x[0])  # items of a list of samples too
    assert moved[0].dtype == torch.float32
    assert jittered(x, torch.bfloat16) is x
    coded = torch.tensor([[3.0, 0.25], [1.0, 0.5], [0.0, 1.5]])  # a category column and features
    moved = jittered(coded, torch.float32)
    assert torch.equal(moved[:, 0], coded[:, 0]) and moved[:, 0].long().tolist() == [3, 1, 0]
    assert not torch.equal(moved[:, 1], coded[:, 1])
    assert jittered(x, torch.float64).dtype == torch.float64  # the case's dtype, its ulp


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "hsdp"])
def test_detection_style_samples_pass_clean_and_catch_a_summed_loss(mode):
    clean = check(inputs.detection_case(), modes=("single", mode), world_sizes=(2, 4))
    assert clean.ok, clean.render()
    summed = check(inputs.detection_case(summed=True), modes=("single", mode), world_sizes=(2, 4))
    for run in summed.runs[1:]:
        d = run.first_divergence
        assert run.status == "diverged" and d.step == 0 and d.max_abs >= 100 * d.tolerance, summed.render()
        assert any(n.startswith("likely cause: a loss summed over the batch") for n in run.notes), run.notes


def test_a_bias_before_a_per_image_normalisation_is_not_a_false_alarm():
    """The conv's bias gradient is analytically zero (the normalisation removes it per
    image): numerically ulps of its terms, changed whole by the last bits a 2-rank run's
    kernels change. The twin reproduced it bit for bit before it jittered its inputs: a
    clean model diverged at x2.3e4 on it."""

    class Normalised(inputs.Detector):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1),
                                                torch.nn.BatchNorm2d(8, track_running_stats=False), torch.nn.ReLU())

    case = Case(model=Normalised, data=inputs.detection_batch, optimizer="sgd", lr=0.05, steps=2,
                loss=functools.partial(inputs._detection_loss, reduction="mean"))
    report = check(case, modes=("single", "ddp"), world_sizes=(2, 4))
    assert report.ok, report.render()


def test_labels_kept_as_floats_and_read_with_long_are_not_jittered_into_other_classes():
    """Jittered whole, 3.0 became 2.9999998 and .long() made it class 2: the twin trained
    on other labels and the check said the step depends on the order of the samples."""

    def data(step, generator):
        return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator).float()

    case = Case(model=lambda: torch.nn.Linear(8, 4), data=data,
                loss=lambda out, y: torch.nn.functional.cross_entropy(out, y.long()))
    report = check(case, modes=("single", "ddp"), world_sizes=(2,))
    assert report.ok, report.render()


def test_dataparallel_refuses_lists_of_samples_and_a_users_step_gets_plain_lists():
    report = check(inputs.detection_case(), modes=("dp",), world_sizes=(2,))
    [run] = report.runs
    assert run.status == "error" and run.simulated and "cuts every tensor of a list" in run.reason, report.render()

    def step(model, batch, optimizer, ctx):
        images, targets = batch
        assert type(images) is list and type(targets) is list and len(images) == 16 // ctx.world_size
        optimizer.zero_grad()
        loss = functools.partial(inputs._detection_loss, reduction="mean")(model(images), targets)
        loss.backward()
        optimizer.step()
        return loss

    own = dataclasses_replace(inputs.detection_case(), train_step=step)
    assert check(own, modes=("single", "ddp"), world_sizes=(2,)).ok
    timed = profile(own, modes=("ddp",), world_sizes=(2,), steps=2, warmup=1)
    [row] = [r for r in timed.runs if r.world_size == 2]
    assert row.status == "ok" and row.samples_per_step == 16, row


def dataclasses_replace(case: Case, **changes) -> Case:
    import dataclasses

    return dataclasses.replace(case, **changes)


def test_bags_given_flat_with_offsets_are_an_error_naming_the_layout_and_the_fix():
    """Was an error blamed on the user's model on one device: the reference trained, its
    calibration twin reversed the offsets (offsets[0] = 53) and EmbeddingBag raised."""
    report = check(inputs.bags_flat_case(), modes=("single", "ddp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["error", "error"], report.render()
    error = report.runs[0].reason
    assert "reversed sample order" in error and "offsets[0] has to be 0" in error, error
    assert "cut along dim 0 = 16: batch[0][1], batch[1]" in error and "given whole: batch[0][0] (dim 0 = " in error
    assert "ddparity.samples([...])" in error and "ddparity.whole(...)" in error
    assert report.exit_code == 2


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "hsdp"])
def test_bags_as_samples_pass_clean_and_catch_a_summed_loss(mode):
    assert check(inputs.bags_case(), modes=("single", mode), world_sizes=(2, 4)).ok
    summed = check(inputs.bags_case(summed=True), modes=("single", mode), world_sizes=(2, 4))
    assert [r.status for r in summed.runs] == ["pass", "diverged", "diverged"], summed.render()
    assert all(any(n.startswith("likely cause: a loss summed") for n in r.notes) for r in summed.runs[1:]), summed.render()


def test_sparse_gradients_are_compared_under_ddp_and_refused_by_fsdp_with_the_fix():
    """FSDP2 raised a NotImplementedError from inside backward, ~50 lines of dispatch keys."""
    clean = check(inputs.bags_case(sparse=True), modes=("single", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in clean.runs] == ["pass", "pass", "pass", "error", "error", "error", "error"], clean.render()
    error = clean.runs[3].reason
    assert "FSDP2 cannot reduce sparse gradients: embedding" in error and "sparse=False" in error, error
    assert "ignored_params" in error and "dispatch" not in clean.render()
    summed = check(inputs.bags_case(summed=True, sparse=True), modes=("single", "ddp"), world_sizes=(2,))
    assert [r.status for r in summed.runs] == ["pass", "diverged"], summed.render()
    assert any(w.name == "embedding.weight" for w in summed.runs[1].worst)  # the sparse gradient, compared
