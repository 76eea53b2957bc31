"""Muon (torch.optim.Muon: bf16 Newton-Schulz products) under FSDP2 and HSDP, over seeds:
does the calibration pass every clean run and catch every planted bug?

Per variant, over seeds 0-7 of ``fixtures.calibration.muon_clean()``, ``muon_lr_scaled()``
and ``muon_lr_on_one_rank()`` (the last rank's rate doubled), and seeds 0-1 of
``muon_summed()``, in fsdp and hsdp at 2 and 4 ranks: each run's verdict, its largest error /
tolerance over every step, kind and tensor (the step-0 update's factor included, where it is
judged), and, for the rank-local rate, whether its first divergence names the last rank. Two variants, each in its
own process (the twin runs in forked ranks, which take the setting at their start):

* ``before``: the twin moves the optimizer's input by an ulp of bf16 only, every tensor is
  judged by its own tolerance (as ddparity shipped up to 55b0aed);
* ``after``: the twin also rounds its optimizer's products and norms as a sharded run does
  (``twin_optimizer.PRODUCT_ULPS``), and the update is judged as a whole by its factor
  (``tolerance.UPDATE_SHARE``).

Asserts that ``after`` passes every clean run and catches every bug, and that every run
finished (no error, hang or crash). Prints the worst clean margin and the least bug margin
of each variant, and their ratio.

    python benchmarks/muon_seeds.py            # both variants, ~3 minutes on 2 cores
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

SEEDS = range(8)
SUMMED_SEEDS = range(2)
MODES, WORLD_SIZES = ("fsdp", "hsdp"), (2, 4)


def variant(name: str) -> dict[str, list[tuple[int, str, int, str, float, bool]]]:
    """Every run of the sweep in this process, as (seed, mode, world size, status, largest
    error / tolerance, whether the first divergence is on the last rank), per case."""
    import ddparity.checks.tolerance as tolerance
    import ddparity.harness.ranks.modes.twin_optimizer as twin_optimizer
    import ddparity.verbs.checking as checking
    from ddparity import check
    from ddparity.distances import update_ratio
    from ddparity.fixtures import calibration

    if name == "before":
        twin_optimizer.PRODUCT_ULPS, tolerance.UPDATE_SHARE = 0.0, 0.0
    margins: dict[tuple[str, int], float] = {}
    judged = checking.divergences

    def measured(reference, runs, tol, until=None):  # type: ignore[no-untyped-def]
        worst = 0.0
        for step, entries in enumerate(reference.steps[:until]):
            for key in entries:
                bound = tol(step, *key)
                for run in runs:
                    if step < len(run.steps) and key in run.steps[step]:
                        error = run.steps[step][key]
                        worst = max(worst, error / bound if bound else (float("inf") if error else 0.0))
        for run in runs:  # each rank's own update, as judged
            ratio = update_ratio([run.moved]) if run.moved else None
            if tol.update and ratio is not None and until != 0:
                worst = max(worst, abs(ratio[0] - 1) / tol.update)
        margins[(runs[0].mode, runs[0].world_size)] = worst
        return judged(reference, runs, tol, until)

    checking.divergences = measured
    out: dict[str, list[tuple[int, str, int, str, float, bool]]] = {}
    for case_name, seeds in (("clean", SEEDS), ("lr_scaled", SEEDS), ("lr_on_one_rank", SEEDS),
                             ("summed", SUMMED_SEEDS)):
        rows = out.setdefault(case_name, [])
        for seed in seeds:
            margins.clear()
            case = dataclasses.replace(getattr(calibration, f"muon_{case_name}")(), seed=seed)
            report = check(case, modes=MODES, world_sizes=WORLD_SIZES)
            for run in report.runs:
                first = run.first_divergence
                rows.append((seed, run.mode, run.world_size, run.status,
                             margins.get((run.mode, run.world_size), float("nan")),
                             first is not None and first.rank == run.world_size - 1))
            print(f"{name} {case_name} seed {seed}: " + ", ".join(f"{r[1]} {r[2]} {r[3]} {r[4]:.3g}"
                                                                 for r in rows[-len(report.runs):]),
                  file=sys.stderr, flush=True)
    return out


def summary(rows: dict[str, list[tuple[int, str, int, str, float, bool]]]) -> dict[str, float | int]:
    clean, bugs = rows["clean"], rows["lr_scaled"] + rows["lr_on_one_rank"] + rows["summed"]
    return {"runs": len(clean) + len(bugs),
            "unfinished": sum(r[3] not in ("pass", "diverged", "desync") for r in clean + bugs),
            "false alarms": sum(r[3] != "pass" for r in clean),
            "missed bugs": sum(r[3] == "pass" for r in bugs),
            "worst clean": max(r[4] for r in clean),
            "least lr x W": min(r[4] for r in rows["lr_scaled"]),
            "least one rank": min(r[4] for r in rows["lr_on_one_rank"]),
            "on its rank": sum(r[5] for r in rows["lr_on_one_rank"]),
            "least summed": min(r[4] for r in rows["summed"])}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        print(json.dumps(variant(sys.argv[2])))
        return 0
    results = {}
    for name in ("before", "after"):
        done = subprocess.run([sys.executable, __file__, "--variant", name], stdout=subprocess.PIPE, text=True,
                              timeout=3600, check=True)
        results[name] = summary(json.loads(done.stdout))
    print(f"{'':8}" + "".join(f"{k:>15}" for k in results["after"]))
    for name, s in results.items():
        print(f"{name:8}" + "".join(f"{v:>15.3g}" if isinstance(v, float) else f"{v:>15}" for v in s.values()))
    before, after = results["before"], results["after"]
    print(f"worst clean margin, before / after: {before['worst clean'] / after['worst clean']:.3g}x; "
          f"least lr x W margin, after / before: {after['least lr x W'] / before['least lr x W']:.3g}x")
    assert before["unfinished"] == after["unfinished"] == 0, results
    assert after["false alarms"] == 0 and after["missed bugs"] == 0, results
    assert after["worst clean"] < 1 < after["least lr x W"] and after["least summed"] > 1, results
    assert after["least one rank"] > 1 and after["on its rank"] == len(SEEDS) * len(MODES) * len(WORLD_SIZES), results
    return 0


if __name__ == "__main__":
    sys.exit(main())
