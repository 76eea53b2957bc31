"""Memory and time of a check of a large model, next to plain DDP doing the same steps.

For each model (``ddparity.fixtures.large``: MLPs of 1-125 M parameters, GPT-2 small at
124 M), three fresh process trees, one after the other:

* ``plain DDP``: a script as a user writes it — ``torch.multiprocessing.spawn`` of 2 ranks,
  gloo, the model under DistributedDataParallel, AdamW, 3 steps of a global batch of 8;
* ``single``: the same steps on one process with the whole batch;
* ``ddparity``: ``python -m ddparity check <case> --world-sizes 1,2`` (modes single and
  ddp: the reference, its calibration twin, DDP at world sizes 1 and 2).

Peak memory is the largest summed PSS (proportional set size: shared pages split between
the processes that map them) of the whole process tree, sampled every 0.2 s with psutil;
time is the wall time of the tree. The ratios are against the plain pair (plain DDP + single),
the issue's yardstick: <= 1.5 x memory, <= 2.5 x time.

    python benchmarks/bench_large_model.py [--models mlp_10m,mlp_25m] [--steps 3,20]
    python benchmarks/bench_large_model.py --models gpt2_small      # needs transformers

The default models fit in a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

DEFAULT_MODELS = ("mlp_1m", "mlp_10m", "mlp_25m")
SAMPLE_S = 0.2


def tree_pss(root: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def measured(cmd: list[str], timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``cmd``; its wall seconds, exit code, peak summed PSS of its tree and last output."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_pss(root))
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    done.set()
    sampler.join()
    return {"seconds": time.perf_counter() - started, "rc": proc.returncode, "pss": peak[0], "tail": out[-2000:]}


# -- the plain scripts (run in their own process: --plain) ------------------------------------


def _case(name: str, steps: int) -> Any:
    from ddparity.fixtures import large

    factory = getattr(large, name)
    try:
        return factory(steps=steps)
    except TypeError:
        case = factory()
        case.steps = steps
        return case


def _train(case: Any, rank: int, world_size: int, ddp: bool) -> None:
    import torch

    from ddparity.harness.ranks.batches import shard

    torch.manual_seed(case.seed)
    model = case.model()
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=case.lr)
    generator = torch.Generator().manual_seed(case.seed)
    for step in range(case.steps):
        batch = shard(case.data(step, generator), rank, world_size)
        if case.train_step is not None:
            case.train_step(model, batch, optimizer, None)
            continue
        inputs, targets = batch
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def _ddp_rank(rank: int, name: str, steps: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _train(_case(name, steps), rank, 2, ddp=True)
    finally:
        dist.destroy_process_group()


def plain(kind: str, name: str, steps: int) -> None:
    if kind == "single":
        _train(_case(name, steps), 0, 1, ddp=False)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(name, steps, port), nprocs=2)


# -- the comparison ---------------------------------------------------------------------------


def params_of(name: str) -> int:
    case = _case(name, 1)
    return sum(p.numel() for p in case.model().parameters())


def bench(name: str, steps: int) -> dict[str, Any]:
    me = [sys.executable, os.path.abspath(__file__)]
    row: dict[str, Any] = {"model": name, "params": params_of(name), "steps": steps}
    row["plain_ddp"] = measured([*me, "--plain", "ddp", "--models", name, "--steps", str(steps)])
    row["single"] = measured([*me, "--plain", "single", "--models", name, "--steps", str(steps)])
    row["ddparity"] = measured([sys.executable, "-m", "ddparity", "check", f"ddparity.fixtures.large:{name}",
                                "--world-sizes", "1,2", "--steps", str(steps)])
    failed = [k for k in ("plain_ddp", "single", "ddparity") if row[k]["rc"] != 0]
    if failed:  # a ratio against a run that did not finish means nothing
        raise SystemExit(f"{name}: {', '.join(failed)} exited non-zero:\n" + "\n".join(row[k]["tail"] for k in failed))
    pair_pss = row["plain_ddp"]["pss"] + row["single"]["pss"]
    pair_s = row["plain_ddp"]["seconds"] + row["single"]["seconds"]
    row["memory_ratio"] = row["ddparity"]["pss"] / pair_pss
    row["time_ratio"] = row["ddparity"]["seconds"] / pair_s
    return row


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--steps", default="3", help="comma-separated: each model at each (3,20: memory that "
                                                     "does not grow with steps)")
    parser.add_argument("--plain", choices=("ddp", "single"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.plain:
        plain(args.plain, args.models, int(args.steps))
        return
    rows = []
    print("| model | params | steps | plain DDP ws 2 | single | ddparity check ws 1,2 | memory / pair | time / pair |")
    print("|---|---|---|---|---|---|---|---|")
    for name, steps in ((n, int(k)) for n in args.models.split(",") for k in args.steps.split(",")):
        row = bench(name, steps)
        rows.append(row)
        d, s, c = row["plain_ddp"], row["single"], row["ddparity"]
        print(f"| {name} | {row['params'] / 1e6:.1f} M | {steps} | {_gb(d['pss'])}, {d['seconds']:.1f} s | "
              f"{_gb(s['pss'])}, {s['seconds']:.1f} s | {_gb(c['pss'])}, {c['seconds']:.1f} s | "
              f"{row['memory_ratio']:.2f}x | {row['time_ratio']:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
