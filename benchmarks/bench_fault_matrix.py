"""The fault matrix: every fault of ``ddparity.fixtures.faults`` and every bug of
``ddparity.fixtures.bugs`` (and their clean twins), at real world sizes 2, 4 and 8 (gloo,
forced: 8 ranks on this machine's cores) and at simulated world size 8 (threads): the
verdict, whether it is the expected one, the rank(s) named, seconds, and processes left
behind (children of this process that are neither the pool's live ranks nor
multiprocessing's helpers).

    python benchmarks/bench_fault_matrix.py [--timeout 5] [--configs 2,4,8,8t]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from ddparity import Case, check
from ddparity.fixtures import bugs
from ddparity.fixtures.faults import FAULT_RANK, FAULTS, reported_ranks
from ddparity.harness.world.pool import WorldPool

HELPERS = ("forkserver", "resource_tracker", "ddparity-janitor")


@dataclass(frozen=True)
class Row:
    name: str
    make: Callable[[], Case]
    status: str
    ranks: Callable[[int], list[int] | None]  # None: not checked


ROWS = [Row(f.name, f.case, f.status, f.suspects) for f in FAULTS.values()] + [
    Row("summed_loss", bugs.summed_loss, "diverged", lambda ws: None),
    Row("batchnorm_on_shards", bugs.batchnorm_on_shards, "diverged", lambda ws: None),
    Row("clean_regression", bugs.clean_regression, "pass", lambda ws: []),
    Row("clean_batchnorm_eval", bugs.clean_batchnorm_eval, "pass", lambda ws: []),
]


def strays(pool: WorldPool) -> int:
    me = psutil.Process()
    n = 0
    for child in me.children(recursive=True):
        try:
            if child.pid in pool.pids or child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(h in " ".join(child.cmdline()) for h in HELPERS):
                continue
            n += 1
        except psutil.Error:
            pass
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--configs", default="2,4,8,8t", help="world sizes; a trailing t: simulated (threads)")
    args = parser.parse_args()
    configs = [(int(c.rstrip("t")), "threaded" if c.endswith("t") else "gloo") for c in args.configs.split(",")]
    pool = WorldPool()
    print(f"{'case':22} {'world':>6} {'expected':9} {'verdict':9} {'ok':3} {'named':10} {'seconds':>7} left")
    wrong, rows = 0, 0
    try:
        for ws, backend in configs:
            for row in ROWS:
                started = time.perf_counter()
                report = check(row.make(), modes=("single", "ddp"), world_sizes=(ws,), backend=backend,
                               timeout=args.timeout, pool=pool)
                seconds = time.perf_counter() - started
                run = report.runs[-1]
                named = reported_ranks(run)
                expected_ranks = row.ranks(ws)
                left = strays(pool)
                ok = run.status == row.status and (expected_ranks is None or named == expected_ranks) and not left
                wrong += not ok
                rows += 1
                label = f"{ws}{' sim' if backend == 'threaded' else ''}"
                print(f"{row.name:22} {label:>6} {row.status:9} {run.status:9} {'yes' if ok else 'NO':3} "
                      f"{named!s:10} {seconds:7.2f} {left}", flush=True)
    finally:
        pool.close()
    print(f"\n{rows - wrong} of {rows} as expected (fault rank {FAULT_RANK}, timeout {args.timeout:g} s)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
