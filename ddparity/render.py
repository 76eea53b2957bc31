"""The human report: a table of runs, then, for each failure, what and where and how to
reproduce it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddparity.report import Divergence, Report, RunResult


def _sci(x: float | None) -> str:
    return "inf" if x is None or x != x or x == float("inf") else f"{x:.3g}"


def _where(d: Divergence) -> str:
    return f"step {d.step}, {d.kind} {d.name!r}, rank {d.rank}"


def render_run_failure(run: RunResult) -> list[str]:
    head = f"{run.mode} world_size={run.world_size} ({run.backend}): {run.status.upper()}"
    lines = [head]
    if run.first_divergence is not None:
        d = run.first_divergence
        lines.append(f"  first divergence: {_where(d)}")
        lines.append(
            f"    max abs error {_sci(d.max_abs)}, max rel error {_sci(d.max_rel)}, "
            f"tolerance {_sci(d.tolerance)} [{run.tolerance}]"
        )
        if run.worst:
            lines.append("  worst offenders (error / tolerance):")
            width = max(len(w.name) for w in run.worst)
            for w in run.worst:
                lines.append(
                    f"    {w.kind:<6} {w.name:<{width}}  step {w.step}  rank {w.rank}  "
                    f"abs {_sci(w.max_abs)}  x{_sci(w.excess)}"
                )
    if run.crash:
        lines.append(f"  rank {run.crash['rank']} failed (exit code {run.crash.get('exitcode')}): {run.crash['error']}")
    if run.hang:
        lines.append(f"  suspect ranks: {run.hang['suspect_ranks']}")
        for rank, info in sorted(run.hang["ranks"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"  --- rank {rank} stack ---")
            lines.extend("    " + s for s in (info.get("stack") or "(none)").rstrip().splitlines())
    if run.reason:
        lines.extend("  " + s for s in run.reason.rstrip().splitlines())
    if run.repro:
        lines.append(f"  reproduce: {run.repro}")
    return lines


def render_report(report: Report) -> str:
    rows = [("mode", "world", "backend", "status", "seconds")]
    for r in report.runs:
        backend = r.backend + (" (simulated)" if r.simulated else "")
        rows.append((r.mode, str(r.world_size), backend, r.status, f"{r.seconds:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [f"ddparity check: {report.case}"]
    for i, row in enumerate(rows):
        out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    failures = [r for r in report.runs if not r.ok]
    for run in failures:
        out.append("")
        out.extend(render_run_failure(run))
    passed = sum(r.status == "pass" for r in report.runs)
    skipped = sum(r.status == "skipped" for r in report.runs)
    verdict = "OK" if report.ok else "FAILED"
    tail = f", {skipped} skipped" if skipped else ""
    out.append("")
    out.append(f"{verdict}: {passed} of {len(report.runs)} runs equivalent to the reference{tail}")
    return "\n".join(out)
