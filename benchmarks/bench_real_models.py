"""Verdicts on real models, clean and with planted bugs, with dropout aligned and without.

For every case of ``ddparity.fixtures.real_models`` (transformers GPT-2 and BERT from tiny
configs, a ResNet of basic blocks with BatchNorm, a MobileNet block, a small ViT — dropout
on wherever the model has it) and every world size: the verdict, the margin of the first
divergence (its error / its tolerance) and the seconds of the check. Side by side, the
obvious alternatives: the same checks with ddparity's per-sample dropout alignment and its
random-draw detector switched off — dropout drawn from torch's one generator, as a plain
comparison of runs does it (the calibration then finds a twin too far from the reference:
such runs are an ``error``, no verdict, never a pass).

    python benchmarks/bench_real_models.py [--world-sizes 2,4] [--only gpt2,gpt2_summed]

Needs transformers for the GPT-2 and BERT cases (``pip install -e ".[real]"``); without it
they are left out.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import Any

from ddparity import check
from ddparity.fixtures import real_models
from ddparity.harness.world.pool import WorldPool


def run(cases: dict[str, Any], world_sizes: tuple[int, ...], pool: WorldPool) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for name, factory in cases.items():
        started = time.perf_counter()
        report = check(factory(), modes=("single", "ddp"), world_sizes=world_sizes, pool=pool)
        seconds = time.perf_counter() - started
        rows = []
        for r in report.runs[1:]:
            d = r.first_divergence
            margin = d.max_abs / d.tolerance if d is not None and d.tolerance else None
            rows.append((r.world_size, r.status, margin, seconds))
        out[name] = rows
    return out


def switch_alignment_off() -> None:
    """Plain dropout from torch's generator, no draw detection (rank processes forked after
    this inherit it)."""
    import contextlib

    from ddparity.harness.ranks import training

    class Unaligned:
        def __init__(self, *args: Any, **options: Any) -> None:
            pass

        def begin(self, *args: Any) -> None:
            pass

        def close(self) -> int:
            return 0

    class NoDetection(contextlib.nullcontext):
        moved = False

        def __init__(self, **options: Any) -> None:
            super().__init__()

        def __enter__(self) -> NoDetection:
            return self

        def raise_if_any(self, *args: Any) -> None:
            pass

    training.AlignedDropout = Unaligned  # type: ignore[assignment,misc]
    training.RandomDraws = NoDetection  # type: ignore[assignment,misc]


NO_DROPOUT = {"resnet_frozen_bn", "resnet_bn_on_shards", "mobilenet_batch_statistics"}
"""Where the alternatives must agree with ddparity: nothing random to align."""


def fmt(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:.3g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    have_transformers = importlib.util.find_spec("transformers") is not None
    cases = {**{k: v for k, v in real_models.CLEAN.items()}, **real_models.BUGS}
    if not have_transformers:
        cases = {k: v for k, v in cases.items() if k not in real_models.NEEDS_TRANSFORMERS}
    if args.only:
        cases = {k: cases[k] for k in args.only.split(",")}

    aligned_pool = WorldPool()
    aligned = run(cases, world_sizes, aligned_pool)
    aligned_pool.close()
    switch_alignment_off()
    plain_pool = WorldPool()
    plain = run(cases, world_sizes, plain_pool)
    plain_pool.close()

    header = (f"{'case':32} {'world':>5}  {'expect':7}  {'ddparity':9} {'margin':>9} {'s':>5}   "
              f"{'dropout unaligned':17} {'margin':>9}")
    print(header)
    print("-" * len(header))
    wrong = {"ddparity": 0, "unaligned": 0}

    def verdict(status: str, expect: str, key: str) -> str:
        right = (status == "pass") == (expect == "pass")
        wrong[key] += not right
        return status if right else f"{status} (WRONG)"

    for name in cases:
        expect = "pass" if name in real_models.CLEAN else "flag"
        for (ws, status, margin, seconds), (_, plain_status, plain_margin, _) in zip(aligned[name], plain[name]):
            print(f"{name:32} {ws:>5}  {expect:7}  {verdict(status, expect, 'ddparity'):9} {fmt(margin):>9} "
                  f"{seconds:5.1f}   {verdict(plain_status, expect, 'unaligned'):17} {fmt(plain_margin):>9}")
    runs = sum(len(rows) for rows in aligned.values())
    margins = [m for rows in aligned.values() for _, _, m, _ in rows if m is not None]
    print(f"\nwrong verdicts: ddparity {wrong['ddparity']} of {runs}; dropout unaligned {wrong['unaligned']} of "
          f"{runs} (errors: no verdict); smallest margin of a bug caught: {min(margins):.3g}")
    if not have_transformers:
        print("(transformers not installed: GPT-2 and BERT left out)")
    # the alternative is wrong by design on models with dropout; on those without, it must
    # agree (else the benchmark's own switches broke, as they once did)
    broken = [name for name in cases if name in NO_DROPOUT
              for row in plain[name] if (row[1] == "pass") != (name in real_models.CLEAN)]
    if broken:
        print(f"FAILED: the alternatives gave a wrong verdict on models without dropout: {sorted(set(broken))}")
    return 1 if wrong["ddparity"] or broken else 0


if __name__ == "__main__":
    sys.exit(main())
