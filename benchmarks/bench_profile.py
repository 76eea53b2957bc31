"""Does ``ddparity profile`` measure DDP as it runs without it?

One run, side by side, in the same warm worlds: the demo case (wide MLP, Adam, 1 MB
buckets) profiled by ddparity, against a plain DDP training loop timed by hand — no comm
hook, no barriers, no phases: ``perf_counter`` around each step, median over the steps,
slowest rank. Reports both step times and their ratio per world size, and the exposed
communication ddparity derives (sync - no_sync) next to the plain loop's (a plain step
minus a plain ``no_sync`` step).

    python benchmarks/bench_profile.py [--world-sizes 1,2,4] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ddparity.fixtures.models import profile_demo
from ddparity.harness.ranks.tasks import prepare_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import WorldPool
from ddparity.verbs.profile import profile


def plain_loop(ctx, case, state, steps, warmup):  # noqa: ANN001, ANN201 - runs on the ranks
    """A DDP training loop as users write it, timed per step (and the same under no_sync)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.case import make_optimizer, resolve_loss
    from ddparity.harness.ranks.batches import cast, shard
    from ddparity.harness.ranks.training import data_fn, global_batch, prepared

    model = DistributedDataParallel(prepared(case, state, ctx.device), **case.ddp_options)
    optimizer = make_optimizer(case, model.parameters())
    loss_fn = resolve_loss(case.loss)
    data, generator = data_fn(case), torch.Generator().manual_seed(case.seed)
    batches = []
    for step in range(case.steps):
        x, y = global_batch(data, step, generator)
        batches.append((cast(shard(x, ctx.rank, ctx.world_size), case, ctx.device),
                        cast(shard(y, ctx.rank, ctx.world_size), case, ctx.device)))
    timings = {"step": [], "no_sync": []}
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        for kind in ("no_sync", "step"):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if kind == "no_sync":
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            else:
                loss_fn(model(x), y).backward()
                optimizer.step()
            if i >= warmup:
                timings[kind].append(time.perf_counter() - started)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.world_sizes.split(","))
    case = profile_demo()
    pool = WorldPool()
    spool = Spool()  # the initial state, memory-mapped by the plain loop's ranks too
    try:
        report = profile(case, world_sizes=sizes, steps=args.steps, warmup=3, pool=pool)
        pool.get(1, "gloo", role="reference").run(prepare_task, case, spool.path)
        state = spool.path
        print(f"{os.cpu_count()} CPUs; {case.label}; {args.steps} measured steps, medians, slowest rank")
        print(" ws  ddparity step  plain step  ratio   ddparity exposed  plain step - no_sync")
        for run in report.runs:
            ws = run.world_size
            timings = pool.get(ws, "gloo").run(plain_loop, case, state, args.steps, 3)
            steps = [max(t["step"][k] for t in timings) for k in range(args.steps)]
            no_sync = [max(t["no_sync"][k] for t in timings) for k in range(args.steps)]
            plain = statistics.median(steps)
            plain_compute = statistics.median(no_sync)
            # the plain no_sync pass has no optimizer step; ddparity's exposed time has none either
            opt = run.optimizer_s or 0.0
            assert run.step_s is not None and run.exposed_comm_s is not None
            print(f"{ws:3d}  {run.step_s * 1e3:10.2f} ms  {plain * 1e3:7.2f} ms  {run.step_s / plain:5.2f}x"
                  f"  {run.exposed_comm_s * 1e3:13.2f} ms  {max(0.0, plain - plain_compute - opt) * 1e3:13.2f} ms")
    finally:
        pool.close()
        spool.close()


if __name__ == "__main__":
    main()
