"""The first differing module: a failing run's first differing step re-run module by module
on the reference and on every rank, each rank's record compared with the reference's rows
for its samples. Every fixture with a known bug names its module (or the loss, or the
reduction) on the rank that has it (rank 0 and the last), in DDP, FSDP2 and HSDP, real and
simulated ranks; the trace's hooks change nothing the model computes; a passing check never
re-runs anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ddparity import check
from ddparity.fixtures import bugs, calibration, loops, real_models, sharded
from ddparity.harness.ranks.differing import aligned, rel
from ddparity.harness.ranks.tracing import ModuleTrace
from ddparity.render import module_line
from ddparity.verbs import check as check_module


def found(report, mode="ddp"):
    """By world size, the run's status and the module finding of its first divergence."""
    out = {}
    for run in report.runs:
        if run.mode == mode:
            d = run.first_divergence
            out[run.world_size] = (run.status, d.module if d is not None else None, run.notes)
    return out


def test_batchnorm_on_shards_is_named_in_forward_with_both_errors():
    report = check(bugs.batchnorm_on_shards(), modes=("single", "ddp"), world_sizes=(2,))
    status, m, _ = found(report)[2]
    assert status == "diverged"
    assert (m.phase, m.module, m.type, m.rank, m.step) == ("forward", "bn", "BatchNorm1d", 0, 0)
    assert m.agrees == "input" and m.agrees_ok and m.agrees_error < m.tolerance < m.error
    assert m.error > 0.05  # a shard's statistics are not the batch's
    text = report.render()
    assert ("first differing module: bn (BatchNorm1d), step 0, rank 0, forward: input agrees (rel 0), output "
            "differs (rel 0.23, tolerance 1.9e-06); inside it, the first op that differs: "
            "aten.native_batch_norm.default (rel 0.58)") in text, text
    assert m.op == "aten.native_batch_norm.default" and m.op_error > m.tolerance
    as_json = report.to_json()
    [ddp] = [r for r in as_json["runs"] if r["mode"] == "ddp"]
    module = ddp["first_divergence"]["module"]
    assert module["module"] == "bn" and module["phase"] == "forward" and module["differs"] == "output"
    assert module["op"] == "aten.native_batch_norm.default"
    assert module["agrees"] == "input" and module["error"] > module["tolerance"] and module["scale"] == "rel"


@pytest.mark.parametrize("fixture, ws, factor", [(bugs.summed_loss, 2, 0.5), (bugs.loss_over_world_size, 4, 0.25)])
def test_a_loss_off_by_a_factor_is_the_first_to_differ_with_its_factor(fixture, ws, factor):
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(ws,), backend="threaded" if ws > 2 else "auto")
    _, m, _ = found(report)[ws]
    assert m.phase == "loss" and m.module == "net.4", m
    assert m.factor == pytest.approx(factor, rel=1e-4)
    assert f"is {factor:g}x the reference's" in module_line(m)


@pytest.mark.parametrize("fixture", [bugs.ddp_bypassed, bugs.comm_hook_never_reduces])
def test_gradients_never_reduced_are_the_reductions_not_a_modules(fixture):
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(2,))
    status, m, _ = found(report)[2]
    assert status == "desync" and m.phase == "reduction", m
    assert "every module's output and activation gradient agrees" in module_line(m)


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.breadth), -1], ids=["rank0", "last"])
def test_a_replica_whose_weights_differ_is_named_on_its_own_rank(rank):
    report = check(bugs.replica_nudged(rank), modes=("single", "ddp"), world_sizes=(4,), backend="threaded")
    _, m, _ = found(report)[4]
    assert (m.phase, m.module, m.rank) == ("forward", "net.0", rank % 4), m


def test_ops_that_differ_in_number_name_no_op_and_say_why():
    from ddparity.fixtures import faults

    report = check(faults.rank_local_param(1), modes=("single", "ddp"), world_sizes=(2,))
    _, m, _ = found(report)[2]
    assert (m.phase, m.module, m.type) == ("forward", "", "FaultyMLP"), module_line(m)
    assert m.op == "" and m.note.startswith("no op named: its op sequences differ"), m.note


