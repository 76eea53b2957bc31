"""The DataParallel emulation, pinned to DataParallel's documented behaviour, and mode
``dp`` end to end (simulated on CPU; against real DataParallel where 2+ GPUs exist)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from ddparity import Case, check
from ddparity.fixtures import bugs, models
from ddparity.harness.ranks import dp_emulation as dp


def test_scatter_uses_dataparallels_chunks_and_containers():
    x = torch.arange(10.0).reshape(5, 2)
    assert [c.shape[0] for c in dp.scatter(x, 2)] == [3, 2]  # ceil(5/2), then the rest
    assert [c.shape[0] for c in dp.scatter(x, 4)] == [2, 2, 1]  # fewer chunks than devices
    assert len(dp.scatter(torch.zeros(2, 3), 4)) == 2  # a short batch uses fewer replicas
    pair = collections.namedtuple("pair", "a b")
    parts = dp.scatter({"x": x, "tag": "train", "p": pair(x, [x])}, 2)
    assert [p["tag"] for p in parts] == ["train", "train"]  # non-tensors: the same object
    assert parts[1]["p"].a.shape == (2, 2) and isinstance(parts[1]["p"], pair)
    assert parts[0]["p"].b[0].shape == (3, 2)
    args, kwargs = dp.scatter_kwargs((x,), {}, 2)
    assert len(args) == len(kwargs) == 2 and kwargs == [{}, {}]


def test_gather_concatenates_and_turns_scalars_into_a_vector():
    out = dp.gather([{"y": torch.ones(2, 3), "n": torch.tensor(1.0)}, {"y": torch.zeros(1, 3), "n": torch.tensor(2.0)}])
    assert out["y"].shape == (3, 3) and out["n"].tolist() == [1.0, 2.0]


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.bn = nn.BatchNorm1d(2)
        self.calls = 0

    def forward(self, x):
        self.calls = self.calls + 1  # state on self: lost in replicas
        return self.bn(self.fc(x))


def test_replicas_share_parameters_keep_replica_0_buffers_and_lose_state_on_self():
    model = Counting()
    out, notes = dp.forward(model, 3, (torch.randn(8, 4),))  # chunks of 3, 3, 2
    assert out.shape == (8, 2)
    assert model.calls == 0  # written to the replicas only
    assert model.bn.num_batches_tracked.item() == 1  # replica 0's update, not three
    assert set(notes.items) == {"state on self", "per-replica BatchNorm"}
    out.sum().backward()
    assert model.fc.weight.grad is not None  # the replicas' gradients reach the originals


def test_only_the_first_replicas_renormalisation_of_an_embedding_stays_and_other_changes_are_noted():
    """DataParallel broadcasts the parameters: the first device's replica holds the module's
    own, the others copies, so an embedding's max_norm renormalises the original only for
    the first chunk's rows; gradients still reach the original from every replica."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=0.5)
    with torch.no_grad():
        emb.weight.mul_(4)  # every row above max_norm
    x = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    out, notes = dp.forward(emb, 2, (x,))
    norms = emb.weight.norm(dim=1)
    assert (norms[:4] <= 0.5 + 1e-6).all() and (norms[4:] > 0.5).all(), norms
    assert "parameters changed in forward" not in notes.items  # emulated exactly
    out.sum().backward()
    assert emb.weight.grad[:8].abs().sum(1).gt(0).all()  # rows of both replicas' chunks

    class Centred(nn.Module):  # a parameter moved in forward: noted, the emulation cannot drop it
        def __init__(self) -> None:
            super().__init__()
            self.centre = nn.Parameter(torch.zeros(4), requires_grad=False)

        def forward(self, x):
            with torch.no_grad():
                self.centre.add_(x.mean(0))
            return x - self.centre

    _, notes = dp.forward(Centred(), 2, (torch.randn(6, 4),))
    assert "forward changes centre in place on replicas after the first" in notes.items["parameters changed in forward"]


