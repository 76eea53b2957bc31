"""The catalogue sweep's margins: every torch.nn layer of ddparity/fixtures/catalogue.py,
clean and with its planted twin (a summed loss), in modes single, dp and ddp at world sizes
1, 2, 4 and simulated 16, in fp32 and bf16. Writes docs/catalogue.md: for every twin, the
error / tolerance of its first divergence at each DDP world size; for every clean run, its
status. Exits 1 if any run's verdict is not the expected one (tests/catalogue holds the
same expectations).

    python benchmarks/catalogue_sweep.py [--out docs/catalogue.md]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
import warnings

import torch

from ddparity import check
from ddparity.fixtures import catalogue
from ddparity.harness.world.pool import WorldPool

SIZES = (1, 2, 4, 16)
UNALIGNED = {"RReLU"}  # FractionalMaxPool draws its regions per sample with torch.rand: aligned
CPU_ERRORS = {"SyncBatchNorm"}


def expected(name: str, summed: bool, mode: str, ws: int) -> str:
    if name in UNALIGNED or (name in CPU_ERRORS and not torch.cuda.is_available()):
        return "error"
    return "diverged" if summed and mode == "ddp" and ws > 1 else "pass"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/catalogue.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    members = catalogue.members()
    pool = WorldPool()
    rows, wrong, runs, smallest = [], [], 0, (float("inf"), "")
    started = time.perf_counter()
    try:
        for m in members:
            for dtype in (torch.float32, torch.bfloat16):
                margins, clean = [], "pass"
                for summed in (False, True):
                    report = check(catalogue.case(m.name, dtype, summed), modes=("single", "dp", "ddp"),
                                   world_sizes=SIZES, backend="auto", pool=pool)
                    for run in report.runs:
                        runs += 1
                        want = expected(m.name, summed, run.mode, run.world_size)
                        if run.status != want:
                            wrong.append(f"{m.name} {dtype} {'summed' if summed else 'clean'} {run.mode} "
                                         f"W={run.world_size}: {run.status}, expected {want}")
                        if not summed and run.status != "pass":
                            clean = run.status
                        if summed and run.mode == "ddp" and run.world_size > 1:
                            d = run.first_divergence
                            ratio = d.max_abs / d.tolerance if d is not None and d.tolerance else None
                            margins.append(f"{ratio:.3g}" if ratio is not None else run.status)
                            if ratio is not None and ratio < smallest[0]:
                                smallest = (ratio, f"nn.{m.name} {str(dtype)[6:]} W={run.world_size}")
                rows.append(f"| nn.{m.name} | {', '.join(m.state)} | {str(dtype)[6:]} | {clean} | "
                            f"{' | '.join(margins)} |")
                print(rows[-1], flush=True)
    finally:
        pool.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = [
        "# The catalogue sweep: every torch.nn layer, clean and with a summed loss",
        "",
        f"Measured {datetime.date.today()} at commit {commit}, torch {torch.__version__}, CPU/gloo, by "
        f"`python benchmarks/catalogue_sweep.py` ({time.perf_counter() - started:.0f} s): "
        f"{len(catalogue.module_classes())} classes in torch.nn, {len(members)} hold parameters or buffers or "
        f"draw random numbers; {len(rows) * 2} checks, {runs} runs (single, dp and ddp at world sizes "
        f"{', '.join(map(str, SIZES))}; 16 simulated), {len(wrong)} verdicts not as expected.",
        "",
        "Each layer sits in a probe (a linear map to its input, the layer, a linear head), trained "
        "with AdamW for 2 steps. *clean*: the status of every run of the clean model (`error` where "
        "the layer draws random numbers inside torch's kernels, named in the error, or runs on GPUs only). "
        "The last columns: the summed-loss twin's first divergence in DDP, error / tolerance, at each "
        "world size (dp computes the loss on the whole batch, so a summed loss is no bug there: it passes). "
        f"Smallest margin: {smallest[0]:.3g} ({smallest[1]}).",
        "",
        "| layer | holds | dtype | clean | twin W=2 | twin W=4 | twin W=16 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(head + rows) + "\n")
        if wrong:
            f.write("\nNot as expected:\n\n" + "\n".join(f"- {w}" for w in wrong) + "\n")
    print("\n".join(wrong) or "every verdict as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