def test_a_gradient_missing_on_the_ranks_names_its_parameter():
    report = check(bugs.gradient_missing_under_ddp(), modes=("single", "ddp"), world_sizes=(2,))
    _, m, _ = found(report)[2]
    assert m.phase == "backward" and m.differs == "gradient of extra", m
    assert m.mismatch == "missing (the reference has one)" and "inf" not in module_line(m), module_line(m)


@pytest.mark.breadth
def test_simulated_ranks_name_it_too():
    report = check(bugs.batchnorm_on_shards(), modes=("single", "ddp"), world_sizes=(8,), backend="threaded")
    _, m, _ = found(report)[8]
    assert (m.phase, m.module) == ("forward", "bn"), m


@pytest.mark.parametrize("mode", [pytest.param("fsdp", marks=pytest.mark.breadth), "hsdp"])
def test_sharded_modes_name_the_module_by_its_own_class(mode):
    report = check(bugs.batchnorm_on_shards(), modes=("single", mode), world_sizes=(4,), backend="threaded")
    _, m, _ = found(report, mode)[4]
    assert (m.phase, m.module, m.type) == ("forward", "bn", "BatchNorm1d"), m  # not FSDPBatchNorm1d


@pytest.mark.breadth
def test_an_optimizer_side_difference_is_after_every_module(monkeypatch):
    report = check(sharded.momentum_reset(1), modes=("single", "fsdp"), world_sizes=(2,))
    status, m, _ = found(report, "fsdp")[2]
    assert status == "diverged" and m.phase == "none", m
    assert "the difference comes after them (in the optimizer step" in module_line(m)


def test_a_passing_check_re_runs_nothing(monkeypatch):
    ran = []
    monkeypatch.setattr(check_module, "_locate", lambda *args: ran.append(args) or "x")
    clean = check(bugs.clean_regression(), modes=("single", "ddp"), world_sizes=(2,))
    assert clean.ok and ran == []
    failing = check(bugs.batchnorm_on_shards(), modes=("single", "ddp"), world_sizes=(2, 4))
    assert not failing.ok and len(ran) == 2  # once per failing run


def test_a_re_run_that_fails_is_a_note_not_a_finding(monkeypatch):
    monkeypatch.setattr(check_module, "_locate", lambda *args: "the re-run of step 0 failed: boom")
    report = check(bugs.batchnorm_on_shards(), modes=("single", "ddp"), world_sizes=(2,))
    _, m, notes = found(report)[2]
    assert m is None
    assert "first differing module: not found (the re-run of step 0 failed: boom)" in notes


# -- the trace itself ------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)  # modifies the conv's (bn's) output in place
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))).flatten(1))


def _grads(model, x, trace=None):
    if trace is not None:
        trace.attach(model)
        trace.armed = True
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    if trace is not None:
        trace.armed = False
        trace.close()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_trace_changes_nothing_the_model_computes():
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(6, 3, 8, 8)
    plain_out, plain = _grads(model, x)
    trace = ModuleTrace(0)
    traced_out, traced = _grads(model, x, trace)
    assert torch.equal(plain_out, traced_out)
    assert all(torch.equal(plain[n], traced[n]) for n in plain)
    names = [c.name for c in trace.calls]
    assert names == ["conv", "bn", "act", "head", ""]  # in the order calls finish
    bn = trace.calls[1]
    assert bn.out_grads and bn.in_grads  # gradients arrived, an in-place op after them notwithstanding
    assert not model._forward_hooks and not model.conv._forward_hooks  # closed: nothing left on the model


def test_a_ranks_rows_meet_the_references_rows_for_the_same_samples():
    ref = torch.arange(24.0).reshape(8, 3)
    rows = torch.arange(4, 8)
    mine, theirs, is_rows = aligned(ref[4:8].clone(), ref, rows, 8)
    assert is_rows and torch.equal(mine, theirs)
    seq_first = torch.arange(48.0).reshape(2, 8, 3)  # (time, batch, features)
    mine, theirs, is_rows = aligned(seq_first[:, 4:8].clone(), seq_first, rows, 8)
    assert is_rows and rel(mine, theirs) == 0
    whole = torch.ones(5)
    assert aligned(whole, whole, rows, 8)[2] is False
    assert aligned(torch.ones(3), torch.ones(5), rows, 8) is None


