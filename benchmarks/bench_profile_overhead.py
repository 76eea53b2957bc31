"""What ``profile``'s own timing costs the step it measures: the same DDP step with and
without ddparity's instrumentation, alternated step by step in the same two rank processes.

``profile`` times a DDP step by wrapping its gradient all-reduce in a comm hook that marks
each bucket's launch and completion and tallies what it sends (through the rank's
collective recorder), and by marking the optimizer step's end. The obvious alternative is
the same training with none of that. Both run here in one warm ddparity world of 2 gloo
ranks (one intra-op thread each), on two replicas of one MLP of ``--params`` parameters
(Adam, global batch 32): a plain ``DistributedDataParallel`` and the one ``profile``'s timed
mode builds (``TimedMode.wrap``: the hook and its recorder). Each iteration runs one step of
each, in alternating order, each started behind a barrier; a step's time is the slowest
rank's. Pairing step by step is what makes a few percent visible on a loaded machine: the
drift between two separate runs here was about 20 %. Every step timed must have trained
(finite loss).

    python benchmarks/bench_profile_overhead.py [--params 6e6] [--steps 60] [--warmup 5]
"""

from __future__ import annotations

import argparse
import math
import statistics


def paired_steps(ctx, width: int, steps: int, warmup: int, other: str) -> tuple[list[float], list[float]]:  # noqa: ANN001
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.harness.ranks.modes.timed import TimedMode

    torch.set_num_threads(1)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 16))

    plain = DistributedDataParallel(model())
    timed_mode = TimedMode(rank=ctx.rank, world_size=ctx.world_size, device="cpu", measured=steps, warmup=warmup)
    if other == "profile":
        timed = timed_mode.wrap(model())
    elif other == "plain":  # an A/A run: what the pairing itself reads as a difference
        timed = DistributedDataParallel(model())
    else:  # torch's own Python all-reduce hook alone: what any Python comm hook costs
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        timed = DistributedDataParallel(model())
        timed.register_comm_hook(None, default_hooks.allreduce_hook)
        timed_mode.timer = None
    marks: list[float] = []
    optimizers = {"plain": torch.optim.Adam(plain.parameters(), lr=1e-4),
                  "timed": torch.optim.Adam(timed.parameters(), lr=1e-4)}
    optimizers["timed"].register_step_post_hook(lambda *_: marks.append(time.perf_counter()))
    generator = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {"plain": [], "timed": []}
    for step in range(warmup + steps):
        x, y = torch.randn(32, 256, generator=generator), torch.randn(32, 16, generator=generator)
        x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        order = ("plain", "timed") if step % 2 == 0 else ("timed", "plain")
        for name in order:
            wrapped = plain if name == "plain" else timed
            dist.barrier()
            started = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(wrapped(x), y)
            loss.backward()
            optimizers[name].step()
            took = time.perf_counter() - started
            if name == "timed" and other == "profile":
                timed_mode.clear_comm()  # as the timed mode does each iteration
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"step {step} of the {name} replica did not train (loss {loss.item()})")
            if step >= warmup:
                seconds[name].append(took)
    slowest = {}
    for name, times in seconds.items():
        t = torch.tensor(times)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
    if len(marks) != warmup + steps:
        raise RuntimeError(f"the timed replica's optimizer marks: {len(marks)} of {warmup + steps}")
    return slowest["plain"], slowest["timed"]


ARMS = {"plain": "A/A: plain beside plain (the pairing's own noise)",
        "python_hook": "torch's Python all-reduce hook (any comm hook's cost)",
        "profile": "profile's timing (hook, marks, tally)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from ddparity import World

    width = int((-274 + math.sqrt(274**2 + 4 * args.params)) / 2)
    ratios: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with World(2, "gloo") as world:
        world.run(paired_steps, width, 30, args.warmup, "plain", timeout=1800)  # the world's own first steps
        for _ in range(args.rounds):
            for arm in ARMS:
                [(plain, other), _] = world.run(paired_steps, width, args.steps, args.warmup, arm, timeout=1800)
                assert len(plain) == len(other) == args.steps, (len(plain), len(other))
                ratios[arm].append(statistics.median(o / p for p, o in zip(plain, other)))
    print(f"MLP of {(width * width + 274 * width + 16) / 1e6:.1f} M parameters, Adam, batch 32 over 2 gloo ranks; "
          f"{args.steps} paired steps after {args.warmup} a round, alternating which goes first; {args.rounds} "
          f"round(s) of every arm")
    for arm, label in ARMS.items():
        print(f"  {label:<52} step / plain step: {' '.join(f'{r:.3f}' for r in ratios[arm])} "
              f"(median {statistics.median(ratios[arm]):.3f})")
    print("goal: profile's timing <= 1.05 the plain step; the A/A line is what this machine cannot tell apart")


if __name__ == "__main__":
    main()
