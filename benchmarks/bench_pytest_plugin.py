"""A module of 30 parity tests (15 cases at world sizes 2 and 4) with the ddparity plugin,
against the same tests written with one ``torch.multiprocessing.spawn`` per test.

One run, side by side, in a temporary directory:

* plugin, ``pytest -n 0`` and ``pytest -n 2`` (pytest-xdist): ``parity(case)`` on warm
  worlds (reference, DDP run, comparison, detection);
* spawn per test: each test spawns ``world_size`` fresh processes that import torch,
  rendezvous, train the DDP shard and send their parameters back, and compares them with
  a single-device run in the test process — what a test suite without ddparity does.
  Sampled (``--spawn-tests``, default 6: 3 per world size) and scaled to 30.

Also reported: the most rank processes alive at once (each xdist worker keeps its own
worlds, within its share of ``max(8, 2 x CPUs)``).

    python benchmarks/bench_pytest_plugin.py [--spawn-tests 6] [--xdist 2,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

CASES = 15

PLUGIN_TESTS = textwrap.dedent(
    """
    import pytest
    from ddparity import Case
    from ddparity.fixtures.models import MLP, vectors

    @pytest.mark.world_size(2, 4)
    @pytest.mark.parametrize("seed", range({cases}))
    def test_parity(parity, seed):
        parity(Case(model=MLP, data=vectors, optimizer="sgd", lr=0.1, steps=3, seed=seed))
    """
).format(cases=CASES)

SPAWN_TESTS = textwrap.dedent(
    """
    import os, tempfile
    import pytest
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as tmp
    from ddparity.fixtures.models import MLP, vectors

    STEPS = 3

    def train(model, opt, rank=0, world_size=1):
        gen = torch.Generator().manual_seed(0)
        for step in range(STEPS):
            x, y = vectors(step, gen)
            per = x.shape[0] // world_size
            loss = torch.nn.functional.cross_entropy(model(x[rank * per:(rank + 1) * per]),
                                                     y[rank * per:(rank + 1) * per])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def rank_main(rank, world_size, tmpdir, seed):
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"file://{{tmpdir}}/store", rank=rank, world_size=world_size)
        torch.manual_seed(seed)
        model = torch.nn.parallel.DistributedDataParallel(MLP())
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, world_size)
        if rank == 0:
            torch.save(model.module.state_dict(), f"{{tmpdir}}/params.pt")
        dist.destroy_process_group()
        os._exit(0)

    @pytest.mark.parametrize("world_size", [2, 4])
    @pytest.mark.parametrize("seed", range({cases}))
    def test_parity(world_size, seed):
        torch.manual_seed(seed)
        reference = MLP()
        train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
        with tempfile.TemporaryDirectory() as tmpdir:
            tmp.spawn(rank_main, args=(world_size, tmpdir, seed), nprocs=world_size, join=True)
            got = torch.load(f"{{tmpdir}}/params.pt")
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)
    """
).format(cases=CASES)


def pytest_seconds(directory: str, *args: str, expect: int = 0) -> tuple[float, str, int]:
    """Wall seconds, pytest's summary line, and the most rank processes alive at once
    (descendants of pytest other than its xdist workers, sampled every 20 ms); exits the
    benchmark if pytest's exit code is not ``expect`` (a failed test's time means nothing)."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        parent = psutil.Process(proc.pid)
        while not done.wait(0.02):
            try:
                workers = {p.pid for p in parent.children()} if "-n" in args and args[args.index("-n") + 1] != "0" else set()
                ranks = [p for p in parent.children(recursive=True) if p.pid not in workers]
            except psutil.Error:
                continue
            peak = max(peak, len(ranks))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate(timeout=1800)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    summary = stdout.strip().splitlines()[-1] if stdout.strip() else stderr[-300:]
    if proc.returncode != expect:
        raise SystemExit(f"pytest {' '.join(args)} exited {proc.returncode}, not {expect}:\n{stdout[-3000:]}{stderr[-2000:]}")
    return seconds, summary, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawn-tests", type=int, default=6, help="spawn tests actually run (scaled to 30)")
    parser.add_argument("--xdist", default="2", help="pytest-xdist worker counts to run besides -n 0 (e.g. 2,4)")
    args = parser.parse_args()
    workers = [int(n) for n in args.xdist.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "test_plugin.py"), "w") as fh:
            fh.write(PLUGIN_TESTS)
        with open(os.path.join(directory, "test_spawn.py"), "w") as fh:
            fh.write(SPAWN_TESTS)
        runs = {n: pytest_seconds(directory, "test_plugin.py", "-n", str(n)) for n in [0, *workers]}
        per_ws = max(1, args.spawn_tests // 2)
        selected = " or ".join(f"test_parity[{seed}-{ws}]" for ws in (2, 4) for seed in range(per_ws))
        spawn, s_spawn, _ = pytest_seconds(directory, "test_spawn.py", "-k", selected)
        startup, _, _ = pytest_seconds(directory, "test_spawn.py", "-k", "no_such_test", expect=5)
        ran = 2 * per_ws
    # The session's start-up (pytest, torch import) is paid once, not per test.
    scaled = startup + (spawn - startup) / ran * 2 * CASES
    print(f"{os.cpu_count()} CPUs; {2 * CASES} parity tests (MLP, SGD, 3 steps) at world sizes 2 and 4")
    for n, (seconds, summary, peak) in runs.items():
        print(f"plugin, pytest -n {n}:  {seconds:6.1f} s   ({summary}; at most {peak} rank processes alive"
              f"{', all workers' if n else ''})")
    print(f"spawn per test:       {scaled:6.1f} s   (ran {ran} in {spawn:.1f} s incl. {startup:.1f} s session "
          f"start-up, scaled to {2 * CASES}; {s_spawn})")
    print("ratio spawn / plugin: " + ", ".join(f"{scaled / seconds:.1f}x (-n {n})" for n, (seconds, _, _) in runs.items()))


if __name__ == "__main__":
    main()