@pytest.mark.breadth
@pytest.mark.parametrize("fixture, phase, module", [
    (real_models.resnet_bn_on_shards, "forward", "stem.1"),
    (real_models.mobilenet_batch_statistics, "forward", "expand.1"),
    (real_models.gpt2_summed, "loss", "lm_head"),
    (real_models.gpt2_per_rank_mean, "loss", ""),
    (real_models.gpt2_late_sync, "reduction", ""),
    (real_models.gpt2_unaveraged_hook, "reduction", ""),
    (real_models.bert_summed, "loss", "classifier"),
    (real_models.vit_scaled_hook, "reduction", ""),
])
def test_models_nobody_here_wrote(fixture, phase, module):
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(2,))
    _, m, _ = found(report)[2]
    assert (m.phase, m.module) == (phase, module), module_line(m)


@pytest.mark.breadth
@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_a_shard_drifting_after_the_step_names_no_module(mode):
    """One rank's shard moved after its optimizer step: its step re-run from the same start
    agrees everywhere, and the finding says so rather than name a module."""
    report = check(sharded.drifting_shard(), modes=("single", mode), world_sizes=(4,))
    _, m, _ = found(report, mode)[4]
    assert m.phase == "none", module_line(m)


@pytest.mark.breadth
@pytest.mark.parametrize("ws, backend", [(2, "auto"), (4, "auto"), (8, "threaded")], ids=["2", "4", "sim8"])
@pytest.mark.parametrize("fixture, phase, module, rank, cause", [
    (bugs.batchnorm_on_shards, "forward", "bn", 0, "BatchNorm on shards (bn (BatchNorm1d))"),
    (bugs.summed_loss, "loss", "net.4", 0, "a loss summed over the batch (reduction='sum')"),
    (bugs.loss_over_world_size, "loss", "net.4", 0, "a mean loss divided by the world size on every rank"),
    (sharded.token_mean_per_rank, "loss", "head", None, "a loss averaged over each rank's own valid entries"),
    (bugs.ddp_bypassed, "reduction", "", None, "DDP's forward never ran"),
    (loops.late_sync, "reduction", "", None, "a missed sync"),
    (bugs.comm_hook_never_reduces, "reduction", "", None, "the case's comm hook returns its buckets unreduced"),
    (lambda: bugs.replica_nudged(0), "forward", "net.0", 0, "rank 0 alone drifts"),
    (lambda: bugs.replica_nudged(-1), "forward", "net.0", -1, "alone drifts"),
], ids=["batchnorm", "summed", "over_w", "per_rank_mean", "bypassed", "missed_sync", "hook_never_reduces",
        "nudged_first", "nudged_last"])
def test_every_world_size(fixture, phase, module, rank, cause, ws, backend):
    """Each fixture with a known bug names where its first differing step differs (the
    module, the loss or the reduction) and on which rank where one rank has it (rank 0 and
    the last), and the cause the run's records prove, at 2 and 4 ranks and simulated 8."""
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(ws,), backend=backend)
    _, m, notes = found(report)[ws]
    assert (m.phase, m.module) == (phase, module), module_line(m)
    assert rank is None or m.rank == rank % ws, module_line(m)
    causes = [n for n in notes if n.startswith("likely cause: ")]
    assert len(causes) == 1 and cause in causes[0], notes


def _summed_elsewhere():
    from ddparity.fixtures import layouts, recurrent, torch_tests

    cases = [pytest.param(lambda n=n: torch_tests.case(n, summed=True), id=f"torch-{n}") for n in torch_tests.NAMES
             if n not in torch_tests.ON_SHARDS]  # BatchNorm on shards differs first, in forward
    cases += [pytest.param(lambda lay=lay: layouts.layout_case(lay, summed=True), id=lay) for lay in layouts.LAYOUTS]
    cases += [pytest.param(lambda c=c, m=m: recurrent.rnn_case(c, m, summed=True), id=f"{c}-{m}-major")
              for c in ("LSTM", "GRU") for m in ("batch", "time")]
    return cases


