from __future__ import annotations

import os
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


HELPERS = ("forkserver", "resource_tracker", "ddparity-janitor")


def _is_helper(pid: int) -> bool:
    """The forkserver, resource tracker or the janitor of multiprocessing's temporary
    directory (our direct children, living as long as the session), not a rank the
    forkserver forked (same command line, but the forkserver's child)."""
    try:
        proc = psutil.Process(pid)
        return proc.ppid() == os.getpid() and any(h in " ".join(proc.cmdline()) for h in HELPERS)
    except psutil.Error:
        return False


def stray_processes(expected: set[int]) -> set[int]:
    """Our child processes that are neither ``expected`` nor multiprocessing helpers
    (those live as long as the session: they are not waited for)."""
    return wait_gone({p for p in _children() - expected if not _is_helper(p)})


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves any child process behind."""
    before = _children()
    yield
    from ddparity.harness.world.pool import default_pool

    default_pool().close()
    leftover = stray_processes(before)  # multiprocessing's shared helpers may stay
    assert not leftover, f"processes left behind: {leftover}"


def older_torch() -> bool:
    from ddparity.settings import NEWER_TORCH, torch_release

    return torch_release() < NEWER_TORCH


needs_newer_torch = pytest.mark.skipif(older_torch(), reason="torchrun check/profile and the threaded backend "
                                       "need torch >= 2.13; ddparity refuses them on older torch (tested)")


def pytest_addoption(parser):
    parser.addoption("--catalogue", action="store_true", default=False,
                     help="run the whole catalogue sweep (tests marked catalogue: every torch.nn layer in every "
                          "mode at world sizes 1, 2, 4 and simulated 16, fp32 and bf16); .ci/run does")
    parser.addoption("--docs", action="store_true", default=False,
                     help="run every code block and transcript of docs/ (tests marked docs; the default suite "
                          "runs the README's); .ci/run does")
    parser.addoption("--breadth", action="store_true", default=False,
                     help="run the breadth sweep (tests marked breadth: the same behaviour on more cases — every "
                          "layer compiled, more faults on rank 0 under torchrun; the default suite runs one of "
                          "each); .ci/run does")
    parser.addoption("--real-models", action="store_true", default=False,
                     help="run every real model clean and with every planted bug (tests marked real_models; the "
                          "default suite runs GPT-2 clean and summed); .ci/run does")


SWEEPS = {"catalogue": "the whole catalogue sweep runs with --catalogue (.ci/run runs it)",
          "real_models": "every real model runs with --real-models (.ci/run runs it)",
          "docs": "the blocks of docs/ run with --docs (.ci/run runs them)",
          "breadth": "the breadth sweep runs with --breadth (.ci/run runs it)"}


def pytest_collection_modifyitems(config, items):
    for marker, reason in SWEEPS.items():
        if config.getoption(f"--{marker.replace('_', '-')}"):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
