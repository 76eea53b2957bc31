"""The collective ledger as ranks write it: direct calls, DDP buckets, nesting, call sites."""

from __future__ import annotations

import pytest

from ddparity import World
from ddparity.records import parse_ledger, parse_progress


@pytest.fixture(scope="module")
def world2():
    with World(2) as world:
        yield world


def collectives(ctx):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.harness.recording import ddp_buckets

    t = torch.ones(3)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.broadcast(t, src=1)
    out = [None, None]
    dist.all_gather_object(out, {"rank": ctx.rank})  # uses all_gather inside: one entry
    work = dist.all_reduce(torch.ones(2, dtype=torch.float64), async_op=True)
    work.wait()
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(*ddp_buckets.ddp_comm_hook())
    model(torch.randn(3, 4)).sum().backward()
    dist.barrier()
    return out


def test_every_collective_is_recorded_in_order_with_its_call_site(world2):
    outcomes = world2.execute(collectives)
    for o in outcomes:
        entries = parse_ledger(o.records.ledger)
        ops = [(e.seq, e.op) for e in entries]
        assert ops == [(0, "all_reduce"), (1, "broadcast"), (2, "all_gather_object"), (3, "all_reduce"),
                       (4, "all_reduce"), (5, "barrier")], ops
        first, bcast, _, async_, bucket, _ = entries
        assert "MAX" in first.desc and "float32[3]" in first.desc and not first.is_async
        assert "root=1" in bcast.desc
        assert async_.is_async and "float64[2]" in async_.desc
        assert bucket.via == "DDP gradient bucket 0" and "float32[10]" in bucket.desc
        assert all("test_ledger_in_ranks.py" in e.site and "in collectives" in e.site for e in entries[:5])
        progress = parse_progress(o.records.progress)
        assert progress.seq == 5 and progress.inflight is None


def test_nothing_is_recorded_outside_tasks_and_the_next_task_starts_afresh(world2):
    def one(ctx):
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))

    first = world2.execute(one)
    second = world2.execute(one)
    for o in first + second:
        assert [e.seq for e in parse_ledger(o.records.ledger)] == [0]


def test_a_call_site_is_named_by_its_import_path_from_any_working_directory(tmp_path, monkeypatch):
    """Call sites were relative to the working directory (``../../x.py`` became ``a/x.py``,
    a run from elsewhere named the same line differently)."""
    from ddparity.harness.recording.calls import call_site

    here = call_site(1)
    monkeypatch.chdir(tmp_path)
    assert call_site(1).split(":")[0] == here.split(":")[0] == "tests/harness/test_ledger_in_ranks.py"


def test_the_last_collective_runs_until_it_returns_or_its_step_is_over(world2):
    """What a failed watch's Flight Recorder dump calls ``started``: a collective that
    completed (a rank stopped in its next forward) must not read as the one it hung in."""
    def probe(ctx):
        import torch
        import torch.distributed as dist

        from ddparity.harness.recording.recorder import active

        rec = active()
        seen = [rec.last_running()]  # nothing recorded
        dist.all_reduce(torch.ones(1))
        seen.append(rec.last_running())  # returned
        dist.all_reduce(torch.ones(1), async_op=True).wait()
        seen.append(rec.last_running())  # async, in the step the rank is still in
        rec.set_phase(rec.step + 1, "optimizer")
        seen.append(rec.last_running())  # its step is over (DDP's buckets: backward waited)
        try:
            dist.broadcast(torch.ones(1), src=7)  # raises inside the call
        except (ValueError, RuntimeError):
            pass
        seen.append(rec.last_running())
        return seen

    for o in world2.execute(probe):
        assert o.ok and o.value == [False, False, True, False, True], (o.value, o.traceback)
