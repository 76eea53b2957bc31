"""The reference's tensors on disk, compared in place: what the writer keeps and writes,
what a comparer measures, and that a run waiting for a reference that will not come stops."""

from __future__ import annotations

import math
import os
import stat
import threading
import time

import pytest
import torch
from torch import nn

from ddparity.distances import distance, max_abs
from ddparity.harness.ranks.comparer import Comparer
from ddparity.harness.ranks.spool import Writer
from ddparity.harness.spool_files import ReferenceFailed, Spool


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model[2].weight.requires_grad_(False)  # a frozen layer
    model(torch.randn(8, 4)).sum().backward()
    return model


def _step(sink, step, model, loss=1.5):
    sink.grads(step, model)
    sink.after(step, torch.tensor(loss), True, model)


def test_the_spool_is_private_and_removed():
    with Spool() as spool:
        assert stat.S_IMODE(os.stat(spool.path).st_mode) == 0o700
    assert not os.path.exists(spool.path)


def test_a_replica_compared_with_itself_is_at_distance_zero_and_a_change_is_measured_exactly():
    model = _model()
    with Spool() as spool:
        writer, same, moved = Writer(spool.path), Comparer(spool.path, "ddp", 0, 2, 5), Comparer(spool.path, "ddp", 1, 2, 5)
        _step(writer, 0, model)
        _step(same, 0, model)
        with torch.no_grad():
            model[0].bias[1] += 0.25
        _step(moved, 0, model, loss=1.0)
        reference = writer.finish()
    assert all(v == 0.0 for v in same.finish().steps[0].values())
    got = moved.finish().steps[0]
    assert got[("param", "0.bias")] == pytest.approx(0.25) and got[("loss", "loss")] == 0.5
    assert got[("grad", "2.weight")] == 0.0  # no gradient on either side
    entries = dict(reference.steps[0])
    assert list(entries)[0] == ("loss", "loss")  # compared first
    assert entries[("param", "0.weight")].value == pytest.approx(max_abs(model[0].weight))
    assert not entries[("grad", "2.weight")].floating and not entries[("buffer", "1.num_batches_tracked")].floating
    assert reference.params == 6 and reference.non_finite is None


def test_frozen_tensors_that_did_not_change_are_written_once_and_a_data_update_is_seen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 4000))
    model[1].requires_grad_(False)  # a frozen layer: 16 K values, most of the bytes
    model(torch.randn(2, 4)).sum().backward()
    with Spool() as spool:
        writer, comparer = Writer(spool.path), Comparer(spool.path, "ddp", 0, 2, 5)
        _step(writer, 0, model)
        _step(comparer, 0, model)
        with torch.no_grad():
            model[0].weight.mul_(2)  # the trained layer changes, the frozen one not
        _step(writer, 1, model)
        _step(comparer, 1, model)
        with torch.no_grad():
            model[1].weight.data.add_(1.0)  # an update no version counter sees (p.data, as EMA code does)
        _step(writer, 2, model)
        model[1].weight.data.sub_(1.0)
        _step(comparer, 2, model)
        sizes = [os.path.getsize(os.path.join(spool.path, f"a{s}.bin")) for s in range(3)]
    assert sizes[1] < sizes[0] / 10 and sizes[2] > sizes[0] / 2, sizes
    steps = comparer.finish().steps
    assert steps[1][("param", "1.weight")] == 0.0 and steps[1][("param", "0.weight")] == 0.0
    assert steps[2][("param", "1.weight")] == 1.0  # the reference's new values, not the old bytes


def test_the_first_non_finite_value_is_found_where_it_is_written():
    model = _model()
    model[0].weight.grad[0, 1] = math.nan
    with Spool() as spool:
        writer = Writer(spool.path)
        _step(writer, 0, model)
        assert writer.finish().non_finite[:3] == (0, "grad", "0.weight")


def test_a_run_waits_for_the_reference_and_stops_when_it_will_not_come():
    model = _model()
    with Spool() as spool:
        comparer = Comparer(spool.path, "ddp", 0, 2, 30)
        threading.Timer(0.2, lambda: _step(Writer(spool.path), 0, model)).start()
        _step(comparer, 0, model)  # waits for step 0
        assert all(v == 0.0 for v in comparer.finish().steps[0].values())
        threading.Timer(0.2, spool.abort).start()
        started = time.monotonic()
        with pytest.raises(ReferenceFailed, match="stopped before this step"):
            comparer.grads(1, model)
        assert time.monotonic() - started < 5
        with pytest.raises(ReferenceFailed, match="in 0.1 s"):
            Comparer(spool.path.rstrip("/") + "-none", "ddp", 0, 2, 0.1).grads(0, model)


def test_distance_is_measured_in_chunks_and_in_a_wide_enough_dtype(monkeypatch):
    import ddparity.distances as trace

    monkeypatch.setattr(trace, "CHUNK", 7)
    a = torch.arange(100, dtype=torch.float32)
    b = a.clone()
    b[93] += 3
    assert distance(a, b) == 3.0 and max_abs(-a) == 99.0
    x = torch.tensor([1.0, 1.0 + 2 ** -7], dtype=torch.bfloat16)
    assert distance(x[:1], x[1:]) == 2 ** -7  # not rounded away in bf16


def test_a_spools_janitor_removes_it_when_its_owner_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time; from ddparity.harness.spool_files import Spool; "
            f"s = Spool(parent={str(tmp_path)!r}, janitor=True); print(s.path, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = owner.stdout.readline().strip()
    assert os.path.isdir(path)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path)
