"""Nothing another local user can reach decides a verdict: the ranks' progress, ledger and
fingerprints, and the process group's rendezvous, live in a 0700 folder of the controller,
not in a store on a loopback port (which takes any client's keys: another user appending
fingerprints there once turned a clean check into "DESYNC at step 99")."""

from __future__ import annotations

import os
import stat
import time

import psutil
import pytest

from ddparity import check
from ddparity.fixtures.models import mlp_sgd
from ddparity.harness.sidechannel import private_root
from ddparity.harness.world.pool import WorldPool


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


@pytest.fixture
def pool():
    pool = WorldPool()
    yield pool
    pool.close()


def test_the_rendezvous_is_a_private_file_and_the_controller_listens_on_no_port(pool):
    """The process group met through a TCPStore on a loopback port, which took any local
    user's keys (forged fingerprints there once turned a clean check into a desync); now
    through a FileStore in the world's 0700 folder."""
    assert check(mlp_sgd(), modes=("single", "ddp"), world_sizes=(2,), pool=pool).ok
    world = pool.get(2, "gloo")
    rendezvous = world._rendezvous()
    assert os.path.exists(rendezvous) and rendezvous.startswith(private_root())
    listening = [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening == []
    if os.geteuid() == 0:  # as user nobody: the file cannot be opened
        assert _exit_code(_as_another_user(lambda: open(rendezvous, "rb").close())) == 3


def test_the_side_channel_folder_is_this_users_alone(pool):
    world = pool.get(2, "gloo")
    world.run(lambda ctx: None)
    root = private_root()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.stat(root).st_uid == os.geteuid()
    if os.geteuid() != 0:
        pytest.skip("needs root to try as another user")
    assert _exit_code(_as_another_user(lambda: os.listdir(root))) == 3  # PermissionError
