"""What the loss-scaling probe costs a failing check (a summed loss, and a mean loss
divided by the world size: the numbers fit both, the probe tells them apart), against the
same check without it (its causes then named as candidates). Same warm pool, alternated,
three rounds; every check timed must diverge with the cause expected. A passing check never
runs the probe (its cost there is nil by construction: tests/checks/test_loss_probe.py
proves no probe runs).

    python benchmarks/bench_loss_probe.py
"""

from __future__ import annotations

import statistics
import time

from ddparity import check
from ddparity.fixtures import bugs, real_models
from ddparity.harness.world.pool import WorldPool
from ddparity.verbs import check as check_module

ROUNDS = 3


def timed(case, pool, probed: bool, expected: str) -> float:
    real = check_module._probe
    if not probed:
        check_module._probe = lambda *args: None
    try:
        started = time.perf_counter()
        report = check(case, modes=("single", "ddp"), world_sizes=(2,), pool=pool)
        seconds = time.perf_counter() - started
    finally:
        check_module._probe = real
    [run] = [r for r in report.runs if r.mode == "ddp"]
    notes = " ".join(run.notes)
    assert run.status == "diverged", report.render()
    assert (expected if probed else "candidate causes") in notes, notes
    return seconds


def main() -> None:
    pool = WorldPool()
    cases = [("MLP, summed loss", bugs.summed_loss(), "a loss summed over the batch"),
             ("MLP, mean loss / W", bugs.loss_over_world_size(), "a mean loss divided by the world size"),
             ("GPT-2 tiny, summed loss", real_models.gpt2_summed(), "a loss summed over the batch")]
    print(f"{'case':26s} {'with probe s':>13s} {'without s':>10s} {'ratio':>6s} {'probe s':>8s}")
    for label, case, expected in cases:
        timed(case, pool, True, expected)  # warm the worlds and the probe's
        on, off = [], []
        for _ in range(ROUNDS):
            on.append(timed(case, pool, True, expected))
            off.append(timed(case, pool, False, expected))
        a, b = statistics.median(on), statistics.median(off)
        print(f"{label:26s} {a:13.2f} {b:10.2f} {a / b:6.2f} {a - b:8.2f}")
    pool.close()


if __name__ == "__main__":
    main()
