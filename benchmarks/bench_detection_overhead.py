"""What desync/hang detection costs a DDP training step, measured side by side.

Both variants run in the same warm world of 2 gloo ranks (1 intra-op thread each), on an
MLP of a few million parameters with Adam, alternating round by round so that machine
drift hits both alike:

* off: a plain DDP step (forward, backward with DDP's own all-reduce, a loss
  all-reduce, Adam step);
* on: the same step as ``ddparity check`` runs it: phase heartbeats to the side channel,
  every collective recorded in the ledger (DDP buckets through the ledger's comm hook),
  and fingerprints of parameters, Adam state and RNG published after every step.

    python benchmarks/bench_detection_overhead.py [--rounds 6] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ddparity import World

SIZES = (512, 2048, 1024, 512)
BATCH = 64


def steps_task(ctx, detect: bool, steps: int) -> list[float]:  # noqa: ANN001
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.fixtures.models import MLP
    from ddparity.harness.ranks import ddp_buckets, recorder
    from ddparity.harness.ranks.fingerprint import fingerprint

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
        started = time.perf_counter()
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
        if detect:
            rec.set_phase(step, "fingerprint")
            rec.fingerprints(step, fingerprint(model, opt, buffers=False, part=step))
        times.append(time.perf_counter() - started)
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    params = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    print(f"MLP {SIZES}: {params / 1e6:.2f} M parameters, Adam, global batch {BATCH}, world size 2 (gloo)")
    on: list[float] = []
    off: list[float] = []
    with World(2, timeout=300) as world:
        for _ in range(args.rounds):
            for detect, into in ((False, off), (True, on)):
                per_rank = world.run(steps_task, detect, args.steps)
                into.extend(max(ts) for ts in zip(*per_rank))  # a step ends when its slowest rank does
    if not len(on) == len(off) == args.rounds * args.steps:  # world.run raises on a rank's error: belt and braces
        raise SystemExit(f"timed {len(on)} steps with detection and {len(off)} without, not {args.rounds * args.steps}")
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"step without detection: median {m_off * 1e3:.1f} ms over {len(off)} steps")
    print(f"step with detection:    median {m_on * 1e3:.1f} ms over {len(on)} steps")
    print(f"ratio (with / without): {m_on / m_off:.3f}x")


if __name__ == "__main__":
    main()
