"""FSDP checking, measured: memory and time of ``ddparity check --modes single,fsdp`` next to
plain FSDP doing the same steps, DDP's memory per rank beside FSDP's, and the margins of
the sharded runs on models nobody here wrote.

1. For a large MLP (``ddparity.fixtures.large``, default ``mlp_100m``), fresh process trees
   one after the other: ``plain FSDP`` (``torch.multiprocessing.spawn`` of 2 gloo ranks,
   ``fully_shard`` on each layer then the root, AdamW, 3 steps), ``plain DDP`` (the same
   under DistributedDataParallel), ``single`` (one process, the whole batch), and
   ``ddparity`` (``python -m ddparity check <case> --modes single,fsdp --world-sizes 2``:
   the reference, its twin, FSDP at world size 2). Peak memory is the largest summed PSS of
   each tree (sampled every 0.2 s); ratios are against the plain pair (plain FSDP +
   single), the issue's yardstick (<= 1.5x memory, <= 2.5x time). Per rank: the plain
   trees' peak over their 2 ranks.
2. transformers GPT-2 and BERT (tiny configs, dropout on) sharded block by block, in fsdp
   and hsdp at world sizes 2 and 4: clean and with a summed loss; each run's status and its
   first divergence's error / tolerance.

Every timed run must exit as expected (else this exits 1).

    python benchmarks/bench_fsdp.py [--model mlp_100m] [--skip-real]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_large_model import _case, measured  # noqa: E402 - the same measuring as the DDP benchmark


def _rank(rank: int, name: str, steps: int, port: int, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from ddparity.harness.ranks.batches import shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        case = _case(name, steps)
        torch.manual_seed(case.seed)
        model = case.model()
        if kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            from ddparity.harness.ranks.modes.fsdp import default_wrapping

            default_wrapping(model, init_device_mesh("cpu", (2,)))
        else:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=case.lr)
        generator = torch.Generator().manual_seed(case.seed)
        for step in range(case.steps):
            inputs, targets = shard(case.data(step, generator), rank, 2)
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()


def plain(kind: str, name: str, steps: int) -> None:
    if kind == "single":
        from bench_large_model import _train

        _train(_case(name, steps), 0, 1, ddp=False)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(name, steps, port, kind), nprocs=2)


def memory(name: str, steps: int) -> bool:
    me = [sys.executable, os.path.abspath(__file__)]
    runs = {kind: measured([*me, "--plain", kind, "--model", name, "--steps", str(steps)])
            for kind in ("fsdp", "ddp", "single")}
    runs["ddparity"] = measured([sys.executable, "-m", "ddparity", "check", f"ddparity.fixtures.large:{name}",
                                 "--modes", "single,fsdp", "--world-sizes", "2", "--steps", str(steps)])
    failed = [k for k, r in runs.items() if r["rc"] != 0]
    if failed:
        print(f"FAILED: {', '.join(failed)} exited non-zero:\n" + "\n".join(runs[k]["tail"] for k in failed))
        return False
    gb = 2**30
    pair_pss = runs["fsdp"]["pss"] + runs["single"]["pss"]
    pair_s = runs["fsdp"]["seconds"] + runs["single"]["seconds"]
    print(f"{name}, {steps} steps, 2 ranks, gloo:")
    for kind in ("fsdp", "ddp", "single", "ddparity"):
        r = runs[kind]
        print(f"  {kind:9s} peak {r['pss'] / gb:5.2f} GB, {r['seconds']:6.1f} s")
    print(f"  memory per rank, plain: DDP {runs['ddp']['pss'] / 2 / gb:.2f} GB, FSDP {runs['fsdp']['pss'] / 2 / gb:.2f} "
          f"GB (FSDP / DDP {runs['fsdp']['pss'] / runs['ddp']['pss']:.2f}x)")
    print(f"  ddparity check vs plain FSDP + single: memory {runs['ddparity']['pss'] / pair_pss:.2f}x, "
          f"time {runs['ddparity']['seconds'] / pair_s:.2f}x")
    return True


def real_models() -> bool:
    from ddparity import check
    from ddparity.fixtures import sharded

    ok = True
    for name, bug in (("gpt2_clean", False), ("gpt2_summed", True), ("bert_clean", False), ("bert_summed", True)):
        report = check(getattr(sharded, name)(), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
        cells = []
        for run in report.runs:
            d = run.first_divergence
            cells.append(f"{run.mode} {run.world_size}: {run.status}"
                         + (f" (step {d.step}, x{d.max_abs / d.tolerance:.3g})" if d else ""))
            expected = "diverged" if bug else "pass"
            if run.status != expected or (bug and d is not None and d.step != 0):
                ok = False
        print(f"  {name:12s} " + "; ".join(cells))
    if not ok:
        print("FAILED: a clean model did not pass or a bug was not caught at step 0")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp_100m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plain", choices=("fsdp", "ddp", "single"))
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    if args.plain:
        plain(args.plain, args.model, args.steps)
        return 0
    ok = memory(args.model, args.steps)
    if not args.skip_real:
        print("transformers models, FSDP2 block by block (fsdp and hsdp, world sizes 2 and 4):")
        ok = real_models() and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
