"""The cost of a compiled check, measured against an eager one, in one process and pool:
``check(case, modes=("single", "ddp"), world_sizes=(2,))`` eager, then with
``compile="aot_eager"`` and ``compile="inductor"``, each twice in a row (the first in a
fresh process: Dynamo and inductor's caches cold; the second in the same warm worlds, with
inductor's on-disk cache warm). Per run: the check's wall time, its ratio to the eager
check's, and the seconds the compiled ddp run spent compiling (rank 0, from the report's
JSON ``compile.seconds``), apart from the steps.

Cases: a small MLP of its own class (``ddparity.fixtures.compiled:wide``), ResNet basic
blocks (BatchNorm frozen) and, with transformers installed, GPT-2 tiny (dropout off).
Every timed check must pass (else this exits 1).

    python benchmarks/bench_compile.py [--cases wide,resnet,gpt2] [--backends aot_eager,inductor]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time


def _cases(names: list[str]) -> dict:
    from ddparity.fixtures import compiled, real_models

    table = {"wide": compiled.wide, "resnet": real_models.resnet_frozen_bn, "gpt2": real_models.gpt2_compiled_clean}
    if importlib.util.find_spec("transformers") is None:
        table.pop("gpt2")
    return {n: table[n] for n in names if n in table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="wide,resnet,gpt2")
    parser.add_argument("--backends", default="aot_eager,inductor")
    args = parser.parse_args()
    from ddparity import check
    from ddparity.harness.world.pool import default_pool

    failed = False
    rows = [("case", "run", "check s", "x eager", "compile s (ddp, rank 0)")]
    try:
        for name, factory in _cases(args.cases.split(",")).items():
            eager_s = None
            for backend in [None, *args.backends.split(",")]:
                for attempt in ("cold", "warm"):
                    started = time.perf_counter()
                    report = check(factory(), modes=("single", "ddp"), world_sizes=(2,), compile=backend)
                    took = time.perf_counter() - started
                    if not report.ok:
                        print(report.render(), file=sys.stderr)
                        failed = True
                    label = f"{backend or 'eager'} ({attempt})"
                    if backend is None and attempt == "warm":
                        eager_s = took
                    compiled = [r.compile for r in report.runs if r.mode == "ddp" and r.compile]
                    seconds = f"{compiled[0]['seconds']:.2f}" if compiled and "seconds" in compiled[0] else "-"
                    rows.append((name, label, f"{took:.2f}", "" if eager_s is None else f"{took / eager_s:.2f}",
                                 seconds))
                    print(" | ".join(rows[-1]), flush=True)
    finally:
        default_pool().close()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print("\nx eager: against the warm eager check of the same case (the cold eager one starts the pool)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
