"""Rank side of ``health --long``: the stress pass, a device and its links held busy for a
while, every result checked.

For ``seconds``, each rank repeats one seeded float32 matmul (4096 square on a GPU, 384 on
a CPU) and an all-reduce of exactly representable values, in lockstep (each round ends with
a one-element all-reduce that says whether time is up on every rank, so all run the same rounds).
Every repeat's product must equal the first bit for bit, on the device (a device that
computes right when cool and flips bits when hot or throttled is what DCGM's r3 and
NVIDIA's stress tests look for); every all-reduce must be exact. Judged by
:func:`ddparity.checks.health.judge` (``stress``). Drill: ``flaky_bits@RANK`` flips one bit
of the third repeat's product on that rank.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from ddparity.harness.protocol import RankContext
from ddparity.harness.recording.recorder import active

MATRIX = {"cuda": 4096, "cpu": 384}
REDUCE_BYTES = {"cuda": 64 << 20, "cpu": 4 << 20}
KEPT = 10
"""At most this many repeat numbers kept for each kind of finding (their counts are whole)."""


def digest(t: Any) -> int:
    """A number that any change of any bit of ``t`` changes (its bytes hashed, 63 bits)."""
    import torch

    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") >> 1


def stress(ctx: RankContext, seconds: float, flaky: bool = False) -> dict[str, Any]:
    """Run the stress pass for ``seconds`` (every rank of the world calls it); returns what
    it did and every repeat that was not what it must be."""
    import torch
    import torch.distributed as dist

    kind = "cuda" if ctx.device.startswith("cuda") else "cpu"
    n = MATRIX[kind]
    generator = torch.Generator().manual_seed(4321)
    a = torch.randn(n, n, generator=generator).to(ctx.device)
    b = torch.randn(n, n, generator=generator).to(ctx.device)
    first = (a @ b).view(torch.int32)
    pattern = torch.arange(REDUCE_BYTES[kind] // 4, dtype=torch.float32, device=ctx.device) % 7 + 1
    want = pattern * (ctx.world_size * (ctx.world_size + 1) // 2)
    stop = torch.zeros(1, device=ctx.device)
    mismatches: list[int] = []
    wrong_reduces: list[int] = []
    repeats = 0
    started = time.perf_counter()
    phase = active().set_phase
    while True:
        phase(-1, "stress")  # each round: the record moves
        repeats += 1
        product = (a @ b).view(torch.int32)
        if flaky and repeats == 3:
            product[0, 0] ^= 1
        if not torch.equal(product, first):
            mismatches.append(repeats)
        reduced = pattern * (ctx.rank + 1)
        dist.all_reduce(reduced)
        if not torch.equal(reduced, want):
            wrong_reduces.append(repeats)
        stop.fill_(1.0 if time.perf_counter() - started >= seconds else 0.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MIN)  # ends once every rank ran its seconds
        if stop.item():
            break
    return {"seconds": time.perf_counter() - started, "matrix": n, "repeats": repeats,
            "reduce_bytes": pattern.numel() * 4, "matmul_mismatches": len(mismatches),
            "first_mismatches": mismatches[:KEPT], "allreduce_errors": len(wrong_reduces),
            "first_allreduce_errors": wrong_reduces[:KEPT]}
