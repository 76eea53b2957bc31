"""Detection on CUDA: ledger, fingerprints (CUDA tensors and CUDA RNG) and bucket layout
in a 1-rank nccl world, plus the cost of fingerprinting a 3.67 M-parameter MLP with Adam
on the GPU. Prints what it measured; exits 1 if something is missing."""

from __future__ import annotations

import sys
import time

from ddparity import World
from ddparity.records import parse_fingerprints, parse_ledger


def task(ctx):  # noqa: ANN001, ANN201
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.fixtures.models import MLP
    from ddparity.harness.recording import ddp_buckets, recorder
    from ddparity.harness.recording.fingerprint import fingerprint

    model = MLP((512, 2048, 1024, 512)).to(ctx.device)
    on_gpu = ctx.device.startswith("cuda")
    ddp = DistributedDataParallel(model, device_ids=[torch.device(ctx.device).index] if on_gpu else None)
    layout = ddp_buckets.BucketLayout(ddp)
    opt = torch.optim.Adam(ddp.parameters())
    rec = recorder.active()
    times = []
    for step in range(6):
        x = torch.randn(64, 512, device=ctx.device)
        rec.set_phase(step, "backward")
        rec.ddp_buckets(layout.current())
        ddp(x).square().mean().backward()
        opt.step()
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        if on_gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        prints = fingerprint(model, opt, buffers=False, part=None)
        times.append(time.perf_counter() - started)
        rec.fingerprints(step, prints)
    return sorted(times)[len(times) // 2], sorted(prints)


def main() -> int:
    with World(1, backend="nccl") as world:
        [outcome] = world.execute(task)
    seconds, names = outcome.value
    entries = parse_ledger(outcome.records.ledger)
    steps = parse_fingerprints(outcome.records.fingerprints)
    print(f"full fingerprint on the GPU: {seconds * 1e3:.2f} ms (params + Adam state, 3.67 M params)")
    print(f"ledger entries: {len(entries)}; first: {entries[0].render() if entries else None}")
    print(f"fingerprinted steps: {sorted(steps)}; names include: {[n for n in names if 'rng' in n]}")
    ok = entries and any("DDP gradient bucket" in e.via for e in entries) and any("cuda" in n for n in names)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
