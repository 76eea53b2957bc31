"""The human report: a table of runs, then, for each failure, what and where and how to
reproduce it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddparity.report import Divergence, Report, RunResult


def _sci(x: float | None) -> str:
    return "inf" if x is None or x != x or x == float("inf") else f"{x:.3g}"


def _where(d: Divergence) -> str:
    return f"step {d.step}, {d.kind} {d.name!r}, rank {d.rank}"


def _indent(text: str, pad: str = "    ") -> list[str]:
    return [pad + line for line in (text or "(none)").rstrip().splitlines()]


def _position(rank: str, info: dict) -> str:
    step = info.get("step", -1)
    where = f"step {step}, {info.get('phase') or 'no phase'}" if step is not None and step >= 0 else (
        info.get("phase") or "before the first step")
    if info.get("finished"):
        where = "finished the task"
    return f"    rank {rank}: {where}; collective {info.get('collective')}"


def _render_desync(desync: dict) -> list[str]:
    lines = [f"  desync at step {desync['step']}: ranks {desync['ranks']} differ from the others"]
    coll = desync.get("collective")
    if coll:
        lines.append(f"    collective #{coll['seq']} of group {coll['group']!r} is not the same on every rank:")
        for rank, info in sorted(coll["ranks"].items(), key=lambda kv: int(kv[0])):
            via = f" [{info['via']}]" if info.get("via") else ""
            mark = "  <-" if int(rank) in desync["ranks"] else ""
            lines.append(f"      rank {rank}: {info['collective']}{via}  at {info['site']}{mark}")
    else:
        lines.append(f"    {desync['what']}")
        if desync.get("agreeing_ranks"):
            lines.append(f"    the other ranks ({desync['agreeing_ranks']}) agree")
    for rank, stack in sorted((desync.get("stacks") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"  --- rank {rank} stack when stopped ---")
        lines.extend(_indent(stack))
    return lines


def _render_hang(hang: dict) -> list[str]:
    lines = [f"  suspect ranks: {hang['suspect_ranks']}"]
    ranks = sorted(hang["ranks"].items(), key=lambda kv: int(kv[0]))
    lines.extend(_position(rank, info) for rank, info in ranks)
    for rank, info in ranks:
        if not info.get("finished"):
            lines.append(f"  --- rank {rank} stack ---")
            lines.extend(_indent(info.get("stack") or ""))
    return lines


def _render_crash(crash: dict) -> list[str]:
    if crash.get("exitcode") is None:
        lines = [f"  rank {crash['rank']} raised: {crash['error']}"]
    else:
        lines = [f"  {crash['error']}"]
    if crash.get("traceback"):
        lines.extend(_indent(crash["traceback"]))
    if crash.get("output"):
        lines.append(f"  --- rank {crash['rank']} output ---")
        lines.extend(_indent(crash["output"]))
    others = sorted((crash.get("ranks") or {}).items(), key=lambda kv: int(kv[0]))
    others = [(r, i) for r, i in others if int(r) != crash["rank"]]
    if others:
        lines.append("  the other ranks at that moment:")
        lines.extend(_position(rank, info) for rank, info in others)
        for rank, info in others:
            if info.get("stack") and not info.get("finished"):
                lines.append(f"  --- rank {rank} stack ---")
                lines.extend(_indent(info["stack"]))
    return lines


def table(rows: Sequence[Sequence[str]], rule: bool = True) -> list[str]:
    """Rows as aligned columns, the first a header (underlined with ``rule``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for i, row in enumerate(rows):
        out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0 and rule:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def render_notes(run: RunResult) -> list[str]:
    """Notes that do not fail a run: late ranks, DataParallel pitfalls."""
    return [f"  {run.mode} world_size={run.world_size}: {note}" for note in run.notes] + [
        f"  straggler: rank {s['rank']} arrived last at {s['arrived_last']} of {s['collectives']} collectives, "
        f"{s['mean_late_s']:.3g} s after the first rank on average"
        for s in run.stragglers
    ]


def failure_detail(run: RunResult) -> str:
    """A failed run's evidence without its head line, for reports with their own heading
    (``profile``, ``health``)."""
    return "\n".join(render_run_failure(run)[1:]).strip() or (run.reason or run.status)


def render_run_failure(run: RunResult) -> list[str]:
    head = f"{run.mode} world_size={run.world_size} ({run.backend}): {run.status.upper()}"
    lines = [head]
    if run.desync:
        lines.extend(_render_desync(run.desync))
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
        lines.extend(_render_crash(run.crash))
    elif run.hang:
        lines.append(f"  {(run.reason or 'hang').splitlines()[0]}")
        lines.extend(_render_hang(run.hang))
    elif run.reason and not run.desync:
        lines.extend("  " + s for s in run.reason.rstrip().splitlines())
    lines.extend(render_notes(run))
    if run.repro:
        lines.append(f"  reproduce: {run.repro}")
    return lines


def render_report(report: Report) -> str:
    rows = [("mode", "world", "backend", "status", "seconds")]
    for r in report.runs:
        backend = r.backend + (" (simulated)" if r.simulated else "")
        rows.append((r.mode, str(r.world_size), backend, r.status, f"{r.seconds:.2f}"))
    out = [f"ddparity check: {report.case}", *table(rows)]
    failures = [r for r in report.runs if not r.ok]
    for run in failures:
        out.append("")
        out.extend(render_run_failure(run))
    notes = [line for r in report.runs if r.ok for line in render_notes(r)]
    if notes:
        out.append("")
        out.extend(line.strip() for line in notes)
    passed = sum(r.status == "pass" for r in report.runs)
    skipped = sum(r.status == "skipped" for r in report.runs)
    verdict = "OK" if report.ok else "FAILED"
    tail = f", {skipped} skipped" if skipped else ""
    out.append("")
    out.append(f"{verdict}: {passed} of {len(report.runs)} runs equivalent to the reference{tail}")
    return "\n".join(out)
