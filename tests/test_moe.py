"""Mixture-of-experts models (:mod:`ddparity.fixtures.moe`, transformers' Mixtral in the
real-models tier): a router whose gradient is rounding alone is no divergence, and an
auxiliary loss that data parallelism trains otherwise is named where it enters the model,
not read as a per-rank token mean from the batch's padding."""

from __future__ import annotations

import pytest

from ddparity import check
from ddparity.checks.causes import OWN_VALID_ENTRIES
from ddparity.checks.placed import reread
from ddparity.fixtures import moe
from ddparity.verdicts import Divergence, ModuleFinding

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

INSIDE = "likely cause: a term of the loss computed inside layers.1 (Experts)"


def test_a_router_whose_gradient_is_a_cancelled_sum_passes():
    """One expert per token, renormalised: the router's gradient is analytically 0. A correct
    run's kernels of another batch size change its rounding by ~100%; the twin, given token
    ids it cannot jitter, computed it bit for bit before the embeddings' rows were jittered
    (then: diverged at 2 and 4 ranks, ddp and fsdp)."""
    report = check(moe.top1_clean(), modes=("single", "ddp", "fsdp"), world_sizes=(2, 4))
    assert report.ok, report.render()


@pytest.mark.parametrize(("fixture", "modes"), [("aux_per_rank", ("ddp", "fsdp")),
                                                ("aux_scaled_with_the_loss", ("ddp",))])
def test_an_auxiliary_loss_is_named_where_it_enters_not_read_from_the_padding(fixture, modes):
    report = check(getattr(moe, fixture)(), modes=modes, world_sizes=(2, 4))
    for run in report.runs[1:]:
        d = run.first_divergence
        assert run.status == "diverged" and d.step == 0 and d.kind == "loss", report.render()
        assert d.max_abs >= 100 * d.tolerance, (run.mode, run.world_size, d)
        assert d.module.phase == "backward" and d.module.module == "layers.1", d.module
        [cause] = [n for n in run.notes if n.startswith(("likely cause", "candidate causes"))]
        assert cause.startswith(INSIDE) and f"that {run.mode.upper()} does not train" in cause, cause
        assert "transformers' Trainer scales the model's whole loss" in cause


def test_the_place_replaces_a_per_rank_token_mean_it_contradicts():
    """The padding alone (uneven valid entries) names a per-rank token mean; where the loss's own
    gradient agrees and a module inside adds what differs, that cause is replaced. A module
    whose *output* gradient differs (the loss's own, computed inside a transformers model)
    leaves it standing."""
    padding = f"{OWN_VALID_ENTRIES[0]}: batch['labels'] has 78, 81 valid entries on the ranks' shards"
    first = Divergence(step=0, kind="loss", name="loss", rank=0, max_abs=1e-3, max_rel=1e-4, tolerance=1e-5)
    inside = ModuleFinding(step=0, rank=0, phase="backward", module="model.layers.1", type="MixtralDecoderLayer",
                           differs="input gradient", agrees="output gradient", agrees_error=0.0, agrees_ok=True)
    [note] = reread([padding], inside, first, [first], 2, "ddp", True, lambda: 1.0)
    assert note.startswith("likely cause: a term of the loss computed inside model.layers.1 (MixtralDecoderLayer)")
    assert note.endswith("its input gradient differs, and so does the loss")
    at_head = ModuleFinding(step=0, rank=0, phase="backward", module="lm_head", type="Linear",
                            differs="output gradient")
    assert reread([padding], at_head, first, [first], 2, "ddp", True, lambda: 1.0) == [padding]
    grad_first = Divergence(step=0, kind="grad", name="w", rank=0, max_abs=1e-3, max_rel=1e-4, tolerance=1e-5)
    [candidates] = reread([], inside, grad_first, [grad_first], 2, "fsdp", True, lambda: 1.0)
    assert candidates.startswith("candidate causes: a term of the loss computed inside model.layers.1")
    assert "or a backward of model.layers.1 (MixtralDecoderLayer) that differs" in candidates
    [replicas] = reread([], inside, first, [first], 2, "dp", True, lambda: 1.0)  # Qwen2-MoE under DataParallel
    assert "that DataParallel does not train" in replicas and "computed from each replica's own chunk" in replicas


def test_experts_idle_on_some_ranks_are_named_under_ddp_and_fsdp():
    """Experts no token of a shard was routed to are skipped (Switch Transformers' way): DDP's
    bucket holding them was never all-reduced on that rank while others waited in it (gloo
    then aborted every rank on a size mismatch: a crash quoting gloo), and FSDP2
    reduce-scattered other sizes (a desync, no cause). Now: the rank that reached
    optimizer.step() with DDP's reduction unfinished names the parameters and the fix; the
    FSDP2 desync names the unused parameters and set_reduce_scatter_unused_params."""
    report = check(moe.idle_experts(), modes=("ddp", "fsdp"), world_sizes=(2, 4), timeout=60)
    for run in report.runs:
        if run.mode == "ddp":
            assert run.status == "crash", report.render()
            assert "DistributedDataParallel did not all-reduce every gradient of step 0" in run.crash.error
            assert "layers.0.experts." in run.crash.error and '"find_unused_parameters": True' in run.crash.error
            continue
        assert run.status == "desync" and run.desync.step == 0, report.render()
        [cause] = [n for n in run.notes if n.startswith("likely cause")]
        assert cause.startswith("likely cause: parameters used on some ranks only: FSDP2 reduce-scattered"), cause
        assert "set_reduce_scatter_unused_params(True)" in cause
    found = check(moe.idle_experts(found=True), modes=("single", "ddp"), world_sizes=(2, 4), timeout=60)
    assert found.ok, found.render()


def test_a_routing_loop_that_compiles_nothing_is_skipped_naming_the_dynamo_setting():
    """Routing by torch.nonzero breaks Dynamo's graph inside the experts' loop ("Dynamic shape
    operator"), so the whole forward ran eagerly: skipped, not passed, and the reason names the
    setting that traces it (with it set in the model factory the same check compiles 160 ops
    and passes in single, ddp and fsdp: tried by hand, as a set flag outlives a warm world)."""
    report = check(moe.top2_clean(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager", timeout=300)
    compiled = [r for r in report.runs if r.compile is not None]
    assert [r.status for r in compiled] == ["skipped", "skipped"], report.render()
    for run in compiled:
        assert "a graph break inside a loop of your forward" in run.reason, run.reason
        assert "torch._dynamo.config.capture_dynamic_output_shape_ops = True" in run.reason


def test_router_jitter_is_drawn_per_sample_and_a_bug_under_it_still_named():
    """Switch Transformers' router jitter (a uniform draw of the router's input) made every
    such model an error ("aten.uniform_ x2 in modules ... router"): drawn per sample now, the
    same in every mode, it passes, and a load-balancing loss on each rank's shard is still
    named where it enters."""
    clean = check(moe.jittered(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2, 4))
    assert clean.ok, clean.render()
    assert "(2 draw(s) a step" in clean.runs[0].notes[0], clean.runs[0].notes
    bug = check(moe.jittered("added"), modes=("single", "ddp"), world_sizes=(2,))
    [run] = bug.runs[1:]
    assert run.status == "diverged" and run.first_divergence.step == 0, bug.render()
    assert any(n.startswith(INSIDE) for n in run.notes), run.notes