@pytest.mark.breadth
@pytest.mark.parametrize("make", _summed_elsewhere())
def test_a_summed_loss_in_models_nobody_here_wrote_is_the_loss(make):
    """PyTorch's own DDP test models, blocks in ModuleLists and nested containers, stacked
    RNNs batch- and time-major: every forward agrees row for row, the loss is 1/W off."""
    report = check(make(), modes=("single", "ddp"), world_sizes=(2,))
    _, m, _ = found(report)[2]
    assert m.phase == "loss" and m.factor == pytest.approx(0.5, rel=1e-3), module_line(m)


@pytest.mark.breadth
def test_batchnorm_in_pytorchs_own_test_model_is_named():
    from ddparity.fixtures import torch_tests

    report = check(torch_tests.case("BatchNormNet"), modes=("single", "ddp"), world_sizes=(2,))
    _, m, _ = found(report)[2]
    assert (m.phase, m.module, m.op) == ("forward", "bn", "aten.native_batch_norm.default"), module_line(m)


@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.breadth), pytest.param(8, marks=pytest.mark.breadth)])
def test_dataparallels_replicas_name_the_module_on_their_chunks(ws):
    """DataParallel (emulated here): each replica's calls on its chunk of the batch; the
    gathered output's loss is the reference's, so its gradients are compared unscaled."""
    report = check(bugs.batchnorm_on_shards(), modes=("single", "dp"), world_sizes=(ws,))
    status, m, _ = found(report, "dp")[ws]
    assert status == "diverged"
    assert (m.phase, m.module, m.type) == ("forward", "bn", "BatchNorm1d"), module_line(m)
    assert m.agrees_ok and m.error > m.tolerance


def test_micro_batches_are_compared_with_the_references_calls_on_the_same_samples():
    """Accumulation: a rank's micro-batch holds other samples than the reference's of the same
    number; each call is read against the reference's forward that holds its samples. Before,
    no call was comparable and the report claimed every activation agreed ("the reduction")."""
    report = check(loops.accumulation_summed(), modes=("single", "ddp"), world_sizes=(2, 4))
    for ws in (2, 4):
        status, m, notes = found(report)[ws]
        assert status == "diverged" and m.phase == "loss" and m.factor == pytest.approx(1 / ws, rel=1e-3), \
            module_line(m)
        assert any(n.startswith("likely cause: a loss summed over the batch") for n in notes), notes


@pytest.mark.parametrize("inputs", ["copies", "noised"])
def test_micro_batches_computed_from_the_share_are_found_in_the_reference_by_their_content(inputs):
    """A forward on a copy of a micro-batch (told by the rows of the share it equals), or on
    one noised as a diffusion model's input is (aligned draws: each sample's noise is one
    device's; found among the reference's forwards' rows by content), views nothing of the
    batch. Before, nothing was compared and the report said "not found"."""
    report = check(loops.accumulation_summed(inputs), modes=("single", "ddp"), world_sizes=(2, 4))
    for ws in (2, 4):
        status, m, notes = found(report)[ws]
        assert status == "diverged" and m.phase == "loss" and m.factor == pytest.approx(1 / ws, rel=1e-3), \
            module_line(m)
        assert any(n.startswith("likely cause: a loss summed over the batch") for n in notes), notes


def test_micro_batches_no_row_of_the_reference_holds_are_not_found_and_said_so():
    """Each micro-batch centred by its own mean: no row of a rank's forward is a row of one
    device's, so no call can be compared, and the report says so rather than that every module
    agrees."""
    centred = check(loops.accumulation_summed("centred"), modes=("single", "ddp"), world_sizes=(2,))
    status, m, notes = found(centred)[2]
    assert status == "diverged" and m is None, module_line(m)
    assert any("first differing module: not found (no module call of the step could be matched" in n
               for n in notes), notes


