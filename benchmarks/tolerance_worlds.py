"""The auto tolerance across world sizes up to simulated 1024, in float32, bfloat16 and float16.

For a few models (an MLP, a CNN, a transformer block), each dtype and world size, this runs
the clean case (a mean loss) and its summed-loss twin (``reduction="sum"``, a bug whose error
is a fixed share of the value: DDP averages the ranks' sums, so every gradient is 1/W of the
reference's) under simulated DDP and prints:

* clean: the verdict (a false alarm if not ``pass``); a run too imprecise to judge says so
  (``imprecise``), never ``pass``;
* summed: the verdict and its margin, ``error / tolerance`` of the first divergence (a false
  pass if the verdict is ``pass``).

Exit code 1 on a false alarm or a false pass.

    python benchmarks/tolerance_worlds.py                 # world sizes 2, 16, 128, 1024
    python benchmarks/tolerance_worlds.py --world-sizes 2,128 --models mlp
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ddparity import Case, check
from ddparity.fixtures import models


def summed_ce(outputs: Any, targets: Any) -> Any:
    return F.cross_entropy(outputs, targets, reduction="sum")


def mlp(batch: int) -> tuple[Any, Any]:
    return (lambda: models.MLP((16, 32, 4)),
            lambda step, g: models.vectors(step, g, batch=batch))


def cnn(batch: int) -> tuple[Any, Any]:
    def images(step: int, g: torch.Generator) -> Any:
        return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)
    return models.CNN, images


def transformer(batch: int) -> tuple[Any, Any]:
    def tokens(step: int, g: torch.Generator) -> Any:
        return torch.randint(0, 50, (batch, 6), generator=g), torch.randint(0, 3, (batch,), generator=g)
    return (lambda: models.TransformerBlock(dim=16, heads=2), tokens)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def margin(run: Any) -> float:
    """error / tolerance of a run's first divergence (0 for none)."""
    d = run.first_divergence
    return d.max_abs / d.tolerance if d is not None and d.tolerance else 0.0


def verdict(run: Any) -> str:
    if run.status == "error" and run.reason and "too imprecise" in run.reason:
        return "imprecise"
    return run.status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,16,128,1024")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--optimizer", default="sgd")
    args = parser.parse_args(argv)
    sizes = [int(w) for w in args.world_sizes.split(",")]
    bad = 0
    print(f"{'model':<12} {'dtype':<9} {'W':>5}  {'clean':<10} {'summed':<10} {'summed err/tol':>14}  seconds")
    for name in args.models.split(","):
        for dname in args.dtypes.split(","):
            for ws in sizes:
                model, data = MODELS[name](max(ws, 8))
                started = time.perf_counter()
                row = []
                for loss in ("cross_entropy", summed_ce):
                    case = Case(model=model, data=data, loss=loss, optimizer=args.optimizer, lr=1e-2, steps=2,
                                dtype=DTYPES[dname], name=f"{name} {dname}")
                    [run] = [r for r in check(case, modes=("ddp",), world_sizes=(ws,)).runs]
                    row.append(run)
                clean, summed = row
                false_alarm = clean.status != "pass" and verdict(clean) != "imprecise"
                false_pass = summed.status == "pass"
                bad += false_alarm or false_pass
                flag = "  FALSE ALARM" if false_alarm else "  FALSE PASS" if false_pass else ""
                print(f"{name:<12} {dname:<9} {ws:>5}  {verdict(clean):<10} {verdict(summed):<10} "
                      f"{margin(summed):>14.3g}  {time.perf_counter() - started:7.1f}{flag}", flush=True)
    print(f"\n{bad} false alarm(s) or false pass(es)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
