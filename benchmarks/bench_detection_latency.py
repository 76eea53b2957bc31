"""How long after a fault its report is out: a rank that raises, segfaults or hangs at
step 1, at world sizes 2, 4 and 8 (gloo, warm worlds; hang timeout 5 s).

The faulty rank writes the time of the fault to a file just before it happens; the
latency is from then until ``check()`` has returned its report.

    python benchmarks/bench_detection_latency.py [--world-sizes 2,4,8] [--timeout 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time

from torch import nn

from ddparity import Case, check
from ddparity.fixtures.models import MLP, vectors
from ddparity.harness.world.pool import WorldPool


class FaultAtStep1(nn.Module):
    def __init__(self, how: str, stamp: str) -> None:
        super().__init__()
        self.mlp, self.calls, self.how, self.stamp = MLP(), 0, how, stamp

    def forward(self, x):  # noqa: ANN001, ANN201
        import torch.distributed as dist

        step, self.calls = self.calls, self.calls + 1
        if dist.get_world_size() > 1 and dist.get_rank() == 1 and step == 1:
            with open(self.stamp, "w") as fh:
                fh.write(repr(time.time()))
            if self.how == "raise":
                raise RuntimeError("injected")
            if self.how == "segfault":
                ctypes.string_at(0)
            time.sleep(3600)
        return self.mlp(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    pool = WorldPool()
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "fault-time")
        print(f"{'ws':>3}  {'fault':<9} {'verdict':<7} reported after the fault")
        wrong = 0
        for ws in (int(x) for x in args.world_sizes.split(",")):
            for how in ("raise", "segfault", "hang"):
                check(Case(model=MLP, data=vectors, steps=1), world_sizes=(ws,), pool=pool)  # warm world
                case = Case(model=lambda how=how: FaultAtStep1(how, stamp), data=vectors, steps=3)
                report = check(case, world_sizes=(ws,), timeout=args.timeout, pool=pool)
                ended = time.time()
                with open(stamp) as fh:
                    fault = float(fh.read())
                os.unlink(stamp)
                extra = f" (timeout {args.timeout:g} s + {ended - fault - args.timeout:.2f} s)" if how == "hang" else ""
                status = report.runs[-1].status
                wrong += status != ("hang" if how == "hang" else "crash")
                print(f"{ws:>3}  {how:<9} {status:<7} {ended - fault:.2f} s{extra}", flush=True)
    pool.close()
    if wrong:
        print(f"FAILED: {wrong} verdict(s) not as expected (a latency of a wrong verdict means nothing)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