def test_one_device_calls_the_module_itself():
    model = Counting()
    dp.forward(model, 1, (torch.randn(4, 4),))
    assert model.calls == 1


def test_gradients_are_the_sum_over_replicas_of_the_full_batch():
    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(9, 4)
    out, _ = dp.forward(model, 4, (x,))
    out.pow(2).mean().backward()
    emulated = model.weight.grad.clone()
    model.zero_grad()
    model(x).pow(2).mean().backward()
    torch.testing.assert_close(emulated, model.weight.grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="real DataParallel needs 2+ GPUs")
def test_emulation_matches_real_dataparallel():
    torch.manual_seed(0)
    model = Counting().cuda()
    x = torch.randn(7, 4, device="cuda")
    real = nn.DataParallel(model, device_ids=[0, 1])(x)
    emulated, _ = dp.forward(model, 2, (x,))
    torch.testing.assert_close(real, emulated)


@pytest.mark.usefixtures("no_leftover_processes")  # the default pool is closed after
def test_mode_dp_passes_on_clean_models_and_is_labelled_simulated():
    report = check(models.mlp_sgd(), modes=("single", "dp"), world_sizes=(1, 2, 3))
    assert report.ok, report.render()
    runs = {(r.mode, r.world_size): r for r in report.runs}
    assert not runs[("dp", 1)].simulated  # one device: DataParallel calls the module
    assert runs[("dp", 2)].simulated and runs[("dp", 3)].simulated
    assert report.to_json()["runs"][2]["simulated"] is True
    assert "cpu (simulated)" in report.render()


@pytest.mark.usefixtures("no_leftover_processes")  # the default pool is closed after
def test_dp_pitfalls_are_flagged_with_an_explanation():
    bn = check(bugs.batchnorm_on_shards(), modes=("single", "dp"), world_sizes=(2,))
    assert bn.runs[1].status == "diverged"
    assert any("per-replica BatchNorm" in n and "SyncBatchNorm" in n for n in bn.runs[1].notes)

    def counting_model():
        return Counting().eval()  # eval BatchNorm: the numbers match; the lost state does not

    state = check(Case(model=counting_model, data=lambda s, g: (torch.randn(8, 4, generator=g),
                                                                 torch.randint(0, 2, (8,), generator=g))),
                  modes=("single", "dp"), world_sizes=(2,))
    assert state.ok, state.render()
    assert any("self.calls" in n for n in state.runs[1].notes)
    assert "DataParallel pitfall, state on self" in state.render()