@pytest.mark.parametrize("mode", ["dp", "ddp"])
@pytest.mark.parametrize("inputs", ["slices", "noised"])
def test_batchnorm_on_micro_batches_is_named_in_forward_and_as_the_cause(mode, inputs):
    """BatchNorm on micro-batches of each rank's share (of each DataParallel replica's chunk of
    a micro-batch): the layer is named in forward on the samples it holds, told by the view
    its input is or found by content (noised). Its running statistics cannot tell (their
    calibrated noise, run in reversed sample order, is as large: micro-batches of other
    samples), so the place names the cause: input agrees, output differs."""
    import functools

    from ddparity import Case

    def model():
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    case = Case(model=model, data=loops.labelled, optimizer="sgd", lr=0.01, steps=2,
                train_step=functools.partial(loops.micro_batches, inputs=inputs),
                name="bug: BatchNorm on each rank's micro-batches")
    _, m, notes = found(check(case, modes=("single", mode), world_sizes=(2,)), mode)[2]
    assert (m.phase, m.module, m.agrees_ok) == ("forward", "1", True), module_line(m)
    assert any(n.startswith("likely cause: BatchNorm on shards (1 (BatchNorm1d))") for n in notes), notes


def test_a_rank_that_made_fewer_micro_batches_than_one_device_is_named_by_its_forwards():
    """x.chunk(2) of a share of one sample makes one micro-batch, still divided by 2: the loss's
    gradient is half one device's, and the trace's forward counts (1 against 2) say why."""
    report = check(loops.accumulation_of_a_small_share(), modes=("single", "ddp"), world_sizes=(2, 4))
    by_ws = found(report)
    assert by_ws[2][0] == "pass", report.render()
    status, m, notes = by_ws[4]
    assert status == "diverged" and m.phase == "loss" and m.forwards == (1, 2), module_line(m)
    [cause] = [n for n in notes if n.startswith(("likely cause", "candidate causes"))]
    assert cause.startswith("likely cause: the step ran 1 forward(s) of the model on rank 0 and 2 on one device"), cause
    assert m.to_json()["forwards"] == [1, 2]


def test_forward_counts_that_differ_outrank_what_the_numbers_guessed():
    """At 2 ranks a share of one sample halves the loss's gradient, which the numbers alone
    read as a loss divided by W; the forward counts are direct evidence."""
    from ddparity.checks.placed import reread
    from ddparity.verdicts import Divergence, ModuleFinding

    best = ModuleFinding(step=0, rank=1, phase="loss", module="net.4", factor=0.5, forwards=(1, 2))
    first = Divergence(step=0, kind="loss", name="loss", rank=0, max_abs=1.0, max_rel=0.5, tolerance=1e-6)
    guessed = ["likely cause: a mean loss divided by the world size on every rank ...", "traffic: ..."]
    notes = reread(guessed, best, first, [first], 2, "ddp", True, lambda: 1.0)
    assert notes[0] == "traffic: ..." and len(notes) == 2, notes
    assert notes[1].startswith("likely cause: the step ran 1 forward(s) of the model on rank 1 and 2 on one device")
    odd = reread([], dataclasses.replace(best, factor=0.3), first, [first], 2, "ddp", True, lambda: 1.0)
    assert odd[0].startswith("candidate causes: the step ran 1 forward(s)"), odd


