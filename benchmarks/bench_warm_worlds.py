"""ddparity's warm worlds vs. a fresh `torch.multiprocessing.spawn` per check.

One run, side by side, on the same machine:

* spawn-per-check: what PyTorch's ``MultiProcessTestCase`` does — every check starts
  ``world_size`` fresh processes, which import torch, rendezvous, build DDP, train, exit;
* ddparity: ``check(case, modes=("ddp",), world_sizes=(W,))`` on warm worlds (the first
  check pays the world start; reference, DDP run and comparison included);
* raw DDP work: the same DDP training task alone in the same warm world;
* cold start: ``World(4).start()`` in a fresh interpreter that has imported torch.

    python benchmarks/bench_warm_worlds.py [--checks 20] [--spawn-checks 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ddparity import check
from ddparity.fixtures import models
from ddparity.harness.ranks.tasks import prepare_task, reference_task, replica_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import WorldPool

STEPS = 5


def spawned_rank(rank: int, world_size: int, store_dir: str) -> None:
    """A whole check in a fresh process, as MultiProcessTestCase runs one."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x, y = models.vectors(step, gen)
        per = x.shape[0] // world_size
        loss = torch.nn.functional.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    # gloo's teardown at interpreter exit sometimes aborts ("terminate called without an
    # active exception"); leave like our ranks do, so the baseline measures work, not luck.
    os._exit(0)


def spawn_check(world_size: int) -> float:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as store_dir:
        tmp.spawn(spawned_rank, args=(world_size, store_dir), nprocs=world_size, join=True)
    return time.perf_counter() - started


def cold_start_seconds(world_size: int) -> float:
    code = (
        "import time, torch; from ddparity import World; t = time.perf_counter(); "
        f"w = World({world_size}).start(); print(time.perf_counter() - t); w.close()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", type=int, default=20)
    parser.add_argument("--spawn-checks", type=int, default=20, help="fewer samples the slow side")
    parser.add_argument("--world-sizes", default="1,2,4")
    args = parser.parse_args()
    sizes = [int(s) for s in args.world_sizes.split(",")]
    case = models.mlp_sgd()
    case.steps = STEPS
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}; MLP {STEPS} steps; "
          f"{args.checks} ddparity checks and {args.spawn_checks} spawn checks per world size\n")
    rows = []
    pool = WorldPool()
    try:
        for ws in sizes:
            spawn_times = [spawn_check(ws) for _ in range(args.spawn_checks)]
            warm_times = []
            for _ in range(args.checks):
                t = time.perf_counter()
                report = check(case, modes=("ddp",), world_sizes=(ws,), backend="gloo", pool=pool)
                warm_times.append(time.perf_counter() - t)
                assert report.ok, report.render()
            world = pool.get(ws, "gloo")
            raw = []
            with Spool() as spool:  # the DDP task alone, compared with a reference written once
                pool.get(1, "gloo", role="reference").run(prepare_task, case, spool.path)
                pool.get(1, "gloo", role="reference").run(reference_task, case, spool.path, (ws,))
                for _ in range(args.checks):
                    t = time.perf_counter()
                    world.run(replica_task, case, spool.path, "ddp")
                    raw.append(time.perf_counter() - t)
            rows.append((ws, spawn_times, warm_times, raw))
    finally:
        pool.close()
    print(f"{'ws':>3} {'spawn/check':>12} {'ddparity/check':>15} {'first(cold)':>12} {'warm median':>12} "
          f"{'raw DDP':>9} {'20 checks: spawn':>17} {'ddparity':>9} {'ratio':>7} {'warm/raw':>9}")
    total_spawn = total_warm = 0.0
    for ws, spawn_times, warm_times, raw in rows:
        per_spawn = statistics.mean(spawn_times)
        twenty_spawn = per_spawn * args.checks
        twenty_warm = sum(warm_times)
        total_spawn += twenty_spawn
        total_warm += twenty_warm
        warm_median = statistics.median(warm_times[1:] or warm_times)
        raw_median = statistics.median(raw)
        print(f"{ws:>3} {per_spawn:>11.2f}s {statistics.mean(warm_times) * 1000:>13.0f}ms "
              f"{warm_times[0]:>11.2f}s {warm_median * 1000:>10.0f}ms {raw_median * 1000:>7.0f}ms "
              f"{twenty_spawn:>16.1f}s {twenty_warm:>8.2f}s {twenty_spawn / twenty_warm:>6.0f}x "
              f"{warm_median / raw_median:>8.2f}x")
    print(f"\nall world sizes, {args.checks} checks each: spawn {total_spawn:.1f}s, ddparity {total_warm:.2f}s, "
          f"ratio {total_spawn / total_warm:.0f}x")
    colds = [cold_start_seconds(4) for _ in range(3)]
    print(f"cold start of a 4-rank world (fresh interpreter, torch imported): "
          f"median {statistics.median(colds):.2f}s of {', '.join(f'{c:.2f}' for c in colds)}")


if __name__ == "__main__":
    main()