class HangsOnChunks(nn.Module):
    """Fine on the whole batch; waits forever on a DataParallel chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        if x.shape[0] < 24:
            import time

            time.sleep(3600)
        return self.fc(x)


@pytest.mark.usefixtures("no_leftover_processes")  # the default pool is closed after
def test_a_hanging_dp_run_is_a_hang_and_the_next_check_passes():
    report = check(Case(model=HangsOnChunks, data=models.vectors, steps=1), modes=("single", "dp"),
                   world_sizes=(2,), timeout=3)
    run = report.runs[1]
    assert run.status == "hang" and report.exit_code == 3
    assert "HangsOnChunks.forward" in str(run.hang) or "in forward" in str(run.hang)
    assert check(models.mlp_sgd(), modes=("single", "dp"), world_sizes=(2,)).ok


def test_a_0d_tensor_argument_is_refused_with_its_name_and_the_fix():
    from ddparity.errors import CaseError

    x = torch.randn(8, 4)
    with pytest.raises(CaseError, match=r"kwargs\['n'\] is a 0-d tensor.*chunk expects.*t\.expand\(2\)"):
        dp.forward(nn.Linear(4, 2), 2, (x,), {"n": torch.tensor(3)})
    out, _ = dp.forward(nn.Linear(4, 2), 1, (x,), {})  # one device: DataParallel calls the module, no scatter
    assert out.shape == (8, 2)


class TakesAMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.fc(x) * mask


def test_flags_are_handed_on_whole_without_a_note_and_lists_and_numbers_get_one():
    """A str or bool argument (a pass's name, a training flag) cannot be per sample: DataParallel
    handing it to every replica is what the step meant; a list or a number might be."""

    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, part="d", train=True, extra=None):
            return self.fc(x)

    x = torch.randn(4, 4)
    assert "non-tensor inputs" not in dp.forward(Takes(), 2, (x,), {"part": "g", "train": False})[1].items
    noted = dp.forward(Takes(), 2, (x,), {"extra": [1, 2, 3, 4]})[1].items["non-tensor inputs"]
    assert noted.startswith("kwargs['extra'][0] (int)"), noted


def test_an_argument_with_fewer_rows_is_noted_as_cutting_the_batch_short():
    _, notes = dp.forward(TakesAMask(), 4, (torch.randn(8, 4), torch.ones(1, 2)))
    text = notes.items["arguments cut short"]
    assert "inputs[1] has 1 row(s) along dim 0 where inputs[0] has 8" in text
    assert "makes 1 chunk(s) where inputs[0] makes 4" in text
    _, clean = dp.forward(TakesAMask(), 4, (torch.randn(8, 4), torch.ones(8, 2)))
    assert "arguments cut short" not in clean.items


class Concatenates(nn.Module):
    """Scores real samples and their noised copies in one call, [real; fake] along dim 0, or
    one row per sample, or tokens flattened sample-major ((B*T, V) logits)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.fc, self.layout = nn.Linear(4, 3), layout

    def forward(self, x):
        if self.layout == "concatenated":
            return self.fc(torch.cat([x, x + 1]))
        if self.layout == "flattened":
            return self.fc(x.unsqueeze(1).expand(-1, 2, -1)).reshape(-1, 3)
        return self.fc(x)


def test_outputs_not_one_row_per_sample_are_noted_and_said_only_on_a_run_that_diverged():
    """DataParallel gathers the replicas' outputs replica after replica: [real_0; fake_0;
    real_1; fake_1], not [real; fake]. A flattened (B*T, V) output keeps one device's order:
    noted in forward, but a run that passes says nothing of it."""
    out, notes = dp.forward(Concatenates("concatenated"), 2, (torch.arange(8.0).reshape(4, 2).repeat(1, 2),))
    text = notes.items["outputs not one row per sample"]
    assert "forward's output has 4 row(s) along dim 0 for a replica's 2 sample(s)" in text, text
    assert out.shape == (8, 3)
    assert "outputs not one row per sample" not in dp.forward(Concatenates("rows"), 2, (torch.randn(4, 4),))[1].items

    def data(step, generator):
        return torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8, 2), generator=generator)

    flattened = check(Case(model=lambda: Concatenates("flattened"), data=data, steps=2,
                           loss=lambda out, y: nn.functional.cross_entropy(out, y.reshape(-1))),
                      modes=("single", "dp"), world_sizes=(2,))
    assert flattened.ok and "outputs not one row per sample" not in flattened.render(), flattened.render()
    concatenated = check(Case(model=lambda: Concatenates("concatenated"), data=data, steps=2, loss=_real_then_fake),
                         modes=("single", "dp"), world_sizes=(2,))
    assert concatenated.runs[1].status == "diverged", concatenated.render()
    assert "DataParallel pitfall, outputs not one row per sample" in concatenated.render(), concatenated.render()


def _real_then_fake(outputs, targets):
    """Class 0 for the first half of the rows (the real samples), 1 for the second."""
    half = len(outputs) // 2
    return nn.functional.cross_entropy(outputs, torch.cat([torch.zeros(half), torch.ones(half)]).long())


