"""What ``profile``'s own timing costs the step it measures: its median DDP step against the
same training's step with nothing of ddparity's in it, side by side in one run.

The same model (an MLP of ``--params`` parameters, Adam, global batch 32 over 2 gloo ranks of
one intra-op thread each, DDP's default buckets) is trained two ways, alternating round by
round so that machine drift hits each alike:

* plain: ``torchrun --nproc-per-node 2`` of a DDP script that times its own steps (forward,
  backward, ``optimizer.step()``; the slowest rank's median after warm-up);
* profile: ``ddparity profile case.py:case --world-sizes 2``, its ``step_s`` (forward and
  backward as training runs them, each bucket timed by a wrapping comm hook, behind a barrier,
  then the optimizer step; the slowest rank's median).

A run counts only when it exited 0 and reported its steps (a failed run is reported, never
timed).

    python benchmarks/bench_profile_overhead.py [--params 6e6] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = '''
import torch
from torch import nn

WIDTH = {width}


def model():
    return nn.Sequential(nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 16))


def data(step, generator):
    return torch.randn(32, 256, generator=generator), torch.randn(32, 16, generator=generator)
'''
CASE = '''
from bench_model import data, model
from ddparity import Case


def case():
    return Case(model=model, data=data, loss="mse_loss", optimizer="adam", lr=1e-4, steps=3)
'''
PLAIN = '''
import json, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from bench_model import data, model

out, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
ddp = DDP(model())
optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4)
generator = torch.Generator().manual_seed(0)
times = []
for step in range(warmup + steps):
    x, y = data(step, generator)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    dist.barrier()
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    optimizer.step()
    times.append(time.perf_counter() - started)
slowest = torch.tensor(times[warmup:])
dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
if rank == 0:
    json.dump(slowest.tolist(), open(out, "w"))

'''


def _plain(folder: Path, steps: int, warmup: int) -> float:
    out = folder / "plain.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(folder)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(folder / "plain.py"), str(out), str(steps), str(warmup)], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0 or not out.exists():
        raise SystemExit(f"the plain script failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return statistics.median(json.loads(out.read_text()))


def _profiled(folder: Path, steps: int, warmup: int) -> float:
    out = folder / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(folder)}
    result = subprocess.run([sys.executable, "-m", "ddparity", "profile", "case.py:case", "--world-sizes", "2",
                             "--steps", str(steps), "--warmup", str(warmup), "--json", str(out)], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"ddparity profile failed ({result.returncode}):\n{result.stdout}{result.stderr[-3000:]}")
    [run] = json.loads(out.read_text())["runs"]
    if run["status"] != "ok":
        raise SystemExit(f"ddparity profile: {run['status']}: {run['reason']}")
    return run["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    width = int((-274 + math.sqrt(274**2 + 4 * args.params)) / 2)
    plain, profiled = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_model.py").write_text(MODEL.format(width=width))
        (folder / "case.py").write_text(CASE)
        (folder / "plain.py").write_text(PLAIN)
        for _ in range(args.rounds):
            plain.append(_plain(folder, args.steps, args.warmup))
            profiled.append(_profiled(folder, args.steps, args.warmup))
    print(f"MLP of {(width * width + 274 * width + 16) / 1e6:.1f} M parameters, Adam, batch 32 over 2 gloo ranks; "
          f"{args.steps} steps after {args.warmup}; {args.rounds} round(s), alternating")
    print(f"  plain DDP step   {' '.join(f'{t * 1e3:.1f}' for t in plain)} ms")
    print(f"  profile step_s   {' '.join(f'{t * 1e3:.1f}' for t in profiled)} ms")
    ratios = [p / q for p, q in zip(profiled, plain)]
    print(f"profile / plain: {' '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}; "
          f"goal <= 1.05)")


if __name__ == "__main__":
    main()
