"""Parameters a step changes in place outside ``optimizer.step()``: an embedding's
``max_norm`` (renormalised in its forward) and a centre moved in forward, kept in a
parameter. Each is caught in every data-parallel mode with the change named as its cause
(it was guessed as a learning rate x W before); their clean twins pass; DataParallel's
emulation keeps what real DataParallel keeps."""

from __future__ import annotations

import pytest

from ddparity import check
from ddparity.fixtures import in_place

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

MODES = ("single", "dp", "ddp", "fsdp", "hsdp")
HOW = {"dp": "DataParallel renormalises, on every device but the first, a copy of the weight",
       "ddp": "each DDP rank renormalises only the rows its own shard's samples look up",
       "fsdp": "each FSDP rank renormalises the weight it gathered from the shards",
       "hsdp": "each HSDP rank renormalises the weight it gathered from the shards"}


def test_an_embeddings_max_norm_is_named_in_every_mode_and_bounded_vectors_pass():
    report = check(in_place.embedding_max_norm(), modes=MODES, world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["pass"] + ["diverged"] * 2 + ["desync"] * 2 + ["diverged"] * 4, \
        report.render()
    for run in report.runs[1:]:
        assert run.first_divergence.step == 0, report.render()
        [cause] = [n for n in run.notes if n.startswith("likely cause")]
        assert "the step changes 'emb.weight' (Embedding(max_norm=1)) in place outside optimizer.step()" in cause
        assert HOW[run.mode] in cause and "drop max_norm" in cause, cause
        assert not any("learning rate" in n for n in run.notes), run.notes
    clean = check(in_place.embedding_bounded(), modes=MODES, world_sizes=(2, 4))
    assert clean.ok, clean.render()


def test_a_centre_moved_in_forward_in_a_parameter_is_a_candidate_and_a_buffer_from_the_whole_batch_passes():
    report = check(in_place.codebook_in_a_parameter(), modes=MODES, world_sizes=(2, 4))
    assert not report.ok
    for run in report.runs[1:]:
        assert run.status in ("diverged", "desync") and run.first_divergence.step == 0, report.render()
        assert any(n.startswith("candidate causes: the step changes 'centre' (Codebook) in place") for n in run.notes), \
            run.notes
        if run.mode == "fsdp":
            assert any("which it frees after the forward, so the change is lost" in n for n in run.notes), run.notes
        if run.mode == "dp":
            assert any("parameters changed in forward: forward changes centre in place on replicas after the first"
                       in n for n in run.notes), run.notes
    clean = check(in_place.codebook_in_a_buffer(), modes=("single", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    assert clean.ok, clean.render()


def test_the_reference_records_what_its_step_changed_outside_the_optimizer_and_nothing_else():
    import torch
    import torch.nn.functional as F

    from ddparity import Case
    from ddparity.fixtures.models import MLP, vectors
    from ddparity.harness.ranks.modes.single import SingleMode
    from ddparity.harness.ranks.spool import Writer
    from ddparity.harness.ranks.training import initial_state, train
    from ddparity.harness.spool_files import Spool

    def clamped(model, batch, optimizer, ctx):  # WGAN-style: the weights clipped after the step
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.net[0].weight.clamp_(-0.1, 0.1)
        return loss.detach()

    def trained(case):
        with Spool() as spool:
            return train(case, initial_state(case), "cpu", SingleMode(case.steps), Writer(spool.path))

    assert trained(Case(model=MLP, data=vectors, optimizer="adamw", steps=2)).changed_outside == {}
    assert trained(Case(model=MLP, data=vectors, optimizer="sgd", steps=2, train_step=clamped)).changed_outside == {
        0: {"net.0.weight": "Linear"}, 1: {"net.0.weight": "Linear"}}
    assert trained(in_place.embedding_max_norm()).changed_outside[0] == {"emb.weight": "Embedding(max_norm=1)"}

    def clamped_through_data(model, batch, optimizer, ctx):  # the same clipping, as older WGAN code writes it
        loss = clamped(model, batch, optimizer, ctx)
        model.net[2].weight.data.clamp_(-0.1, 0.1)
        return loss

    assert trained(Case(model=MLP, data=vectors, optimizer="sgd", steps=1, train_step=clamped_through_data)
                   ).changed_outside == {0: {"net.0.weight": "Linear", "net.2.weight": "Linear"}}
    assert trained(in_place.codebook_through_data()).changed_outside == {s: {"centre": "Codebook"} for s in range(3)}


def test_a_centre_moved_through_data_is_named_as_a_candidate_too():
    """``.data`` leaves the version counter alone: the change is seen by the parameter's sum."""
    report = check(in_place.codebook_through_data(), modes=("single", "ddp"), world_sizes=(2,))
    run = report.runs[1]
    assert run.status in ("diverged", "desync") and run.first_divergence.step == 0, report.render()
    assert any(n.startswith("candidate causes: the step changes 'centre' (Codebook) in place") for n in run.notes), \
        run.notes
