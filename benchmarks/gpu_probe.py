"""CUDA/nccl paths on a GPU machine: forkserver start, nccl collectives, DDP on CUDA.

Run on a machine with >= 1 GPU (ranks need one GPU each, so nccl worlds are as large as
the GPU count). Prints one JSON object with the figures.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ddparity import Case, World, check
from ddparity.fixtures import models


def cuda_task(ctx):
    import torch
    import torch.distributed as dist

    t = torch.full((1 << 20,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return {"device": ctx.device, "name": torch.cuda.get_device_name(), "sum": float(t[0]),
            "backend": dist.get_backend()}


def main() -> int:
    out: dict = {"torch": torch.__version__, "gpus": torch.cuda.device_count(),
                 "controller_cuda_initialized_before": torch.cuda.is_initialized()}
    gpus = out["gpus"]
    started = time.perf_counter()
    with World(gpus, backend="nccl") as world:
        out["nccl_world_cold_start_s"] = round(time.perf_counter() - started, 3)
        out["nccl_task"] = world.run(cuda_task)
        t = time.perf_counter()
        for _ in range(20):
            world.run(lambda ctx: None)
        out["nccl_trivial_task_ms"] = round((time.perf_counter() - t) / 20 * 1000, 3)
    out["controller_cuda_initialized_after"] = torch.cuda.is_initialized()
    for name, factory in models.DEMO_CASES.items():
        t = time.perf_counter()
        report = check(factory(), world_sizes=(gpus,), backend="nccl")
        out[f"check_{name}_nccl"] = {"ok": report.ok, "seconds": round(time.perf_counter() - t, 3),
                                     "statuses": [(r.mode, r.world_size, r.status) for r in report.runs]}
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        case = models.mlp_sgd()
        case.dtype = dtype
        report = check(case, world_sizes=(gpus,), backend="nccl")
        out[f"check_mlp_{dtype}"] = [(r.mode, r.world_size, r.status, r.tolerance) for r in report.runs]
    big = Case(model=lambda: models.MLP((512, 2048, 2048, 512, 10)), data=lambda s, g: models.vectors(
        s, g, features=512, classes=10, batch=64), optimizer="adam", lr=1e-3, steps=3)
    t = time.perf_counter()
    report = check(big, world_sizes=(gpus,), backend="nccl")
    out["check_6M_param_mlp_nccl"] = {"ok": report.ok, "seconds": round(time.perf_counter() - t, 3),
                                      "render": report.render()}
    print(json.dumps(out, indent=2, default=str))
    return 0 if all(v["ok"] for k, v in out.items() if k.startswith("check_") and isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
