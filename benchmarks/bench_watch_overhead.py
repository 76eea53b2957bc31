"""What ``ddparity watch`` costs a training script's step, side by side in one run with
the plain script and with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (PyTorch's own collective
checking).

One DDP training script (an MLP of 3.7 M parameters, Adam, batch 64 over 2 gloo ranks of
one intra-op thread each, a loss all-reduce every step as scripts log it) is launched
with torchrun three ways, alternating round by round so that machine drift hits each
alike:

* plain: ``torchrun --nproc-per-node 2 train.py``;
* watch: ``torchrun --nproc-per-node 2 -m ddparity watch train.py`` (every collective
  recorded, heartbeats, the main thread sampled, parameters fingerprinted after every
  optimizer step and compared across the ranks);
* detail: ``TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc-per-node 2 train.py``.

The script times its own steps (after warm-up) and writes them; a run counts only when
every rank wrote its times and torchrun exited 0 (a run that failed is reported as such,
with its exit code, never timed).

    python benchmarks/bench_watch_overhead.py [--rounds 5] [--steps 80] [--width 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SCRIPT = '''
import json, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

out, steps, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, width), nn.ReLU(), nn.Linear(width, 1024), nn.ReLU(), nn.Linear(1024, 512)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(rank)
warmup = 5
for step in range(steps + warmup):
    if step == warmup:
        dist.barrier()
        started, main_cpu, all_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    x, y = torch.randn(64 // world, 512, generator=gen), torch.randn(64 // world, 512, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
elapsed = time.perf_counter() - started
main_cpu, all_cpu = time.thread_time() - main_cpu, time.process_time() - all_cpu
with open(f"{out}.{rank}", "w") as f:
    json.dump({"ms_per_step": 1e3 * elapsed / steps, "main_cpu_ms": 1e3 * main_cpu / steps,
               "process_cpu_ms": 1e3 * all_cpu / steps}, f)
dist.destroy_process_group()
'''

VARIANTS = ("plain", "watch", "detail")


def launch(variant: str, folder: str, steps: int, width: int, run: int) -> tuple[dict | None, str]:
    """One launch: its ms a step (the slower rank's wall time; the mean of the ranks' main
    thread and whole-process CPU time), or None and why it did not count."""
    script = os.path.join(folder, "train.py")
    out = os.path.join(folder, f"{variant}-{run}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if variant == "detail":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    program = ["-m", "ddparity", "watch", "--timeout", "120", script] if variant == "watch" else [script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *program,
           out, str(steps), str(width)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    files = [f"{out}.{r}" for r in range(2)]
    if done.returncode != 0 or not all(os.path.exists(f) for f in files):
        died = sorted(set(re.findall(r"exitcode\s*:\s*-?\d+ \(pid: \d+\)\s*\((SIG\w+)\)", done.stderr)))
        aborted = "terminate called" in done.stderr
        why = (f"a worker died by {', '.join(died)}" if died else f"torchrun exited {done.returncode}") + (
            " (std::terminate)" if aborted else "")
        return None, why
    got = [json.load(open(f)) for f in files]
    return {"wall": max(g["ms_per_step"] for g in got),
            "main_cpu": statistics.mean(g["main_cpu_ms"] for g in got),
            "process_cpu": statistics.mean(g["process_cpu_ms"] for g in got)}, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    times: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    rounds: list[dict[str, dict]] = []
    failed: dict[str, list[str]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as folder:
        with open(os.path.join(folder, "train.py"), "w") as f:
            f.write(SCRIPT)
        for run in range(args.rounds):
            rounds.append({})
            for variant in VARIANTS if run % 2 == 0 else reversed(VARIANTS):
                ms, why = launch(variant, folder, args.steps, args.width, run)
                if ms is None:
                    failed[variant].append(why)
                else:
                    times[variant].append(ms)
                    rounds[-1][variant] = ms
                shown = (f"{ms['wall']:.2f} ms/step (CPU: main thread {ms['main_cpu']:.2f}, process "
                         f"{ms['process_cpu']:.2f} ms)" if ms is not None else f"FAILED ({why})")
                print(f"round {run} {variant:6s} {shown}", flush=True)
    assert times["plain"] and times["watch"], "the plain and watched runs must both succeed to compare them"
    print(f"\nper step, median of {args.rounds} launches ({args.steps} steps each, 2 gloo ranks, width {args.width}):")
    for measure, what in (("wall", "step time (the slower rank)"), ("main_cpu", "CPU of the training thread"),
                          ("process_cpu", "CPU of the whole rank process (ddparity's threads too)")):
        plain = statistics.median(t[measure] for t in times["plain"])
        print(f" {what}:")
        for variant in VARIANTS:
            if times[variant]:
                values = [t[measure] for t in times[variant]]
                med = statistics.median(values)
                print(f"  {variant:6s} {med:8.2f} ms  x{med / plain:.3f} of plain  (range {min(values):.2f}-"
                      f"{max(values):.2f}; {len(values)} ok, {len(failed[variant])} failed)")
            elif measure == "wall":
                print(f"  {variant:6s} every run failed: {failed[variant][0]}")
        for variant in VARIANTS[1:]:
            paired = [r[variant][measure] / r["plain"][measure] for r in rounds if variant in r and "plain" in r]
            if paired:
                print(f"  {variant} / plain within a round: median x{statistics.median(paired):.3f} "
                      f"({' '.join(f'{x:.3f}' for x in paired)})")

if __name__ == "__main__":
    main()
