"""Nothing another local user can reach decides a verdict: the ranks' progress, ledger and
fingerprints live in a 0700 folder of the controller, not in the loopback store (which
takes any client's keys: another user appending fingerprints there once turned a clean
check into "DESYNC at step 99")."""

from __future__ import annotations

import os
import stat
import time

import pytest

from ddparity import check
from ddparity.fixtures.models import mlp_sgd
from ddparity.harness.pool import WorldPool
from ddparity.harness.sidechannel import private_root
from ddparity.records import encode_fingerprints


def _as_another_user(work) -> int:  # noqa: ANN001
    """Start ``work()`` in a forked child running as user nobody where this test may switch
    (root), else as this user; returns its pid (exit code 0 done, 3 PermissionError)."""
    pid = os.fork()
    if pid == 0:  # the child: no exec (nobody cannot reach this interpreter under /root)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            work()
            os._exit(0)
        except PermissionError:
            os._exit(3)
        except BaseException:
            os._exit(1)
    return pid


def _exit_code(pid: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the other user's process did not finish")


def _forge(port: int, prefix: str, seconds: float) -> None:
    """What the attacker did: while the check runs, append fingerprints of a step 99 (that
    differ between the ranks) under the keys the side channel once used."""
    import datetime

    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    lines = [encode_fingerprints(99, {"net.0.weight": 12345 + rank}) for rank in range(2)]  # ranks that differ
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for task in range(1, 200):  # task ids count from 1 in a process
            for rank in range(2):
                client.append(f"{prefix}/side/t{task}/F{rank}", lines[rank] + "\n")
        time.sleep(0.01)


@pytest.fixture
def pool():
    pool = WorldPool()
    yield pool
    pool.close()


def test_keys_written_to_the_store_by_anyone_change_no_verdict(pool):
    assert check(mlp_sgd(), modes=("single", "ddp"), world_sizes=(2,), pool=pool).ok
    world = pool.get(2, "gloo")
    attacker = _as_another_user(lambda: _forge(world._store.port, world._store_prefix, 8.0))
    try:
        reports = [check(mlp_sgd(), modes=("single", "ddp"), world_sizes=(2,), pool=pool) for _ in range(3)]
    finally:
        assert _exit_code(attacker) == 0  # it could write to the store all along
    for report in reports:
        assert report.ok, report.render()
        assert all(r.desync is None and not r.stragglers for r in report.runs)


def test_the_side_channel_folder_is_this_users_alone(pool):
    world = pool.get(2, "gloo")
    world.run(lambda ctx: None)
    root = private_root()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.stat(root).st_uid == os.geteuid()
    if os.geteuid() != 0:
        pytest.skip("needs root to try as another user")
    assert _exit_code(_as_another_user(lambda: os.listdir(root))) == 3  # PermissionError
