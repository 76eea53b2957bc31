"""Simulated world sizes (threaded ranks): the same verdicts as real processes."""

from __future__ import annotations

import time

import pytest
import torch

from ddparity import Case, check
from ddparity.fixtures import bugs
from ddparity.fixtures.faults import FAULTS, reported_ranks
from ddparity.fixtures.models import MLP, summed_mse
from ddparity.harness.world.pool import WorldPool
from ddparity.settings import REAL_RANKS_LIMIT
from tests.conftest import needs_newer_torch

pytestmark = needs_newer_torch


def classes(step, generator):
    return torch.randn(128, 16, generator=generator), torch.randint(0, 4, (128,), generator=generator)


def regression(step, generator):
    return torch.randn(128, 16, generator=generator), torch.randn(128, 4, generator=generator)


@pytest.fixture(scope="module")
def pool():
    pool = WorldPool()
    yield pool
    pool.close()


def test_clean_model_passes_at_simulated_8_32_64(pool):
    report = check(Case(model=MLP, data=classes, optimizer="adam", lr=1e-2, steps=3), modes=("ddp",),
                   world_sizes=(8, 32, 64), backend="threaded", pool=pool)
    assert report.ok, report.render()
    assert all(r.simulated and r.backend == "threaded" for r in report.runs)
    assert report.to_json()["runs"][0]["simulated"] is True
    assert "threaded (simulated)" in report.render()


@pytest.mark.parametrize("world_size", [2, 4, 8, 32, 64])
def test_bugs_get_the_verdicts_real_processes_give(world_size, pool):
    backend = "gloo" if world_size <= 4 else "threaded"
    summed = check(Case(model=MLP, data=regression, loss=summed_mse, steps=3), modes=("ddp",),
                   world_sizes=(world_size,), backend=backend, pool=pool)
    run = summed.runs[0]
    assert (run.status, run.first_divergence.step, run.first_divergence.kind) == ("diverged", 0, "loss")
    corrupted = bugs.corrupted_grad_on_one_rank()
    corrupted.data = classes
    run = check(corrupted, modes=("ddp",), world_sizes=(world_size,), backend=backend, pool=pool).runs[0]
    assert run.status == "desync", run
    assert (run.desync["step"], run.desync["ranks"]) == (bugs.CORRUPT_FROM_STEP, [bugs.CORRUPT_RANK])


def test_auto_simulates_only_above_the_machines_limit(pool):
    report = check(Case(model=MLP, data=classes, steps=2), modes=("ddp",),
                   world_sizes=(2, 2 * REAL_RANKS_LIMIT), pool=pool)
    real, simulated = report.runs
    assert (real.backend, real.simulated) == ("gloo", False)
    assert (simulated.backend, simulated.simulated) == ("threaded", True)
    assert any(f"real processes run up to {REAL_RANKS_LIMIT} ranks here" in n for n in simulated.notes)


class RaisesOnRank5(torch.nn.Module):
    def __init__(self, hang: bool = False) -> None:
        super().__init__()
        self.mlp, self.hang = MLP(), hang

    def forward(self, x):
        import torch.distributed as dist

        if dist.get_rank() == 5:
            if self.hang:
                time.sleep(3600)
            raise ValueError("bad shard")
        return self.mlp(x)


def test_a_raising_simulated_rank_is_a_crash_naming_it(pool):
    run = check(Case(model=RaisesOnRank5, data=classes, steps=2), modes=("ddp",), world_sizes=(8,),
                backend="threaded", pool=pool).runs[0]
    assert run.status == "crash" and run.crash["rank"] == 5
    assert "simulated rank 5: ValueError: bad shard" in run.crash["error"]
    assert run.simulated and run.to_json()["simulated"] is True  # a failed simulated run is still simulated


def test_a_hung_simulated_rank_is_reported_and_the_process_replaced(pool):
    started = time.monotonic()
    report = check(Case(model=lambda: RaisesOnRank5(hang=True), data=classes, steps=2), modes=("ddp",),
                   world_sizes=(8,), backend="threaded", timeout=8, pool=pool)
    run = report.runs[0]
    assert run.status == "hang" and report.exit_code == 3 and run.simulated
    stacks = "".join(info["stack"] for info in run.hang["ranks"].values())
    assert "ddparity-simulated-rank5" in stacks  # the stuck thread, by name, with its stack
    assert "forward" in stacks
    assert run.hang["suspect_ranks"] == [5]  # behind the others, who wait for it in a collective
    assert time.monotonic() - started < 120  # the task timeout, never the default 300 s
    after = check(Case(model=MLP, data=classes, steps=2), modes=("ddp",), world_sizes=(8,), backend="threaded",
                  pool=pool)
    assert after.ok, after.render()


def test_a_torch_without_the_threaded_process_group_gets_a_clear_error(monkeypatch):
    import sys

    import torch.testing._internal.distributed as package

    from ddparity.errors import UsageError

    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.multi_threaded_pg", None)
    monkeypatch.delattr(package, "multi_threaded_pg", raising=False)
    with pytest.raises(UsageError, match="--backend threaded needs PyTorch's threaded process group"):
        check(Case(model=MLP, data=classes), modes=("ddp",), world_sizes=(8,), backend="threaded")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.breadth) if n == "stuck_rank" else n
                                  for n in FAULTS])  # a hung simulated rank: test_a_hung_simulated_rank_...
def test_every_fault_at_simulated_8_gets_the_verdict_real_ranks_give_naming_the_rank(pool, name):
    """Each simulated rank keeps its own records (collectives, DDP's buckets, phases), so a
    fault is judged as among real ranks. Before: SUM against MAX and a broadcast from another
    root passed; a skipped collective and a shape mismatch were a crash of rank 0; a stuck,
    exiting or segfaulting rank 1 was blamed on rank 0; the straggler went unnoted."""
    fault = FAULTS[name]
    run = check(fault.case(), modes=("ddp",), world_sizes=(8,), backend="threaded", timeout=8, pool=pool).runs[0]
    assert run.simulated and run.status == fault.status, run
    assert reported_ranks(run) == fault.suspects(8), run
    if run.desync is not None and run.desync.collective is not None:
        assert "faults.py" in " ".join(i["site"] for i in run.desync.to_json()["collective"]["ranks"].values())
    if name in ("exiting_rank", "segfault"):
        assert "simulated rank 1" in run.crash["error"], run.crash
