"""No gradient all-reduced at step 0 (every parameter differs across ranks) has three causes
with one signature; what each rank recorded tells them apart: a hook on DDP's forward counts
its calls and whether gradient sync was on, and the ledger holds every collective the case's
comm hook issued. Each fixture, at real and simulated world sizes, names its own cause with
that evidence; where the evidence names none, the line says "candidate causes"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddparity import Case, check
from ddparity.checks.causes import likely_cause
from ddparity.fixtures import bugs, compiled, loops
from ddparity.fixtures.models import MLP, regression
from ddparity.verdicts import Desync

HEAD = "likely cause: no gradient was all-reduced at step 0 ("
PHRASES = ("DDP's forward never ran", "a missed sync", "comm hook returns its buckets unreduced")


def _cause(case, world_sizes, **options):
    report = check(case, modes=("single", "ddp"), world_sizes=world_sizes, **options)
    out = {}
    for run in report.runs:
        if run.mode == "ddp":
            assert run.status == "desync", report.render()
            [out[run.world_size]] = [n for n in run.notes if "cause" in n]
    return out


@pytest.mark.parametrize("world_sizes", [(2, 4), (8,)], ids=["real", "simulated"])
@pytest.mark.parametrize("factory, says, evidence", [
    (bugs.ddp_bypassed, "DDP's forward never ran", "evidence: a hook on DDP's forward saw no call at step 0"),
    (loops.late_sync, "a missed sync", "at step 0 over the ranks, each with gradient sync off"),
    (bugs.comm_hook_never_reduces, "the case's comm hook returns its buckets unreduced",
     "and no collective issued by the comm hook"),
])
def test_each_way_of_reducing_nothing_is_named_from_what_the_ranks_recorded(factory, says, evidence, world_sizes):
    for ws, cause in _cause(factory(), world_sizes).items():
        assert cause.startswith(HEAD) and says in cause and evidence in cause, (ws, cause)
        assert not any(p in cause for p in PHRASES if p not in says), (ws, cause)  # one cause, not two


@pytest.mark.breadth
def test_a_compiled_inner_module_is_ddp_bypassed():
    [cause] = _cause(compiled.inner_module_compiled(), (2,), compile="aot_eager").values()
    assert cause.startswith(HEAD) and "DDP's forward never ran" in cause, cause


def _replaced_after_backward(model, batch, optimizer, ctx):
    """DDP all-reduces (its forward ran, sync on, the hook reduces), then each rank puts its
    own local gradient back: the ranks train alone, with every record in order."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    local = torch.autograd.grad(F.mse_loss(getattr(model, "module", model)(x), y), list(model.parameters()))
    for p, g in zip(model.parameters(), local):
        p.grad = g
    optimizer.step()
    return F.mse_loss(model(x), y).detach()


def _averaging_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects non-GradBucket annotations
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future().then(
        lambda f: f.value()[0])


@pytest.mark.parametrize("world_sizes", [(2,), (8,)], ids=["real", "simulated"])
def test_a_reducing_hook_and_a_synced_forward_leave_candidates_only(world_sizes):
    """Every record says DDP reduced: no cause can be named from them, so none is claimed."""
    case = Case(model=MLP, data=regression, optimizer="sgd", lr=0.05, steps=2, train_step=_replaced_after_backward,
                comm_hook=_averaging_hook)
    for ws, cause in _cause(case, world_sizes).items():
        assert cause.startswith("candidate causes: no gradient was all-reduced at step 0"), (ws, cause)
        assert "although DDP's forward ran with gradient sync on" in cause, cause


def test_without_forward_counts_the_missed_sync_line_stands_alone():
    desync = Desync(step=0, what="replica state", ranks=[1], differs=[f"param p{i}" for i in range(4)])
    plain = likely_cause([], 2, desync, params=4)
    assert plain.startswith(HEAD) and "a missed sync" in plain and "evidence" not in plain, plain
    bypass = likely_cause([], 2, desync, params=4, forwards=[{}, {}])
    assert "DDP's forward never ran" in bypass, bypass
    synced = likely_cause([], 2, desync, params=4, forwards=[{0: (1, 1)}, {0: (1, 1)}], hook_collectives=0)
    assert "comm hook returns its buckets unreduced" in synced and "evidence: 2 forward(s)" in synced, synced


