"""A bucket sweep in one ``profile`` run against the same arms profiled one run each.

The obvious alternative to ``ddparity profile --bucket-cap-mb 1,5,25,100`` is four runs of
``ddparity profile`` with one bucket cap each (each starting its own Python, its own rank
processes at every world size, its own reference state). Both ways time the same rows: an
MLP of about ``--params`` parameters with Adam, at world sizes ``--world-sizes``, ``--steps``
measured steps after 2 of warm-up. Every run must exit 0 with every row ``ok`` (a run that
fails is reported, never timed); rounds alternate the two ways.

    python benchmarks/bench_profile_sweep.py [--params 25e6] [--world-sizes 1,2,4] [--steps 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASE = '''
import torch
from torch import nn
from ddparity import Case

WIDTH = {width}


def model():
    return nn.Sequential(nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 16))


def data(step, generator):
    return torch.randn(32, 256, generator=generator), torch.randn(32, 16, generator=generator)


def case():
    return Case(model=model, data=data, loss="mse_loss", optimizer="adam", lr=1e-4, steps=3, name="bench: MLP + Adam")
'''
CAPS = (1, 5, 25, 100)


def _run(folder: Path, args: list[str], rows: int) -> float:
    out = folder / "out.json"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "ddparity", "profile", "case.py:case", *args, "--json", str(out)],
                            cwd=folder, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"ddparity profile {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    runs = json.loads(out.read_text())["runs"]
    bad = [(r.get("arm"), r["world_size"], r["status"]) for r in runs if r["status"] != "ok"]
    if len(runs) != rows or bad:
        raise SystemExit(f"ddparity profile {' '.join(args)}: {len(runs)} rows (expected {rows}), not ok: {bad}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    width = int((-(256 + 16 + 2) + math.sqrt((256 + 16 + 2) ** 2 + 4 * args.params)) / 2)  # w^2 + 274w = P
    sizes = args.world_sizes.split(",")
    common = ["--world-sizes", args.world_sizes, "--steps", str(args.steps), "--warmup", "2", "--timeout", "600"]
    one, separate = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "case.py").write_text(CASE.format(width=width))
        for _ in range(args.rounds):
            one.append(_run(folder, [*common, "--bucket-cap-mb", ",".join(map(str, CAPS))], len(CAPS) * len(sizes)))
            separate.append(sum(_run(folder, [*common, "--bucket-cap-mb", str(cap)], len(sizes)) for cap in CAPS))
    params = width * width + 274 * width + 16
    print(f"MLP of {params / 1e6:.1f} M parameters (width {width}), Adam; {len(CAPS)} bucket caps x world sizes "
          f"{args.world_sizes}, {args.steps} measured steps; {args.rounds} round(s)")
    for name, times in (("one sweep", one), ("four runs", separate)):
        print(f"  {name:<10} {' '.join(f'{t:.1f}' for t in times)} s")
    ratios = [a / b for a, b in zip(one, separate)]
    print(f"one sweep / four runs: {' '.join(f'{r:.2f}' for r in ratios)} (goal <= 0.5)")


if __name__ == "__main__":
    main()
