"""WorldPool: warm worlds reused across checks, with a cap on the live rank processes."""

from __future__ import annotations

import gc
import time

import pytest

from ddparity.errors import UsageError
from ddparity.harness.world.pool import WorldPool
from ddparity.settings import default_max_ranks
from tests.conftest import wait_gone

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_worlds_are_reused_until_the_cap_closes_the_least_recently_used():
    pool = WorldPool(max_ranks=4)
    try:
        ref = pool.get(1, "gloo", role="reference")
        pool.get(2, "gloo")
        assert pool.get(1, "gloo", role="reference") is ref  # warm: same world, same ranks
        first = set(pool.pids)
        assert len(first) == 3
        four = pool.get(4, "gloo")  # 3 + 4 > 4: both idle worlds close, the 2-rank one (older) first
        assert len(pool.pids) == 4 and pool.closed_for_room == 2
        assert not wait_gone(first)
        assert four.run(lambda ctx: ctx.world_size) == [4] * 4
        one = pool.get(1, "gloo", role="reference")  # 4 + 1 > 4: the 4-rank world closes
        assert one is not ref and len(pool.pids) == 1 and pool.closed_for_room == 3
    finally:
        pool.close()
    assert pool.pids == set()


def test_a_busy_world_is_never_closed_to_make_room():
    pool = WorldPool(max_ranks=2)
    try:
        two = pool.get(2, "gloo")
        pending = two.submit(lambda ctx: time.sleep(0.5) or ctx.rank)
        ref = pool.get(1, "gloo", role="reference")  # over the cap, but two is working
        assert len(pool.pids) == 3 and pool.closed_for_room == 0
        assert [o.value for o in pending.result()] == [0, 1]
        assert ref.run(lambda ctx: ctx.rank) == [0]
    finally:
        pool.close()


def test_no_cap_and_bad_caps():
    pool = WorldPool()
    try:
        for ws in (1, 2, 3):
            pool.get(ws, "gloo")
        assert len(pool.pids) == 6 and pool.closed_for_room == 0
    finally:
        pool.close()
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(UsageError, match="max_ranks must be an integer >= 1 or None"):
            WorldPool(max_ranks=bad)


def test_the_machine_budget_is_shared_by_xdist_workers():
    machine = default_max_ranks(1)
    assert machine >= 8
    assert default_max_ranks(2) == machine // 2
    assert default_max_ranks(10_000) == 1


def test_starting_worlds_keeps_the_collector_on_and_freezes_what_torch_imported():
    pool = WorldPool()
    try:
        pool.get(2, "gloo")
        assert gc.isenabled()
        assert gc.get_freeze_count() > 100_000  # torch and torch._dynamo: skipped by full collections
        # ranks forked after a collection in the parent still work
        gc.collect()
        assert pool.get(3, "gloo").run(lambda ctx: ctx.rank) == [0, 1, 2]
    finally:
        pool.close()