def test_parameters_whose_last_gradient_went_around_ddp_are_named_where_a_synced_forward_ran():
    """Part of a step around DDP (a GAN's generator pass through model.module): DDP's forward
    ran with sync on for another pass, so no "nothing reduced" line fits; the parameters that
    differ and, on every rank, got their last gradient from a backward no synced DDP forward
    preceded are named, in model order. Evidence on one rank only, or no synced forward at
    that step (a missed sync's own line), names none."""
    differs = ["param d.weight", "param g.weight", "param g.bias", "grad g.weight"]
    desync = Desync(step=0, what="replica state", ranks=[1], differs=differs)
    synced = [{0: (2, 2)}, {0: (2, 2)}]
    both = [{0: ["g.bias", "g.weight", "h.weight"]}, {0: ["g.weight", "g.bias"]}]
    cause = likely_cause([], 2, desync, params=8, forwards=synced, bypassed=both)
    assert cause.startswith("likely cause: the gradients of g.weight, g.bias (2 of 8 parameters) reached "
                            "optimizer.step() at step 0 from a backward that no DDP forward with gradient sync on "
                            "preceded"), cause
    assert "model.module.head(h)" in cause, cause
    one_rank = likely_cause([], 2, desync, params=8, forwards=synced, bypassed=[both[0], {}])
    assert one_rank is None or "reached optimizer.step()" not in one_rank, one_rank
    unsynced = likely_cause([], 2, desync, params=3, forwards=[{0: (2, 0)}, {0: (2, 0)}], bypassed=both)
    assert unsynced.startswith(HEAD) and "a missed sync" in unsynced, unsynced


