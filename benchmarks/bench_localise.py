"""What finding the first differing module costs a failing check, against the same check
without it, and against the plain training it re-runs (the goal: at most 2x). Same warm
pool, alternated, three rounds; every check timed must diverge, with a module finding when
localised and none when not. A passing check never re-runs anything (its cost there is nil
by construction: tests/checks/test_localise.py proves the locator is never called).

The localisation re-runs the first differing step (step 0 here) three times: the reference
on one device, the same batch reversed (its rounding noise), and the failing run's ranks,
each from the initial state with a hook on every module (the ranks beside the reference); where a module differs in forward
(BatchNorm on shards), twice more (the reference and the ranks, that call's aten ops
recorded). Its baseline is the same three trainings without hooks: "plain re-run" (one
device twice, then the world of the run).

    python benchmarks/bench_localise.py
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch.nn.functional as F

from ddparity import check
from ddparity.fixtures import large, real_models
from ddparity.harness.ranks.modes.single import SingleMode
from ddparity.harness.ranks.rank import released
from ddparity.harness.ranks.tasks import replica_mode
from ddparity.harness.ranks.training import initial_state, train
from ddparity.harness.world.pool import WorldPool
from ddparity.verbs import check as check_module

ROUNDS = 3


def summed(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def plain_single(ctx, case, steps):
    """The reference's share of the re-run, without hooks: one device, twice."""
    state = initial_state(case)
    for _ in range(2):
        train(case, state, ctx.device, SingleMode(steps, watch_draws=False))
        released()


def plain_replica(ctx, case, steps):
    """The run's share, without hooks: this rank, in DDP."""
    train(case, initial_state(case), ctx.device, replica_mode(ctx, case, "ddp", 0, steps))
    released()


def timed_check(case, pool, localised: bool) -> float:
    real = check_module._locate
    if not localised:
        check_module._locate = lambda *args: "off for the benchmark"
    try:
        started = time.perf_counter()
        report = check(case, modes=("single", "ddp"), world_sizes=(2,), pool=pool)
        seconds = time.perf_counter() - started
    finally:
        check_module._locate = real
    [run] = [r for r in report.runs if r.mode == "ddp"]
    assert run.status == "diverged", report.render()
    module = run.first_divergence.module
    assert (module is not None and module.found) if localised else module is None, report.render()
    return seconds


def timed_plain(case, pool) -> float:
    started = time.perf_counter()
    pool.get(1, "gloo", role="reference").run(plain_single, case, 1, timeout=600)
    pool.get(2, "gloo").run(plain_replica, case, 1, timeout=600)
    return time.perf_counter() - started


def main() -> None:
    pool = WorldPool()
    cases = [("MLP 25 M, summed loss", dataclasses.replace(large.mlp_case(25), loss=summed)),
             ("GPT-2 tiny, summed loss", real_models.gpt2_summed()),
             ("ResNet-style, BN on shards", real_models.resnet_bn_on_shards())]
    print(f"{'case':26s} {'check s':>8s} {'without s':>10s} {'extra s':>8s} {'ratio':>6s} {'plain re-run s':>15s} "
          f"{'extra / plain':>14s}")
    for label, case in cases:
        timed_check(case, pool, True)  # warm the worlds
        on, off, plain = [], [], []
        for _ in range(ROUNDS):
            on.append(timed_check(case, pool, True))
            off.append(timed_check(case, pool, False))
            plain.append(timed_plain(case, pool))
        a, b, p = statistics.median(on), statistics.median(off), statistics.median(plain)
        print(f"{label:26s} {a:8.2f} {b:10.2f} {a - b:8.2f} {a / b:6.2f} {p:15.2f} {(a - b) / p:14.2f}", flush=True)
    pool.close()


if __name__ == "__main__":
    main()
