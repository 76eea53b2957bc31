"""Large models: a check costs the replicas' memory, not a trace per rank per step, and a
slow step is progress, never a hang."""

from __future__ import annotations

import os
import pickle

import pytest

from ddparity import check
from ddparity.fixtures import large
from ddparity.harness.ranks.tasks import prepare_task, reference_task, replica_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import default_pool

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _sent_and_spooled(case):
    """Bytes the controller received from the reference and a DDP run, and the spool's
    bytes on disk, for ``case``."""
    pool = default_pool()
    with Spool() as spool:
        pool.get(1, "gloo", role="reference").run(prepare_task, case, spool.path)
        [reference] = pool.get(1, "gloo", role="reference").run(reference_task, case, spool.path, (2,))
        runs = pool.get(2, "gloo").run(replica_task, case, spool.path, "ddp")
        disk = sum(os.path.getsize(os.path.join(spool.path, f)) for f in os.listdir(spool.path))
    return len(pickle.dumps(reference)) + sum(len(pickle.dumps(r)) for r in runs), disk


def test_what_crosses_to_the_controller_is_numbers_not_tensors():
    """A 4 M-parameter model (16 MB of float32 per copy): the controller gets a few KB,
    whatever the size of the model; the tensors stay on disk, written once each."""
    sent, disk = _sent_and_spooled(large.mlp_case(4, steps=2))
    copy = 4e6 * 4
    assert sent < 20_000, sent
    # the initial state, then per step the gradients and the parameters (x 2 steps); the
    # optimizer's state only where a sharded mode is checked
    assert 5 * copy * 0.95 < disk < 5 * copy * 1.05, disk


def test_what_crosses_grows_with_steps_by_numbers_only():
    small, _ = _sent_and_spooled(large.mlp_case(1, steps=2))
    more, _ = _sent_and_spooled(large.mlp_case(1, steps=8))
    assert more - small < 4 * small, (small, more)  # a few hundred bytes a step, not 4 MB


def test_a_step_longer_than_the_timeout_is_progress_not_a_hang():
    # 10 layers of 0.5 s: a step of 5 s, each layer's progress 8x within the 4 s timeout
    report = check(large.slow_steps(layers=10, seconds=0.5), world_sizes=(2,), timeout=4)
    assert report.ok, report.render()


def test_a_reference_stuck_in_one_place_is_still_a_hang():
    report = check(large.slow_steps(layers=1, seconds=30.0), world_sizes=(2,), timeout=4)
    assert report.exit_code == 3, report.render()
    assert "hang" in report.render().lower()
