"""How close does a correct DDP run come to the calibrated noise floor?

For clean cases (demo models, generated MLPs; SGD, Adam, AdamW; float32 and float64;
world sizes 2, 3, 4, 8) this prints, per case, the largest ratio
``DDP error / calibrated noise`` over every step, kind and tensor — the number that
``HEADROOM`` in ``ddparity/checks/tolerance.py`` must exceed.

    python benchmarks/tolerance_sweep.py
"""

from __future__ import annotations

import itertools
import sys

import torch

from ddparity import Case
from ddparity.checks.tolerance import HEADROOM, auto_tolerance
from ddparity.fixtures import models
from ddparity.harness.ranks.tasks import prepare_task, reference_task, replica_task
from ddparity.harness.spool_files import Spool
from ddparity.harness.world.pool import WorldPool


def worst_ratio(case: Case, ws: int, pool: WorldPool) -> float:
    with Spool() as spool:
        pool.get(1, "gloo").run(prepare_task, case, spool.path)
        [reference] = pool.get(1, "gloo").run(reference_task, case, spool.path, (ws,))
        runs = pool.get(ws, "gloo").run(replica_task, case, spool.path, "ddp")
    tol = auto_tolerance(reference, ws, case.torch_dtype)
    ratio = 0.0
    for step, entries in enumerate(reference.steps):
        for kind, name in entries:
            floor = tol(step, kind, name) / HEADROOM
            for run in runs:
                err = run.steps[step][(kind, name)]
                if err:
                    ratio = max(ratio, err / floor if floor else float("inf"))
    return ratio


def cases():
    for name, factory in models.DEMO_CASES.items():
        yield name, factory()
    for (hidden, opt, dtype) in itertools.product(((8,), (32, 32), (64, 16, 64)), ("sgd", "adam", "adamw"),
                                                   (torch.float32, torch.float64)):
        sizes = (16, *hidden, 4)
        yield (f"mlp{hidden}-{opt}-{str(dtype)[6:]}",
               Case(model=lambda s=sizes: models.MLP(s), data=models.vectors, optimizer=opt, lr=0.05,
                    steps=5, dtype=dtype))


def main() -> int:
    pool = WorldPool()
    overall = 0.0
    try:
        for name, case in cases():
            ratios = {ws: worst_ratio(case, ws, pool) for ws in (2, 3, 4, 8)}
            overall = max(overall, *ratios.values())
            print(f"{name:<32} " + "  ".join(f"ws{ws}: {r:5.2f}" for ws, r in ratios.items()))
    finally:
        pool.close()
    print(f"\nlargest DDP error / calibrated noise: {overall:.2f} (HEADROOM is {HEADROOM:g})")
    return 1 if overall >= HEADROOM else 0  # a clean case beyond its tolerance: a false alarm


if __name__ == "__main__":
    sys.exit(main())
