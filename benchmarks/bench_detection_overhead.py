"""What desync/hang detection costs a DDP training step, measured side by side.

Both variants run in the same warm world of 2 gloo ranks (1 intra-op thread each), on an
MLP of a few million parameters with Adam, alternating round by round (and which goes
first) so that machine drift hits both alike:

* off: a plain DDP step (forward, backward with DDP's own all-reduce, a loss
  all-reduce, Adam step);
* on: the same step as ``ddparity check`` runs it: phase heartbeats to the side channel,
  every collective recorded in the ledger (DDP buckets through the bucket layout), and
  fingerprints of parameters, Adam state and RNG published after every step.

Per step: the wall time of the slower rank, the CPU time of the training thread (the
work detection adds, less sensitive than wall time to this machine's scheduling), and on
the ``on`` side the fingerprints' own wall time. Ratios: medians over all steps, and the
median of each round's ratio (a pair run back to back).

    python benchmarks/bench_detection_overhead.py [--rounds 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ddparity import World

SIZES = (512, 2048, 1024, 512)
BATCH = 64


def steps_task(ctx, detect: bool, steps: int) -> list[tuple[float, float, float]]:  # noqa: ANN001
    """Per timed step: (wall, training thread's CPU, fingerprints' wall), in seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.fixtures.models import MLP
    from ddparity.harness.recording import ddp_buckets, recorder
    from ddparity.harness.recording.fingerprint import fingerprint

    torch.manual_seed(0)
    model = MLP(SIZES)
    rec = recorder.active() if detect else recorder.DISABLED
    if not detect:
        recorder.active().pause()
    ddp = DistributedDataParallel(model)
    buckets = ddp_buckets.BucketLayout(ddp) if detect else None
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(ctx.rank)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        x = torch.randn(BATCH // ctx.world_size, SIZES[0], generator=gen)
        y = torch.randn(BATCH // ctx.world_size, SIZES[-1], generator=gen)
        dist.barrier()
        started, cpu = time.perf_counter(), time.thread_time()
        rec.set_phase(step, "forward")
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        rec.set_phase(step, "backward")
        if buckets is not None:
            rec.ddp_buckets(buckets.current())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec.set_phase(step, "optimizer")
        opt.step()
        prints = 0.0
        if detect:
            rec.set_phase(step, "fingerprint")
            prints = time.perf_counter()
            rec.fingerprints(step, fingerprint(model, opt, buffers=False, part=step))
            prints = time.perf_counter() - prints
        times.append((time.perf_counter() - started, time.thread_time() - cpu, prints))
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    params = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    print(f"MLP {SIZES}: {params / 1e6:.2f} M parameters, Adam, global batch {BATCH}, world size 2 (gloo)")
    steps: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    paired: list[float] = []
    with World(2, timeout=300) as world:
        for index in range(args.rounds):
            walls = {}
            for detect in (False, True) if index % 2 == 0 else (True, False):
                per_rank = world.run(steps_task, detect, args.steps)
                slower = [max(ts) for ts in zip(*per_rank)]  # a step ends when its slower rank does
                steps[detect].extend(slower)
                walls[detect] = statistics.median(t[0] for t in slower)
            paired.append(walls[True] / walls[False])
    if not len(steps[True]) == len(steps[False]) == args.rounds * args.steps:  # world.run raises on a rank's error
        raise SystemExit(f"timed {len(steps[True])} steps with detection and {len(steps[False])} without, "
                         f"not {args.rounds * args.steps}")

    def median_ms(detect: bool, field: int) -> float:
        return statistics.median(t[field] for t in steps[detect]) * 1e3

    for detect, label in ((False, "without detection"), (True, "with detection   ")):
        extra = f", of which fingerprints {median_ms(True, 2):.2f} ms" if detect else ""
        print(f"step {label}: median {median_ms(detect, 0):.1f} ms wall, {median_ms(detect, 1):.1f} ms CPU of the "
              f"training thread{extra} ({len(steps[detect])} steps)")
    print(f"ratio (with / without): wall {median_ms(True, 0) / median_ms(False, 0):.3f}x, training thread's CPU "
          f"{median_ms(True, 1) / median_ms(False, 1):.3f}x; wall within a round: median "
          f"{statistics.median(paired):.3f}x ({' '.join(f'{r:.3f}' for r in paired)})")


if __name__ == "__main__":
    main()
