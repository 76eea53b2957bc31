"""The first simulated check of a process: the simulated ranks' host forked from the
controller (as before) vs started from the forkserver (now, warmed in the background while
the reference trains). Each variant in its own fresh process, three times; every check
timed must pass.

    python benchmarks/bench_simulated_start.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys

RUN = r'''
import sys, time
from ddparity import Case, check
from ddparity.fixtures.models import MLP, vectors
from ddparity.harness.world import pool as pools
from ddparity.harness.world.world import World

clean = sys.argv[1] == "forkserver"


class Started(World):
    def __init__(self, world_size, backend, **options):
        options["clean_start"] = clean and options.get("clean_start", False)
        super().__init__(world_size, backend, **options)


pools.World = Started
pool = pools.WorldPool()
case = Case(model=MLP, data=vectors, steps=2)
seconds = []
for _ in range(2):
    started = time.perf_counter()
    report = check(case, modes=("ddp",), world_sizes=(8,), backend="threaded", pool=pool)
    seconds.append(time.perf_counter() - started)
    assert report.ok and report.runs[0].simulated, report.render()
pool.close()
print(*seconds)
'''


def main() -> None:
    results = {}
    for how in ("fork", "forkserver"):
        runs = []
        for _ in range(3):
            done = subprocess.run([sys.executable, "-c", RUN, how], capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            runs.append([float(x) for x in done.stdout.split()[-2:]])
        results[how] = runs
        first, later = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{how:10s}  first check {first:5.2f} s   second check {later:5.2f} s")
    ratio = statistics.median(r[0] for r in results["forkserver"]) / statistics.median(r[0] for r in results["fork"])
    print(f"first check, forkserver / fork: {ratio:.2f}x")


if __name__ == "__main__":
    main()