def test_a_traced_forward_on_a_micro_batch_knows_its_samples():
    """The tracer tells each forward's samples by the storage its input views (as aligned
    dropout does), and numbers each call within its forward."""
    from ddparity.harness.ranks.differing import same_samples

    model = nn.Sequential(nn.Linear(3, 2))

    def record(rows, size, batch, parts):
        trace = ModuleTrace(0, size=size)
        trace.attach(model)
        trace.arm(lambda t, n: t[rows], batch)
        try:
            for part in parts(batch):
                model(part).sum().backward()
        finally:
            trace.close()
        return trace.record()

    batch = torch.randn(8, 3)
    ref = record(torch.arange(8), 8, batch, lambda b: b.chunk(2))
    assert [f.tolist() for f in ref["forwards"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    share = batch[4:8].clone()
    mine = record(torch.arange(4, 8), 8, share, lambda b: b.chunk(2))
    assert [f.tolist() for f in mine["forwards"]] == [[4, 5], [6, 7]]
    match = same_samples(ref, mine, torch.arange(4, 8), 8)
    second = [c for c in mine["calls"] if c["name"] == "0"][1]
    key, at, size = match(second)
    assert key == ("0", 1) and at.tolist() == [2, 3] and size == 4  # the reference's second forward, its rows 2, 3
    assert rel(second["outputs"][0], ref["calls"][2]["outputs"][0][at]) < 1e-6
    copied = record(torch.arange(4, 8), 8, share, lambda b: [p.clone() for p in b.chunk(2)])
    assert [f.tolist() for f in copied["forwards"]] == [[4, 5], [6, 7]]  # copies: told by their values
    doubled = record(torch.arange(8), 8, batch, lambda b: [p * 2 for p in b.chunk(2)])
    untold = record(torch.arange(4, 8), 8, share, lambda b: [p * 2 for p in b.chunk(2)])
    assert untold["forwards"] == [None, None]
    key, at, size = same_samples(doubled, untold, torch.arange(4, 8), 8)(untold["calls"][0])
    assert key == ("0", 1) and at.tolist() == [0, 1] and size == 4  # found by content: samples 4, 5
    centred = record(torch.arange(4, 8), 8, share, lambda b: [p - p.mean(0) for p in b.chunk(2)])
    key, at, size = same_samples(ref, centred, torch.arange(4, 8), 8)(centred["calls"][0])
    assert key == ("0", 0) and at.tolist() == [4, 5, 6, 7] and size == 8  # the whole share's rows: nothing matches


@pytest.mark.breadth
@pytest.mark.parametrize("fixture, phase", [
    (lambda: loops.late_sync(), "reduction"),  # no_sync() left on for the last micro-batch: a missed sync
    (lambda: calibration.autocast_bf16_summed(), "loss"),  # a summed loss under bf16 autocast
], ids=["missed_sync", "bf16_autocast_summed"])
def test_a_missed_sync_and_a_cast_step_are_named_where_they_differ(fixture, phase):
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(2,))
    status, m, _ = found(report)[2]
    assert status in ("diverged", "desync") and m.phase == phase, module_line(m)


@pytest.mark.breadth
@pytest.mark.parametrize("fixture", [loops.accumulation, calibration.autocast_bf16, bugs.clean_batchnorm_eval],
                         ids=["accumulation", "bf16_autocast", "batchnorm_eval"])
def test_clean_twins_name_nothing(fixture):
    report = check(fixture(), modes=("single", "ddp"), world_sizes=(2,))
    assert report.ok, report.render()
    assert "first differing module" not in report.render() and "first to differ" not in report.render()


@pytest.mark.breadth
@pytest.mark.parametrize("ws, backend", [(2, "auto"), (4, "auto"), (8, "threaded")], ids=["2", "4", "sim8"])
@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
@pytest.mark.parametrize("fixture, phase, module, cause", [
    (bugs.batchnorm_on_shards, "forward", "bn", "BatchNorm on shards (bn (BatchNorm1d))"),
    (bugs.summed_loss, "loss", "net.4", "a loss summed over the batch (reduction='sum')"),
    (bugs.loss_over_world_size, "loss", "net.4", "a mean loss divided by the world size on every rank"),
    (sharded.token_mean_per_rank, "loss", "head", "a loss averaged over each rank's own valid entries"),
    (sharded.divided_again, "loss", "net.4", "a loss divided by the world size before backward"),
    (sharded.sync_left_off, "reduction", "", "no gradient reached the optimizer"),
    (sharded.ignored_param, "backward", "net.4", "net.4.bias, net.4.weight left out of sharding"),
], ids=["batchnorm", "summed", "over_w", "per_rank_mean", "divided_again", "sync_off", "ignored_param"])
def test_sharded_modes_at_2_4_and_simulated_8(fixture, phase, module, cause, mode, ws, backend):
    report = check(fixture(), modes=("single", mode), world_sizes=(ws,), backend=backend)
    _, m, notes = found(report, mode)[ws]
    assert (m.phase, m.module) == (phase, module), module_line(m)
    causes = [n for n in notes if n.startswith("likely cause: ")]
    assert len(causes) == 1 and cause in causes[0], notes


def test_ranks_waiting_beside_a_reference_whose_re_run_failed_stop_at_once(tmp_path):
    """The reference re-runs the step beside the ranks: its failure is left beside the record's
    path, so ranks waiting for the record raise instead of waiting out their limit, and a
    later ask of that step fails alike instead of trying again."""
    import time

    from ddparity.fixtures import bugs
    from ddparity.harness.protocol import RankContext
    from ddparity.harness.ranks import probes
    from ddparity.harness.spool_files import ReferenceFailed

    ctx = RankContext(rank=0, world_size=1, backend="gloo", device="cpu")
    with pytest.raises(FileNotFoundError):  # an empty spool: no initial state to train from
        probes.reference_trace_task(ctx, bugs.summed_loss(), str(tmp_path), 0, 8)
    started = time.monotonic()
    with pytest.raises(ReferenceFailed, match="the reference's re-run of step 0 failed"):
        probes._reference_record(str(tmp_path), 0, None, limit_s=600)
    assert time.monotonic() - started < 60  # not the limit
    with pytest.raises(ReferenceFailed, match="failed in an earlier ask"):
        probes.reference_trace_task(ctx, bugs.summed_loss(), str(tmp_path), 0, 8)
    with pytest.raises(ReferenceFailed, match="wrote no record of step 1 in 0.05 s"):
        probes._reference_record(str(tmp_path), 1, None, limit_s=0.05)


def test_a_backward_finding_with_nothing_nearer_the_loss_reads_plainly():
    """A loss computed in the model's own forward (CLIP's): the first module backward compares
    is a projection whose output gradient differs; nothing nearer the loss to agree."""
    from ddparity.verdicts import ModuleFinding

    line = module_line(ModuleFinding(step=0, rank=0, phase="backward", module="text_projection", type="Linear",
                                     differs="output gradient", error=0.26, tolerance=1.9e-6))
    assert line == ("first differing module: text_projection (Linear), step 0, rank 0, backward: output gradient "
                    "differs (rel 0.26, tolerance 1.9e-06)"), line
    agreeing = module_line(ModuleFinding(step=0, rank=0, phase="backward", module="fc", type="Linear",
                                         differs="input gradient", error=0.1, tolerance=1e-6,
                                         agrees="output gradient", agrees_error=0.0, agrees_ok=True))
    assert "backward: output gradient agrees (rel 0), input gradient differs" in agreeing, agreeing


def test_a_forwards_rows_are_found_by_content_in_one_forward_of_the_reference_or_not_at_all():
    """Every row of the forward must be (to 1e-6 of its size) a row of one reference forward;
    integer inputs (token ids) count with the floats batched like them."""
    from ddparity.harness.ranks.forward_rows import content, rows_by_content

    x, ids = torch.randn(8, 3), torch.arange(16).reshape(8, 2)
    theirs = [content([x[:4], ids[:4]]), content([x[4:], {"ids": ids[4:]}]), None]
    assert theirs[0].shape == (4, 5)
    g, at = rows_by_content(content([x[[6, 5]] * 1.0, ids[[6, 5]]]), theirs)
    assert g == 1 and at.tolist() == [2, 1]
    assert rows_by_content(content([x[[1, 5]], ids[[1, 5]]]), theirs) is None  # split over two forwards
    assert rows_by_content(content([x[[6]] + 1e-3, ids[[6]]]), theirs) is None  # no such row
    assert rows_by_content(content([x[[6]], ids[[6]] + 1]), theirs) is None  # another sample's tokens
    assert rows_by_content(content([x[[6]].fill_(float("nan")), ids[[6]]]), theirs) is None
    assert rows_by_content(content([x[[6]]]), theirs) is None  # other columns
    assert content([torch.tensor(1.0)]) is None and rows_by_content(None, theirs) is None
    mask = torch.ones(1, 2)  # batched like nothing: no sample's, and the same in every forward
    g, at = rows_by_content(content([mask, x[[5, 4]]]), [content([mask, x[:4]]), content([mask, x[4:]])])
    assert (g, at.tolist()) == (1, [1, 0])
    assert rows_by_content(content([mask]), [content([mask]), content([mask])]) is None  # in both: no sample told
