"""The fault matrix: every injected fault, at world sizes 2 and 4, on rank 0, rank 1 and
the last rank, gets the right verdict and names the right ranks; nothing is left behind;
the next check passes."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from ddparity import check
from ddparity.fixtures import models
from ddparity.fixtures.faults import FAULTS, reported_ranks
from ddparity.harness import spool_files as spool
from ddparity.harness.world.pool import WorldPool
from tests.conftest import stray_processes

TIMEOUT = 8.0  # seconds without progress before a run counts as a hang (a step takes ~0.1 s, even loaded)


def _temp_entries() -> set[str]:
    """Temp files and folders, less pytest's, the check spools of other processes (xdist
    workers run checks alongside), the session's own private side-channel folder (it lives
    as long as the process, like the pool), other processes' multiprocessing folders and
    other tests' own folders (``ddparity-test-``: a torchrun launch's $TMPDIR in another
    worker outlived a hang test here)."""
    places = [tempfile.gettempdir(), "/dev/shm"]
    mine = f"{spool.PREFIX}{os.getpid()}-"
    others = ("pytest-of-", "ddparity-side-", "pymp-", "torchelastic_", "ddparity-test-")
    return {os.path.join(p, e) for p in places if os.path.isdir(p) for e in os.listdir(p)
            if not e.startswith(others) and (not e.startswith(spool.PREFIX) or e.startswith(mine))}


def _left_behind(before: set[str], settle_s: float = 5.0) -> set[str]:
    """Temp entries new since ``before`` that stay: another xdist worker's test may hold a
    temporary folder of its own for a moment (seen once in the full suite), ours would stay."""
    deadline = time.monotonic() + settle_s
    while (left := _temp_entries() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def pool():
    from ddparity.harness.world.pool import default_pool

    default_pool().close()  # warm worlds an earlier test module left: not this module's strays
    pool = WorldPool()
    yield pool
    pool.close()


PLACES = [(2, 0), (2, 1), (4, 0), (4, 1), (4, 3)]
"""(world size, the fault's rank): rank 0 and the last rank (W-1) of 2 and of 4. The default
suite runs rank 0 of 4 and the last rank of 2 and of 4; rank 0 of 2 and rank 1 of 4 (a rank in
the middle) run in the breadth tier."""
BREADTH_PLACES = {(2, 0), (4, 1)}
BREADTH_CELLS = {("stuck_rank", 2, 1)}
"""A stuck rank waits out the whole timeout: its last rank of 2 runs in the breadth tier too
(rank 0 and the last rank of 4 stay in the default suite)."""


@pytest.mark.parametrize("name, world_size, fault_rank", [
    pytest.param(n, w, r, id=f"{n}-ws{w}-rank{r}",
                 marks=pytest.mark.breadth if (w, r) in BREADTH_PLACES or (n, w, r) in BREADTH_CELLS else ())
    for n in FAULTS for w, r in PLACES])
def test_every_fault_gets_its_verdict_and_the_next_check_passes(name, world_size, fault_rank, pool):
    fault = FAULTS[name]
    FAULT_RANK = fault_rank  # noqa: N806 - the rank the checks below hold the report to
    before = _temp_entries()
    report = check(fault.case(fault_rank), world_sizes=(world_size,), timeout=TIMEOUT, pool=pool)
    single, run = report.runs
    assert single.status == "pass"
    assert run.status == fault.status, report.render()
    assert reported_ranks(run) == fault.suspects(world_size, fault_rank), report.render()
    assert report.exit_code == {"pass": 0, "desync": 1, "hang": 3, "crash": 3}[fault.status]
    data = report.to_json()["runs"][1]
    if fault.status == "hang":
        hang = data["hang"]
        assert sorted(hang["ranks"]) == [str(r) for r in range(world_size)]
        stuck = hang["ranks"][str(FAULT_RANK)]
        assert "_inject" in stuck["stack"]  # py-spy or, without it, faulthandler
        assert stuck["phase"] == "forward" and stuck["step"] == 1
        for rank, info in hang["ranks"].items():
            assert isinstance(info["collective_seq"], int) and info["collective"]
            if rank != str(FAULT_RANK):  # the others wait for it in a collective
                assert info["collective_seq"] > stuck["collective_seq"], hang
    if fault.status == "crash":
        crash = data["crash"]
        assert crash["rank"] == FAULT_RANK
        expected_code = {"exiting_rank": 7, "segfault": -11}.get(name)  # the others raised
        assert crash["exitcode"] == expected_code
        if name == "raising_rank":
            assert "injected fault" in crash["error"] and "_inject" in crash["traceback"]
        if name == "raising_in_backward":
            assert "a gradient hook raised in backward" in crash["error"] and "backward" in crash["traceback"]
        if name == "exiting_cleanly":
            assert "SystemExit: 3" in crash["error"] and "_inject" in crash["traceback"]
        if name == "segfault":
            assert "SIGSEGV" in crash["error"] and "_inject" in crash["output"]  # faulthandler's dump
        # the surviving ranks' places and stacks at that moment
        assert set(crash["ranks"]) >= {str(r) for r in range(world_size) if r != FAULT_RANK}
    if fault.status == "desync":
        desync = data["desync"]
        assert isinstance(desync["step"], int) and desync["what"]
        if name in ("skipped_collective", "mismatched_shape", "mismatched_op", "wrong_root", "mismatched_dtype",
                    "skipped_barrier"):
            assert desync["step"] == 1
            sites = {info["site"] for info in desync["collective"]["ranks"].values()}
            assert any("faults.py" in site for site in sites), desync
        else:
            assert desync["what"].startswith("param"), desync
    if fault.status == "pass":
        assert data["stragglers"][0]["rank"] == FAULT_RANK
    # Only the pool's live (rebuilt) worlds remain: every killed rank is gone, and
    # nothing is left in the temp dirs. The same pool runs a clean check next.
    assert stray_processes(pool.pids) == set()
    assert _left_behind(before) == set()
    after = check(models.mlp_sgd(), modes=("ddp",), world_sizes=(world_size,), pool=pool)
    assert after.ok, after.render()
    assert not any(r.desync for r in after.runs)


def test_clean_models_raise_no_false_desync_or_straggler(pool):
    for factory in models.DEMO_CASES.values():
        report = check(factory(), modes=("ddp",), world_sizes=(2, 4), pool=pool)
        assert report.ok, report.render()
        assert all(r.desync is None and not r.stragglers for r in report.runs)


# -- the hang blame matrix under check: a rank that stalls at each place of a step -------------

STALLS = [(where, on, ws) for ws in (2, 3) for where in ("data", "forward", "inforward", "backward", "step",
                                                          "inoptim", "end") for on in (0, -1)]
DEFAULT_STALLS = {("forward", 0, 2), ("data", -1, 3)}


@pytest.mark.parametrize("where, on, ws", [
    pytest.param(*s, marks=() if s in DEFAULT_STALLS else pytest.mark.breadth, id=f"{s[0]}-rank{s[1]}-ws{s[2]}")
    for s in STALLS])
def test_the_rank_that_stalls_is_the_one_blamed_wherever_it_stalls(where, on, ws):
    """Before its forward, its rank's peers wait inside DDP's reducer (the rebuilt buckets'
    sync at step 1), a collective the ledger does not see: their stacks say so."""
    from ddparity.fixtures import faults

    report = check(faults.stalled_at(where, on), modes=("ddp",), world_sizes=(ws,), timeout=3)
    [run] = report.runs
    assert run.status == "hang" and run.hang.suspect_ranks == [on % ws], report.render()


SHARDED_STALLS = [(mode, where, on) for mode in ("hsdp", "fsdp") for where in ("forward", "backward", "inoptim")
                  for on in (0, -1)]
DEFAULT_SHARDED_STALLS = {("hsdp", "forward", 0), ("hsdp", "forward", -1)}


@pytest.mark.parametrize("mode, where, on", [
    pytest.param(*s, marks=() if s in DEFAULT_SHARDED_STALLS else pytest.mark.breadth, id=f"{s[0]}-{s[1]}-rank{s[2]}")
    for s in SHARDED_STALLS])
def test_the_rank_that_stalls_under_fsdp2_is_the_one_blamed_not_its_shard_groups_peer(mode, where, on):
    """HSDP at 4 ranks (2 replicas of 2 shards): rank 0 stalled before its forward left rank 1
    waiting in their shard group's all-gather, in forward too, while ranks 2 and 3 went on to
    backward: suspects [0, 1], the waiting peer blamed with the culprit. The ledgers say whom
    rank 1 waits for (a subgroup's collective rank 0 never issued)."""
    from ddparity.fixtures import faults

    report = check(faults.stalled_at(where, on), modes=(mode,), world_sizes=(4,), timeout=3)
    [run] = report.runs
    assert run.status == "hang" and run.hang.suspect_ranks == [on % 4], report.render()
