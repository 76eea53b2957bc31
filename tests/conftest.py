from __future__ import annotations

import time

import psutil
import pytest


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The pids still alive (zombies excluded) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        if alive:
            time.sleep(0.05)
    return alive


HELPERS = ("forkserver", "resource_tracker")


def stray_processes(expected: set[int]) -> set[int]:
    """Our child processes that are neither ``expected`` nor multiprocessing helpers."""
    stray = wait_gone(_children() - expected)
    return {p for p in stray if not any(h in " ".join(psutil.Process(p).cmdline()) for h in HELPERS)}


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves any child process behind."""
    before = _children()
    yield
    from ddparity.controller import default_pool

    default_pool().close()
    leftover = wait_gone(_children() - before)
    # multiprocessing's shared helpers (forkserver, resource tracker) may stay
    helpers = ("forkserver", "resource_tracker")
    leftover = {p for p in leftover if not any(h in " ".join(psutil.Process(p).cmdline()) for h in helpers)}
    assert not leftover, f"processes left behind: {leftover}"
