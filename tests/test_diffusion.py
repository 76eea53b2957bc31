"""A diffusion model's step draws each sample's noise and timestep: drawn per sample, the same
in every mode, so DDPM's step is compared as sharply as one without randomness, and its bugs
named (ddparity.fixtures.diffusion; diffusers' own UNet2DModel in tests/real_models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddparity import Case, check
from ddparity.errors import CaseError
from ddparity.fixtures import diffusion, models
from tests.conftest import older_torch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("order", ["micro_batches", "timesteps_first", "drawn_apart", "sized_noise", "reversed_sliced"])
def test_noise_and_timesteps_drawn_per_micro_batch_in_the_step_are_aligned_per_sample(order):
    """Accumulation: a draw shaped like the micro-batch (a slice of the share) takes its rows;
    one with no template (the timesteps, diffusers' torch.randn(x.shape)) the next rows at its
    source line. A sample is drawn for in a micro-batch of 2 at world size 2 and of 4 on one
    device alike. Micro-batches taken last first pass where their draws are the whole share's,
    sliced."""
    report = check(diffusion.ddpm(order), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2,))
    assert report.ok, report.render()
    draws = 2 if order == "reversed_sliced" else 4  # drawn for the whole share: one noise, one timestep draw
    assert f"({draws} draw(s) a step" in report.runs[0].notes[0], report.runs[0].notes


def test_the_same_sample_gets_the_same_draws_in_a_micro_batch_of_any_size():
    from ddparity.harness.ranks.randomness import AlignedDropout

    rows = torch.arange(4, 8)
    x = torch.randn(4, 3)
    aligned = AlignedDropout(nn.Linear(3, 3), seed=7)
    try:
        aligned.begin(0, rows, x)
        parts = [(torch.randn_like(p), torch.randint(0, 100, (len(p),))) for p in x.chunk(2)]
    finally:
        aligned.close()
    whole = AlignedDropout(nn.Linear(3, 3), seed=7)
    try:  # the same samples (global 4..7) drawn for as the second micro-batch of 4 of a larger share
        whole.begin(0, torch.arange(8), torch.randn(8, 3))
        share = whole.scope.sources[0]
        drawn = [(torch.randn_like(p), torch.randint(0, 100, (len(p),))) for p in share.chunk(2)]
        noise, t = drawn[1]
    finally:
        whole.close()
    assert torch.equal(torch.cat([p[0] for p in parts]), noise) and torch.equal(torch.cat([p[1] for p in parts]), t)


def test_draws_with_no_template_for_micro_batches_given_to_the_model_last_first_are_an_error():
    """The forwards' inputs (slices of the share) tell the micro-batches' order; timesteps with
    no template took the share's rows in order. In order: no error."""
    from ddparity.harness.ranks.randomness import AlignedDropout

    model = nn.Linear(3, 3)
    for order, error in ((slice(None), False), (slice(None, None, -1), True)):
        aligned = AlignedDropout(model, seed=7)
        try:
            aligned.begin(0, torch.arange(8), torch.randn(8, 3))
            for part in aligned.scope.sources[0].chunk(4)[order]:
                t = torch.randint(0, 100, (len(part),))
                model(part).mul(t[:, None])
            if error:
                with pytest.raises(CaseError, match=r"took the share's next rows \(0:2\), while the micro-batch it "
                                                    r"was drawn for holds rows 6:8"):
                    aligned.end_step(0)
            else:
                aligned.end_step(0)
        finally:
            aligned.close()


def test_ddpm_passes_in_every_mode_with_noise_and_timesteps_drawn_per_sample():
    """Before, every such step was an error (aten.randint, aten.randn_like: no verdict)."""
    report = check(diffusion.ddpm(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2, 4))
    assert report.ok, report.render()
    assert "random draws compared on" in report.runs[0].notes[0] and "(2 draw(s) a step" in report.runs[0].notes[0]
    if not older_torch():  # the threaded backend is refused there
        simulated = check(diffusion.ddpm(), modes=("ddp",), world_sizes=(8,), backend="threaded")
        assert simulated.ok, simulated.render()


@pytest.mark.parametrize("bug, cause", [("summed", "a loss summed over the batch"),
                                        ("over_world_size", "a mean loss divided by the world size")])
def test_ddpm_bugs_are_named_at_step_0_by_orders_of_magnitude(bug, cause):
    report = check(diffusion.ddpm(bug), modes=("single", "ddp", "fsdp"), world_sizes=(2, 4))
    for run in report.runs[1:]:
        d = run.first_divergence
        assert run.status == "diverged" and d.step == 0 and d.max_abs > 1e3 * d.tolerance, report.render()
        [named] = [n for n in run.notes if n.startswith("likely cause")]
        assert cause in named, named


@pytest.mark.parametrize("bug, said", [
    ("one_timestep", ["for fewer rows than the samples at hand (torch.randint at diffusion.py:",
                      "for 1 of its 8 samples", "a draw for the whole batch (one timestep for every sample"]),
    ("first_only", ["(torch.rand at diffusion.py:", "for 4 of its 8 samples", "or for some micro-batches only"]),
    ("reversed", ["micro-batches at step 0 are not given to the model in the order its draws took them: torch.randint "
                  "at diffusion.py:", "took the share's next rows (0:4), while the micro-batch it was drawn for holds "
                  "rows 4:8", "Draw for the whole share before the loop and slice it"])])
def test_draws_no_mode_can_make_alike_per_sample_are_errors_naming_them(bug, said):
    """One timestep for the whole batch, a draw for the first micro-batch's samples alone: the
    line and how few of the samples it drew for; timesteps drawn with no template for
    micro-batches taken last first (their shaped noise tells the order): the line and the rows.
    Errors, never a verdict (before, the reversed loop was a divergence: a false alarm)."""
    report = check(diffusion.ddpm(bug), modes=("single", "ddp"), world_sizes=(2,))
    assert report.exit_code == 2 and all(r.status == "error" for r in report.runs), report.render()
    reason = report.runs[0].reason
    assert all(s in reason for s in said), reason


def test_draws_from_pythons_random_module_are_an_error_naming_it_not_a_divergence():
    """Every process draws from its own state there: before, the reference passed and the DDP
    runs were an error that guessed ("the step depends on the order of the samples in the
    batch (or on randomness or state outside the batch)"); now the draw is named."""
    report = check(diffusion.ddpm("python_random"), modes=("single", "ddp"), world_sizes=(2,))
    assert report.exit_code == 2 and all(r.status == "error" for r in report.runs), report.render()
    reason = report.runs[0].reason
    assert "draws random numbers from Python's random module at step 0" in reason and "torch.randint" in reason


def test_an_output_dataparallel_cannot_gather_is_said_as_such_not_as_the_steps_crash():
    """diffusers' UNet2DOutput under DataParallel: its gather rebuilds the output from (key,
    value) pairs, which the dataclass takes as its one field; the step then got a generator
    ("'generator' object has no attribute 'size'", a crash in the user's step)."""
    report = check(diffusion.ddpm("dataclass_output"), modes=("single", "dp", "ddp"), world_sizes=(2,))
    single, dp, ddp = report.runs
    assert single.ok and ddp.ok, report.render()
    assert dp.status == "error" and "DataParallel's gather rebuilds the model's output, a DenoiserOutput" in dp.reason
    assert "its 'sample' would be generator" in dp.reason and "return_dict=False" in dp.reason, dp.reason


def _draws(rows: torch.Tensor, batch: torch.Tensor) -> list[torch.Tensor]:
    from ddparity.harness.ranks.randomness import AlignedDropout

    aligned = AlignedDropout(nn.Linear(3, 3), seed=7)
    try:
        aligned.begin(0, rows, batch)
        n = len(rows)
        return [torch.randn_like(batch), torch.randint(0, 100, (n,)), torch.empty(n, 3).uniform_(2.0, 3.0),
                torch.rand(n, 1, 1), torch.empty(n, 5).bernoulli_(0.25), torch.randn(n, 2, dtype=torch.float64),
                torch.bernoulli(torch.full((n, 4), 0.5)), torch.empty(n, 3).normal_(1.0, 0.5)]
    finally:
        aligned.close()


def test_a_samples_draws_are_the_same_in_the_whole_batch_in_a_shard_and_reversed():
    batch = torch.zeros(8, 3)
    whole = _draws(torch.arange(8), batch)
    shard = _draws(torch.arange(4, 8), batch[4:])
    backwards = _draws(torch.arange(8).flip(0), batch)
    for w, s, b in zip(whole, shard, backwards):
        assert w.dtype == s.dtype and torch.equal(w[4:], s) and torch.equal(w.flip(0), b)
    randn, ints, uniform, rand, coin, wide, bern, normal = whole
    assert ints.dtype == torch.int64 and 0 <= int(ints.min()) and int(ints.max()) < 100
    assert 2.0 <= float(uniform.min()) and float(uniform.max()) < 3.0 and rand.shape == (8, 1, 1)
    assert set(coin.unique().tolist()) <= {0.0, 1.0} and wide.dtype == torch.float64
    assert set(bern.unique().tolist()) <= {0.0, 1.0} and normal.shape == (8, 3)
    assert len({tuple(r.tolist()) for r in randn}) == 8  # each sample its own


def test_aligned_draws_have_torchs_distribution_and_leave_other_draws_to_torch():
    from ddparity.harness.ranks.randomness import AlignedDropout

    original = torch.randn
    aligned = AlignedDropout(nn.Linear(3, 3), seed=0)
    try:
        aligned.begin(0, torch.arange(4096), torch.zeros(4096, 8))
        noise = torch.randn(4096, 8)
        assert abs(float(noise.mean())) < 0.02 and abs(float(noise.std()) - 1) < 0.02
        state = torch.random.get_rng_state()
        assert torch.equal(torch.randn(4096, generator=torch.Generator().manual_seed(1)),
                           original(4096, generator=torch.Generator().manual_seed(1)))  # a generator of its own
        assert torch.equal(torch.random.get_rng_state(), state)
        torch.randn(5000, 2)  # dim 0 more than the samples: torch's generator
        assert not torch.equal(torch.random.get_rng_state(), state)
        state = torch.random.get_rng_state()
        torch.randn(3)  # fewer: taken as a micro-batch's, and the step's end says it drew for 3 of 4096
        with pytest.raises(CaseError, match=r"torch.randn at test_diffusion.py:\d+ for 3 of its 4096 samples"):
            aligned.end_step(0)
        nn.init.uniform_(nn.Parameter(torch.empty(4096, 2)))  # a parameter (re)initialised: torch's draw
        assert not torch.equal(torch.random.get_rng_state(), state)
    finally:
        aligned.close()
    assert torch.randn is original


class _AttentionAndNoise(nn.Module):
    """Attention without dropout beside a draw for the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 1, 4, 4)
        x = torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(x.shape)
        return self.fc(x + torch.randn(x.shape[-1]))


def test_an_attention_kernel_without_dropout_is_not_named_as_a_draw():
    """diffusers' UNet: the error named aten._scaled_dot_product_flash_attention_for_cpu x4
    (its dropout_p left at its default, 0) beside the step's real draws."""
    report = check(Case(model=_AttentionAndNoise, data=models.vectors, steps=2, name="attention and noise"),
                   world_sizes=(2,))
    reason = report.runs[0].reason
    assert "at step 0 (aten.randn in the model (_AttentionAndNoise))" in reason, reason
    assert "scaled_dot_product" not in reason, reason