@pytest.mark.usefixtures("no_leftover_processes")  # the default pool is closed after
def test_one_world_sizes_failure_is_not_every_world_sizes_verdict():
    """BatchNorm on a global batch of 4: at 2 replicas/ranks it normalises shards
    (diverged); at 4 every shard is one sample, which BatchNorm refuses (crash). The
    reference's own calibration passes on 4 shards must not fail the reference either."""
    report = check(bugs.batchnorm_one_sample_per_rank(), modes=("single", "dp", "ddp"), world_sizes=(2, 4))
    runs = {(r.mode, r.world_size): r for r in report.runs}
    assert runs[("single", 1)].status == "pass", report.render()
    assert runs[("dp", 2)].status == "diverged" and runs[("ddp", 2)].status == "diverged"
    assert runs[("dp", 4)].status == "crash" and runs[("ddp", 4)].status == "crash"
    assert [runs[("dp", ws)].simulated for ws in (2, 4)] == [True, True]
    assert {runs[("dp", ws)].backend for ws in (2, 4)} == {"cpu"}
    assert "Expected more than 1 value per channel" in runs[("dp", 4)].crash.error
    text = report.render()
    assert "dp world_size=4 (cpu, simulated): CRASH" in text
    assert "rank 3: step 0, forward; raised the same error" in text  # not "finished the task"
    assert report.to_json()["runs"][4]["crash"]["ranks"]["3"]["raised"].startswith("ValueError")


def test_a_models_own_loss_gathered_per_replica_is_named_with_the_fix():
    """Was a crash quoting autograd ("grad can be implicitly created only for scalar outputs")."""
    report = check(bugs.own_loss_under_dataparallel(), modes=("single", "dp", "ddp"), world_sizes=(1, 2, 4))
    rows = {(r.mode, r.world_size): r for r in report.runs}
    assert [r.status for r in report.runs] == ["pass", "pass", "error", "error", "pass", "pass", "pass"], \
        report.render()
    reason = rows["dp", 4].reason
    assert "a vector of 4" in reason and "out.loss.mean()" in reason, reason
    assert rows["dp", 2].simulated and "backend" not in reason
    assert check(bugs.own_loss_under_dataparallel(mean=True), modes=("single", "dp", "ddp"), world_sizes=(2, 4)).ok


def test_a_mean_over_each_replicas_valid_tokens_is_named_under_dataparallel():
    """transformers' own loss with padding under DataParallel: a mean over each replica's tokens,
    averaged over the replicas (diverged, with no cause named before)."""
    from ddparity.fixtures import real_models

    report = check(real_models.gpt2_per_rank_mean(), modes=("single", "dp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["pass", "diverged", "diverged"], report.render()
    for run in report.runs[1:]:
        [cause] = [n for n in run.notes if n.startswith("likely cause")]
        assert cause.startswith("likely cause: a loss averaged over each replica's own valid entries: batch['labels']")
        assert "out.loss.mean() of what DataParallel gathers" in cause and "all-reduce" not in cause, cause
    clean = check(models.mlp_sgd(), modes=("single", "dp"), world_sizes=(2,))
    assert clean.ok and not any(n.startswith("likely cause") for r in clean.runs for n in r.notes)


def test_a_loss_at_1_over_w_under_dataparallel_is_told_apart_by_the_probe():
    """Per-replica sums averaged (the model's own summed loss, .mean()) and a division by W only
    DDP needs: both leave the loss at 1/W under DataParallel (no cause named before)."""
    for case, says in ((bugs.own_summed_loss_under_dataparallel(), "the step averages the per-replica losses"),
                       (bugs.loss_over_world_size_under_dataparallel(), "a loss divided by the world size")):
        report = check(case, modes=("single", "dp"), world_sizes=(2, 4))
        assert [r.status for r in report.runs] == ["pass", "diverged", "diverged"], report.render()
        for run in report.runs[1:]:
            [cause] = [n for n in run.notes if n.startswith(("likely cause", "candidate causes"))]
            assert cause.startswith(f"likely cause: the loss is 1/{run.world_size} of one device's") and says in cause
