"""Stacked RNNs with inter-layer dropout, run layer by layer with aligned dropout
(:mod:`ddparity.harness.ranks.stacked_rnn`), and time-major data (``ddparity.batched``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ddparity
from ddparity import UsageError, check
from ddparity.fixtures import recurrent
from ddparity.harness.ranks.stacked_rnn import layer_by_layer, stack_rnns

SHAPES = [dict(batch_first=True), dict(batch_first=False), dict(bidirectional=True), dict(proj_size=4)]


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("given_state", [False, True])
def test_layer_by_layer_is_the_fused_module_bit_for_bit(cell, shape, p, given_state):
    """At dropout 0 the stack reproduces torch's fused module's outputs, final state and every
    gradient bit for bit; at dropout 0.3, drawing the same masks (torch's generator at the
    same seed), the same result."""
    if "proj_size" in shape and cell is not nn.LSTM:
        pytest.skip("proj_size is the LSTM's")
    torch.manual_seed(0)
    fused = cell(8, 16, num_layers=3, dropout=p, **shape)
    x = torch.randn(5, 7, 8)
    hx = None
    if given_state:
        dirs, out = (2 if shape.get("bidirectional") else 1), shape.get("proj_size") or 16
        batch = 5 if shape.get("batch_first") else 7
        h0 = torch.randn(3 * dirs, batch, out)
        hx = (h0, torch.randn(3 * dirs, batch, 16)) if cell is nn.LSTM else h0
    results = []
    for run in (lambda m, x: m(x, hx), lambda m, x: layer_by_layer(m, x, hx, p)):
        model = copy.deepcopy(fused)
        inp = x.clone().requires_grad_()
        torch.manual_seed(1)
        out, state = run(model, inp)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        states = state if isinstance(state, tuple) else (state,)
        results.append([out, *states, inp.grad, *(q.grad for q in model.parameters())])
    assert len(results[0]) == len(results[1])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_only_rnns_with_inter_layer_dropout_are_stacked_and_keep_their_names_and_state():
    model = nn.ModuleDict({"a": nn.LSTM(4, 4, 2, dropout=0.1), "b": nn.GRU(4, 4, 1), "c": nn.LSTM(4, 4, 2)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert stack_rnns(model) == ["a"]
    assert isinstance(model["a"], nn.LSTM) and type(model["b"]) is nn.GRU and type(model["c"]) is nn.LSTM
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


CASES = [("LSTM", "time"), pytest.param("LSTM", "batch", marks=pytest.mark.breadth),
         pytest.param("GRU", "time", marks=pytest.mark.breadth), pytest.param("GRU", "batch", marks=pytest.mark.breadth), pytest.param("RNN", "batch", marks=pytest.mark.breadth),
         pytest.param("RNN", "time", marks=pytest.mark.breadth)]


@pytest.mark.parametrize(("cell", "major"), CASES)
def test_stacked_rnns_with_dropout_pass_clean_and_catch_a_summed_loss_in_every_mode(cell, major):
    """Was an error in every mode (the draws inside torch's fused kernel); a time-major batch
    had no way to say its batch is dim 1."""
    clean = check(recurrent.rnn_case(cell, major), modes=("single", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4, 16))
    assert all(r.status == "pass" for r in clean.runs), clean.render()
    assert any(r.simulated for r in clean.runs) and "random draws compared on" in clean.render()
    summed = check(recurrent.rnn_case(cell, major, summed=True), modes=("ddp", "fsdp"), world_sizes=(2, 16))
    assert [r.status for r in summed.runs] == ["diverged"] * 4, summed.render()
    for run in summed.runs:
        first = run.first_divergence
        assert first.step == 0 and first.max_abs > 100 * first.tolerance, (run.name, run.world_size, first)


def test_faults_on_rank_0_and_the_last_rank_are_named_with_time_major_data():
    import dataclasses

    from ddparity.fixtures import bugs

    for culprit in (0, 3):
        base = bugs.corrupted_grad_on_one_rank(culprit)  # a comm hook corrupting one rank's gradient from step 2
        faulty = dataclasses.replace(recurrent.rnn_case("LSTM", "time"), comm_hook=base.comm_hook,
                                     comm_hook_state=base.comm_hook_state, steps=4)
        [run] = check(faulty, modes=("ddp",), world_sizes=(4,)).runs
        assert run.status == "desync" and run.desync.ranks == [culprit], run


def test_time_major_data_under_dataparallel_is_an_error_naming_the_fix():
    [run] = check(recurrent.rnn_case("LSTM", "time"), modes=("dp",), world_sizes=(2,)).runs
    assert run.status == "error" and "DataParallel(module, dim=...)" in run.reason and "--modes" in run.reason


def test_a_packed_sequence_keeps_torchs_kernel_and_its_draws_are_named():
    report = check(recurrent.packed_case(), modes=("single", "ddp"), world_sizes=(2,))
    assert report.exit_code == 2, report.render()
    assert all(r.status == "error" for r in report.runs)
    assert "nn.LSTM: its inter-layer dropout=0.2 runs inside torch's fused RNN kernel" in report.runs[0].reason


def test_batched_refuses_what_is_not_a_tensor_or_a_dimension_of_it():
    with pytest.raises(UsageError, match="takes a tensor, got list"):
        ddparity.batched([1, 2], dim=1)
    with pytest.raises(UsageError, match=r"dim must be an int naming one of the tensor's 2 dimension\(s\)"):
        ddparity.batched(torch.zeros(3, 4), dim=2)
    with pytest.raises(UsageError):
        ddparity.batched(torch.zeros(3, 4), dim=True)
    assert ddparity.batched(torch.zeros(3, 4, 5), dim=-2).dim == 1
