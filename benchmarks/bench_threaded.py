"""Simulated world sizes: a 3-step check of a small MLP at threaded world sizes 8 to 64,
and the cost per simulated rank; real processes at 2 and 4 alongside for scale.

    python benchmarks/bench_threaded.py
"""

from __future__ import annotations

import time

import torch

from ddparity import Case, check
from ddparity.fixtures.models import MLP
from ddparity.harness.world.pool import WorldPool


def data(step: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(128, 16, generator=generator), torch.randint(0, 4, (128,), generator=generator)


def main() -> None:
    case = Case(model=MLP, data=data, optimizer="sgd", lr=0.1, steps=3)
    pool = WorldPool()
    started = time.perf_counter()
    check(case, modes=("ddp",), world_sizes=(2,), pool=pool)  # warm: the reference world, torch._dynamo
    print(f"warm-up (first check, worlds and imports): {time.perf_counter() - started:.2f} s")
    print(f"{'ws':>3}  {'backend':<9} {'check':>8}  {'per rank':>9}  verdict")
    for ws, backend in ((2, "gloo"), (4, "gloo"), (8, "threaded"), (16, "threaded"), (32, "threaded"),
                        (64, "threaded")):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            report = check(case, modes=("ddp",), world_sizes=(ws,), backend=backend, pool=pool)
            times.append(time.perf_counter() - t)
        best = sorted(times)[1]
        if report.runs[0].status != "pass":  # a clean case: a timed check that failed times nothing
            raise SystemExit(report.render())
        print(f"{ws:>3}  {backend:<9} {best:7.2f}s  {best / ws * 1e3:7.1f}ms  {report.runs[0].status}")
    pool.close()
    cold = time.perf_counter()
    fresh = WorldPool()
    if not check(case, modes=("ddp",), world_sizes=(64,), backend="threaded", pool=fresh).ok:
        raise SystemExit("the cold check at simulated 64 did not pass")
    print(f"a cold 3-step check at simulated world size 64 (new worlds, one process): "
          f"{time.perf_counter() - cold:.2f} s")
    fresh.close()


if __name__ == "__main__":
    main()