def test_a_backward_nested_in_a_synced_one_counts_as_synced():
    """A reentrant checkpoint runs its block's backward inside the outer backward (another
    graph task, ended first): its parameters' gradients are the synced pass's."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import checkpoint

    from ddparity.harness.ranks.modes.ddp import SyncedPasses

    block, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    passes = SyncedPasses(SimpleNamespace(module=torch.nn.ModuleDict({"block": block, "head": head})))
    x = torch.randn(3, 4, requires_grad=True)
    passes.armed = True  # DDP's forward, sync on
    head(checkpoint(block, x, use_reentrant=True)).sum().backward()
    assert sorted(passes.last) == ["block.bias", "block.weight", "head.bias", "head.weight"]
    assert passes.unsynced() == [] and not passes.armed  # the backward ended: disarmed
    head(block(x)).sum().backward()  # a forward around DDP
    assert sorted(passes.unsynced()) == ["block.bias", "block.weight", "head.bias", "head.weight"]


@pytest.mark.parametrize("rank", [0, -1])
def test_two_replicas_that_disagree_are_told_apart_by_the_reference(rank):
    """DDP at two ranks and an HSDP shard's two replicas: no majority, but the rank that moved
    its replica is off the single-device reference by far more than the other: it is named."""
    report = check(bugs.replica_nudged(rank), modes=("single", "ddp", "hsdp"), world_sizes=(2, 4), hsdp_shard=2)
    named = {(r.mode, r.world_size): (r.desync.ranks, r.desync.agreeing_ranks) for r in report.runs if r.desync}
    assert named[("ddp", 2)] == ([rank % 2], [1 - rank % 2]), named
    assert named[("ddp", 4)] == ([rank % 4], sorted(set(range(4)) - {rank % 4})), named
    culprit = rank % 4
    assert named[("hsdp", 4)] == ([culprit], [(culprit + 2) % 4]), named  # shard (culprit % 2)'s two replicas
    assert "nothing recorded shows which" not in report.render()


def test_accumulation_without_no_sync_passes_with_the_traffic_it_could_save():
    """Correct (DDP's all-reduce is linear) and twice the traffic: a note on the passing run,
    none where no_sync() is used or where one forward runs a step."""
    report = check(loops.accumulation_without_no_sync(), modes=("single", "ddp"), world_sizes=(2, 8))
    assert report.ok, report.render()
    for run in report.runs[1:]:
        [note] = [n for n in run.notes if n.startswith("traffic:")]
        assert "all-reduced every gradient 2 times in a step" in note, note
        assert "would send 6.8 kB less a step per rank (13.5 kB -> 6.8 kB)" in note, note  # MLP: 1732 float32
    for clean in (loops.accumulation(), bugs.clean_regression()):
        quiet = check(clean, modes=("single", "ddp"), world_sizes=(2,))
        assert quiet.ok and not any(n.startswith("traffic:") for r in quiet.runs for n in r.notes), quiet.render()


def test_where_a_step_first_differs_decides_a_uniform_gradient_scale():
    """The numbers alone (every gradient off by one factor, the loss matching) fit a loss
    divided before backward() and a comm hook that scales; the first differing place
    decides: at the loss, the step; in the reduction, after every rank's backward."""
    from ddparity.checks.placed import scale_placed

    cause = ("likely cause: all 6 gradients are scaled by the same factor (relative error 0.5 in each, the loss "
             "matches) (an unaveraged sum is off by 1, a double division by 0.5): a comm hook or step that scales")
    at_loss = scale_placed(cause, "loss", 0.5, 2, "fsdp")
    assert at_loss is not None and at_loss.startswith(cause[:cause.index(")") + 1] + ": the loss the step gave")
    assert "a loss divided by the world size before backward" in at_loss and "FSDP already averages" in at_loss
    assert "comm hook" not in at_loss
    other = scale_placed(cause, "loss", 0.3, 2, "ddp")
    assert other is not None and "a loss scaled before backward()" in other and "world size" not in other
    reduced = scale_placed(cause, "reduction", None, 2, "ddp")
    assert reduced is not None and "after every rank's backward, by a comm hook" in reduced
    assert scale_placed(cause, "forward", None, 2, "ddp") is None  # another place: the numbers' line stands
    assert scale_placed("likely cause: BatchNorm on shards (bn)", "loss", 0.5, 2, "ddp") is None


def test_a_loss_first_differing_at_a_later_step_at_the_loss_itself_names_a_per_shard_mean():
    """Step 0 can agree by chance (each shard held exactly its share of the batch's hardest
    samples): the first differing step says at which step, and what the earlier steps did."""
    from ddparity.checks.placed import per_shard_denominator

    at_0 = per_shard_denominator(1.0, 0.8, 2, "ddp")
    assert at_0 is not None and at_0.startswith("candidate causes: every module's forward agrees and the loss differs")
    later = per_shard_denominator(1.0, 0.8, 2, "ddp", step=2)
    assert later is not None and later.startswith("candidate causes: at step 2, every step before it agreeing, every")
    assert per_shard_denominator(2.0, 0.8, 2, "ddp", step=2) is None  # a summed loss: not a mean
    assert per_shard_denominator(1.0, 0.5, 2, "ddp", step=2) is None  # 1/W: the loss's own signatures
    assert per_shard_denominator(None, 0.8, 2, "ddp") is None


def test_a_batchnorm_layer_first_differing_in_forward_names_batchnorm_on_shards():
    """Where running statistics cannot tell (micro-batches): the place does. Only a BatchNorm
    layer (not SyncBatchNorm) whose input agrees."""
    from ddparity.checks.placed import normalised_apart
    from ddparity.verdicts import ModuleFinding

    def at(type_: str, agrees_ok: bool | None = True, phase: str = "forward") -> ModuleFinding:
        return ModuleFinding(step=0, rank=1, phase=phase, module="net.bn", type=type_, differs="output",
                             error=0.3, tolerance=1e-6, agrees="input", agrees_ok=agrees_ok)

    ddp = normalised_apart(at("BatchNorm2d"), "ddp")
    assert ddp is not None and ddp.startswith("likely cause: BatchNorm on shards (net.bn (BatchNorm2d)): each rank")
    dp = normalised_apart(at("BatchNorm1d"), "dp")
    assert dp is not None and "each replica normalises its chunk" in dp
    assert normalised_apart(at("SyncBatchNorm"), "ddp") is None
    assert normalised_apart(at("BatchNorm1d", agrees_ok=False), "ddp") is None  # its input differs already
    assert normalised_apart(at("BatchNorm1d", agrees_ok=None), "ddp") is None
    assert normalised_apart(at("LayerNorm"), "ddp") is None
    assert normalised_apart(at("BatchNorm1d", phase="backward"), "ddp") is None


def test_a_clip_by_each_ranks_own_shards_norm_is_named_with_each_ranks_factor():
    """FSDP: gradients clipped by a norm taken over the local shards (``to_local()``) are each
    rank's one factor of the reference's, a factor of its own; every module agrees. Its clean
    twin (``clip_grad_norm_``, whose DTensor norm is the whole model's) passes, and the same
    hand-written clip is right under DDP, whose ranks hold whole gradients."""
    report = check(loops.clipped("shard"), modes=("single", "ddp", "fsdp"), world_sizes=(2, 4))
    assert [(r.mode, r.world_size, r.status) for r in report.runs] == [
        ("single", 1, "pass"), ("ddp", 2, "pass"), ("ddp", 4, "pass"), ("fsdp", 2, "diverged"),
        ("fsdp", 4, "diverged")], report.render()
    for run in report.runs[3:]:
        assert run.first_divergence.module.phase == "reduction", run.notes
        cause = next(n for n in run.notes if n.startswith("likely cause"))
        assert cause.startswith("likely cause: at step 0 each rank's gradients were scaled after the reduction by a "
                                "factor of its own (rank 0 "), cause
        assert "p.grad.to_local()" in cause and "clip_grad_norm_ on FSDP's DTensor" in cause
        assert all(f"rank {r} " in cause for r in range(run.world_size))
    assert check(loops.clipped(), modes=("single", "fsdp"), world_sizes=(2, 4)).ok


def test_each_ranks_own_gradient_factor_is_a_cause_only_where_the_factors_differ_and_fit():
    from ddparity.checks.placed import scaled_per_rank

    assert scaled_per_rank(0, {0: (1.4, 1e-9), 1: (1.6, 1e-9)}, "fsdp") is not None
    assert "depends on the rank" in scaled_per_rank(1, {0: (1.0, 0.0), 1: (2.0, 0.0)}, "ddp")
    assert scaled_per_rank(0, {0: (1.4, 1e-9), 1: (1.4, 1e-9)}, "fsdp") is None  # one factor: the uniform scale's
    assert scaled_per_rank(0, {0: (1.4, 1e-9), 1: (1.6, 0.01)}, "fsdp") is None  # rank 1's is no one factor
    assert scaled_per_rank(0, {0: (1.4, 1e-9)}, "fsdp") is None
    many = scaled_per_rank(0, {r: (1 + r / 10, 0.0) for r in range(6)}, "hsdp")
    assert many is not None and "rank 3 1.3x and 2 more the reference's" in many


def test_an_update_of_one_factor_is_read_within_the_twins_own_rounding_and_no_wider_than_the_cap():
    """An optimizer that computes in bf16 (Muon) leaves a correct update off one factor by its
    own rounding, which the twin measures: within it, the factor names lr x W (under FSDP, though
    one rank's shard sat under its tolerance). A rank-local learning rate (x3 on one of two
    ranks: the whole update 2x, 1 - cos^2 = 0.2) stays unnamed under any twin noise."""
    from ddparity.checks.placed import after_the_gradients

    muon_twin = (0.9918, 0.032)
    named = after_the_gradients(0, 2, "fsdp", [1], (1.9916, 0.0046), muon_twin)
    assert named.startswith("likely cause: the learning rate multiplied by the world size (2)"), named
    assert not after_the_gradients(0, 2, "fsdp", [1], (1.9916, 0.0046)).startswith("likely cause")  # no twin noise
    assert not after_the_gradients(0, 2, "ddp", [1], (2.0, 0.2), (0.949, 0.099)).startswith("likely cause")
    assert not after_the_gradients(0, 2, "ddp", [0, 1], (2.0, 0.2), (0.949, 0.099)).startswith("likely cause")
