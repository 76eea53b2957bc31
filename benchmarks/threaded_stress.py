"""A stress loop for the threaded backend (simulated ranks as threads in one process):
fresh processes, each checking clean cases at a simulated world size, counting any run
that does not pass — a SIGSEGV of the host process among them (seen twice in CI runs
before the build barrier and the leaner forward, never reproduced locally since).

Each iteration is a new Python process (a new world, torch's first-use paths again), as
a CI worker meets them. Exits 1 if any run did not pass.

    python benchmarks/threaded_stress.py [--iterations 60] [--world-size 8]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time

ONE = """
import sys
from ddparity import check
from ddparity.fixtures import dropout, models, real_models

cases = [models.mlp_sgd(), models.transformer_adamw(), dropout.checkpointed()]
try:
    cases.append(real_models.bert_clean())
except ImportError:
    pass
bad = 0
for case in cases:
    report = check(case, modes=("ddp",), world_sizes=({ws},), backend="threaded")
    for run in report.runs:
        if run.status != "pass":
            bad += 1
            print(case.name, run.status, (run.reason or "")[:300] or run.crash, flush=True)
sys.exit(1 if bad else 0)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=8)
    args = parser.parse_args()
    outcomes: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for i in range(args.iterations):
        run = subprocess.run([sys.executable, "-c", ONE.format(ws=args.world_size)], capture_output=True, text=True,
                             timeout=600)
        outcome = "passed" if run.returncode == 0 else f"exit {run.returncode}"
        outcomes[outcome] += 1
        if run.returncode:
            print(f"iteration {i}: {outcome}\n{run.stdout[-2000:]}{run.stderr[-2000:]}", flush=True)
    seconds = time.perf_counter() - started
    print(f"{args.iterations} fresh processes x 4 clean cases at simulated {args.world_size} in {seconds:.0f} s: "
          + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())))
    return 0 if outcomes["passed"] == args.iterations else 1


if __name__ == "__main__":
    sys.exit(main())
