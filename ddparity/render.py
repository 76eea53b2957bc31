"""The human reports: ``check`` (a table of runs, then, for each failure, what and where
and how to reproduce it), ``profile`` (figures per world size) and ``health`` (checks,
bandwidth, ranks). Every report's text is written here, from the verdicts of
:mod:`ddparity.checks`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ddparity.run_kinds import kind

if TYPE_CHECKING:
    from ddparity.checks.comm import WorldProfile
    from ddparity.checks.health import Bandwidth, Check, PairBandwidth
    from ddparity.measurements import RankHealth
    from ddparity.verdicts import Crash, Desync, Failure, Hang, ModuleFinding, RankPlace, RunResult


SAID_ONCE = 100
STEPS_OWN = " (the step's own)"
"""Said after a collective the training step issued itself, in a profile's per-op lines."""
MESSAGE_LINES = 8
"""An error message longer than this many lines is cut to its first ones in the text report
(torch's "Could not run ... with arguments from the 'SparseCPU' backend" lists every dispatch
key, ~50 lines); the JSON report keeps it whole."""
"""A failure's ending (a traceback, a hang's stacks, or a reason longer than this many
characters) is printed once in a report; later runs that ended the same way point to it."""


def _sci(x: float | None) -> str:
    return "inf" if x is None or x != x or x == float("inf") else f"{x:.3g}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _differs(desync: Desync) -> str:
    """Who differs from whom: the minority against the rest, or every rank against each other."""
    if desync.collective is not None:
        others = sorted(set(desync.collective.ranks) - set(desync.ranks))
    else:
        others = sorted(desync.agreeing_ranks or [])
    if not others and len(desync.ranks) == 2:
        return (f"ranks {desync.ranks[0]} and {desync.ranks[1]} disagree (nothing recorded shows which of the two "
                f"is wrong)")
    if not others:
        return f"ranks {desync.ranks} all differ from one another"
    verb = "differs" if len(desync.ranks) == 1 else "differ"
    return f"{_ranks(desync.ranks)} {verb} from {_ranks(others)}"


def _cut_message(lines: list[str], start: int) -> list[str]:
    """``lines`` with the message that begins at ``start`` cut to :data:`MESSAGE_LINES`."""
    if len(lines) - start <= MESSAGE_LINES:
        return lines
    keep = start + MESSAGE_LINES - 2
    return [*lines[:keep], f"[... {len(lines) - keep} more lines of this message: the JSON report (--json PATH) "
                           f"has them all]"]


def _indent(text: str, pad: str = "    ") -> list[str]:
    return [pad + line for line in (text or "(none)").rstrip().splitlines()]


def _position(rank: int, place: RankPlace, error: str = "") -> str:
    step = place.step
    where = f"step {step}, {place.phase or 'no phase'}" if step >= 0 else (place.phase or "before the first step")
    if place.raised:
        where += f"; raised {'the same error' if place.raised == error else place.raised}"
    elif place.finished:
        where = "finished the task"
    return f"    rank {rank}: {where}; collective {place.collective}"


def _render_desync(desync: Desync) -> list[str]:
    lines = [f"  desync at step {desync.step}: {_differs(desync)}"]
    slot = desync.collective
    if slot is not None:
        lines.append(f"    collective #{slot.seq} of group {slot.group!r} is not the same on every rank:")
        for rank, issued in sorted(slot.ranks.items()):
            via = f" [{issued.via}]" if issued.via else ""
            mark = "  <-" if rank in desync.ranks else ""
            lines.append(f"      rank {rank}: {issued.collective}{via}  at {issued.site}{mark}")
    else:
        lines.append(f"    {desync.what}")
        if desync.agreeing_ranks:
            lines.append(f"    the other ranks ({desync.agreeing_ranks}) agree")
    for rank, stack in sorted((desync.stacks or {}).items()):
        lines.append(f"  --- rank {rank} stack when stopped ---")
        lines.extend(_indent(stack))
    return lines


def _render_hang(hang: Hang) -> list[str]:
    lines = [f"  suspect ranks: {hang.suspect_ranks}"]
    if hang.flight is not None:
        unread = f" (rank(s) {hang.flight.unread} could not be read)" if hang.flight.unread else ""
        lines.append(f"  PyTorch's Flight Recorder{unread}: {hang.flight.explanation}")
    ranks = sorted(hang.ranks.items())
    lines.extend(_position(rank, place) for rank, place in ranks)
    for rank, place in ranks:
        if not place.finished:
            lines.append(f"  --- rank {rank} stack ---")
            lines.extend(_indent(place.stack))
    return lines


def _render_crash(crash: Crash) -> list[str]:
    said = crash.exitcode is not None or crash.error.startswith(f"rank {crash.rank} ")  # how it died, said
    error = "\n    ".join(_cut_message(crash.error.splitlines(), 0))
    lines = [f"  {error}"] if said else [f"  rank {crash.rank} raised: {error}"]
    if crash.traceback:
        tb = crash.traceback.rstrip().splitlines()
        first = crash.error.splitlines()[0].strip() if crash.error.strip() else None
        at = next((i for i in range(len(tb) - 1, -1, -1) if first and tb[i].strip() == first), None)
        lines.extend(_indent("\n".join(_cut_message(tb, at) if at is not None else tb)))
    if crash.output:
        lines.append(f"  --- rank {crash.rank} output ---")
        lines.extend(_indent(crash.output))
    others = [(r, place) for r, place in sorted(crash.ranks.items()) if r != crash.rank]
    if others:
        lines.append("  the other ranks at that moment:")
        lines.extend(_position(rank, place, crash.error) for rank, place in others)
        for rank, place in others:
            if place.stack and not place.finished:
                lines.append(f"  --- rank {rank} stack ---")
                lines.extend(_indent(place.stack))
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
    return [f"  {run.name} world_size={run.world_size}: {note}" for note in run.notes] + [
        f"  straggler: rank {s.rank} arrived last at {s.last_count} of {s.collectives} collectives, "
        f"{round(s.mean_late_s, 4):.3g} s after the first rank on average"
        for s in run.stragglers
    ]


def render_failure(failure: Failure) -> str:
    """A failure's evidence, for reports with their own heading (``profile``, ``health``)."""
    lines = _render_desync(failure.desync) if failure.desync is not None else []
    lines += _how_it_ended(failure.crash, failure.hang, failure.reason, failure.desync)
    return "\n".join(lines).strip() or (failure.reason or failure.status)


def _how_it_ended(crash: Crash | None, hang: Hang | None, reason: str | None, desync: Desync | None) -> list[str]:
    if crash is not None:
        return _render_crash(crash)
    if hang is not None:
        return [f"  {(reason or 'hang').splitlines()[0]}", *_render_hang(hang)]
    if reason and desync is None:
        return ["  " + s for s in reason.rstrip().splitlines()]
    return []


def _label(f: ModuleFinding) -> str:
    """``stem.1 (BatchNorm2d)``, ``'2' (Linear)`` (a bare index quoted), ``the model (Net)``."""
    name = f"'{f.module}'" if f.module.isdigit() else f.module or "the model"
    return f"{name} ({f.type})"


def _uncompared(f: ModuleFinding) -> str:
    """What "every module agrees" leaves out: outputs whose rows are not one per sample."""
    return (f"; except modules never compared, their outputs' rows not one per sample of the rank's share: "
            f"{f.uncompared}"
            if f.uncompared else "")


def module_line(f: ModuleFinding) -> str:
    """Where in the model a run's first differing step first differs, in one line."""
    if not f.found:
        return (f"first differing module: none (step {f.step}): every module's output, activation gradient "
                f"and parameter gradient agrees with the reference on every rank; the difference comes after "
                f"them (in the optimizer step or an update of the parameters or buffers){_uncompared(f)}")
    if f.phase == "compiled":
        return (f"first block that differs compiled: {_label(f)}, step {f.step}, rank {f.rank}: its compiled output "
                f"differs from its eager output on the same input (rel {f.error:.2g}, tolerance {f.tolerance:.2g}){'; ' + f.note if f.note else ''}")
    if f.phase == "reduction":
        by = (f"up to {f.scale} {f.error:.2g}, tolerance {f.tolerance:.2g}" if math.isfinite(f.error)
              else "some present on one side only")
        return (f"first to differ: the reduction (step {f.step}, rank {f.rank}): every module's output "
                f"and activation gradient agrees with the reference; every parameter's gradient differs "
                f"({by}): what differs comes after backward, in the reduction across ranks or in what the step did "
                f"to the gradients before the optimizer step{_uncompared(f)}")
    if f.phase == "loss":
        by = f" is {f.factor:.3g}x the reference's" if f.factor is not None else " differs"
        return (f"first to differ: the loss (step {f.step}, rank {f.rank}): every module's forward agrees; "
                f"{f.differs} w.r.t. the output of {_label(f)}{by} (rel {f.error:.2g}, a rank's "
                f"compared x 1/world_size)")
    if not f.agrees:  # the first place compared: nothing nearer the loss to agree
        before = ""
    elif f.agrees_ok is None:
        before = f"{f.agrees} not compared"
    else:
        err = f" (rel {f.agrees_error:.2g})" if f.agrees_error is not None else ""
        before = f"{f.agrees} {'agrees' if f.agrees_ok else 'differs too'}{err}"
    by = f.mismatch or f"{f.scale} {f.error:.2g}, tolerance {f.tolerance:.2g}"
    inside = (f"; inside it, the first op that differs: {f.op} (rel {f.op_error:.2g})" if f.op
              else f"; {f.note}" if f.note else "")
    return (f"first differing module: {_label(f)}, step {f.step}, rank {f.rank}, {f.phase}: "
            f"{before + ', ' if before else ''}{f.differs} differs ({by}){inside}")


def render_run_failure(run: RunResult, told: dict[tuple[str, ...], str] | None = None) -> list[str]:
    """A failed run's section of the report. ``told``: the endings (a traceback, a hang's
    stacks) already printed for earlier runs of the report, each printed once."""
    head = f"{run.name} world_size={run.world_size} ({run.backend}{', simulated' if run.simulated else ''}): {run.status.upper()}"
    lines = [head]
    if run.desync:
        lines.extend(_render_desync(run.desync))
    if run.first_divergence is not None:
        d = run.first_divergence
        lines.append(f"  first divergence: {d.where}")
        lines.append(
            f"    {d.mismatch}" if d.mismatch else
            f"    rank {d.rank}'s update is {d.factor:.2f}x one device's, where a correct rank's lies within "
            f"{1 - d.tolerance:.3g}x..{1 + d.tolerance:.3g}x [{run.tolerance}]" if d.factor is not None else
            f"    max abs error {_sci(d.max_abs)}, max rel error {_sci(d.max_rel)}, "
            f"tolerance {_sci(d.tolerance)} [{run.tolerance}]"
        )
        if d.module is not None:
            lines.append(f"  {module_line(d.module)}")
        if run.worst:
            lines.append("  worst offenders (error / tolerance):")
            width = max(len(w.name) for w in run.worst)
            for w in run.worst:
                lines.append(
                    f"    {w.kind:<6} {w.name:<{width}}  step {w.step}  rank {w.rank}  "
                    + (w.mismatch if w.mismatch else f"factor {w.factor:.2f}  x{_sci(w.excess)}" if w.factor is not None
                       else f"abs {_sci(w.max_abs)}  x{_sci(w.excess)}")
                )
    ended = tuple(_how_it_ended(run.crash, run.hang, run.reason, run.desync))
    if told is not None and (len(ended) > 1 or sum(map(len, ended)) > SAID_ONCE) and ended in told:
        lines.append(f"  {ended[0].strip().splitlines()[0]} (the same as {told[ended]}: printed above)" if len(ended) > 1 else
                     f"  the same error as {told[ended]} (printed above)")
    else:
        lines.extend(ended)
        if told is not None:
            told[ended] = f"{run.name} world_size={run.world_size}"
    lines.extend(render_notes(run))
    if run.repro:
        lines.append(f"  reproduce: {run.repro}")
    return lines


def render_report(case: str, runs: list[RunResult], verb: str = "check") -> str:
    """A check's report (or a watch's): the table of its runs, each failure, the notes, one
    overall line."""
    rows = [("mode", "world", "backend", "status", "seconds")]
    for r in runs:
        backend = r.backend + (" (simulated)" if r.simulated else "")
        rows.append((r.name, str(r.world_size), backend, r.status, f"{r.seconds:.2f}"))
    out = [f"ddparity {verb}: {case}", *table(rows)]
    failures = [r for r in runs if not r.ok]
    told: dict[tuple[str, ...], str] = {}
    for run in failures:
        out.append("")
        out.extend(render_run_failure(run, told))
    notes = [line for r in runs if r.ok for line in render_notes(r)]
    notes += [f"{r.name} world_size={r.world_size}: skipped: {r.reason}" for r in runs
              if r.status == "skipped" and r.reason]
    if notes:
        out.append("")
        out.extend(line.strip() for line in notes)
    passed = sum(r.status == "pass" for r in runs)
    skipped = sum(r.status == "skipped" for r in runs)
    verdict = "OK" if all(r.ok for r in runs) else "FAILED"
    tail = f", {skipped} skipped" if skipped else ""
    out.append("")
    if verb == "watch":
        found = ", ".join(sorted({r.status for r in failures}))
        out.append(f"{verdict}: " + (f"{found} found in the watched run" if failures else
                                     "no hang, crash, collective mismatch or replica drift in the watched run"))
    else:
        out.append(f"{verdict}: {passed} of {len(runs)} runs equivalent to the reference{tail}")
    return "\n".join(out)


# -- profile -----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes < 1e3:
        return f"{nbytes} B"
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_profile(label: str, runs: list[WorldProfile], recommendation: str | None = None) -> str:
    """The table users read, one line per mode and world size, then notes and failures, then
    the recommendation."""
    from ddparity.checks.comm import state_of

    rows = []
    for r in runs:
        if r.status != "ok":
            rows.append([r.label, str(r.world_size), r.backend, r.status.upper()] + ["-"] * 11)
            continue
        state = state_of(r.memory_per_rank) or None
        rows.append([
            r.label, str(r.world_size), r.backend, "ok", _ms(r.step_s), _ms(r.step_p95_s), _ms(r.compute_s),
            _ms(r.exposed_comm_s),
            _ms(r.comm_s), _num(r.overlap, ".0%"), _size(r.bytes_per_step),
            _num(r.busbw_gbps, ".3f"), _num(r.scaling_efficiency, ".0%"), _size(state), _size(r.step_memory),
        ])
    header = ["mode", "world", "backend", "status", "step ms", "p95 ms", "compute ms", "exposed comm ms", "comm ms",
              "overlap", "sent/step", "busbw GB/s", "scaling", "state/rank", "mem/step"]
    lines = [f"ddparity profile: {label}", *table([header, *rows]), ""]
    for r in runs:
        where = f"{r.label} world size {r.world_size}"
        if not kind(r.mode).buckets or any(c["op"] != "all_reduce" or c.get("step") for c in r.collectives or []):
            for c in r.collectives or []:
                bw = "" if c["busbw_gbps"] is None else f", busbw {c['busbw_gbps']:.3g} GB/s in groups of {c['group_size']}"
                bw = ", in groups of 1 (nothing crosses a link)" if c["group_size"] == 1 else bw
                own = STEPS_OWN if c.get("step") else ""
                lines.append(f"  {where}: {c['op']}{own} x{c['calls']} a step, {_size(c['bytes'])} in "
                             f"{_ms(c['seconds'])} ms{bw}")
        if r.memory_per_rank:
            parts = ", ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in r.memory_per_rank.items()
                              if k != "activations")
            saved = r.memory_per_rank.get("activations")
            lines.append(f"  {where}: state a rank holds (the largest rank): {parts}"
                         + (f"; in a step also activations {_size(saved)} (what autograd saved for backward, "
                            f"counted in a warm-up step)" if saved is not None else ""))
        logged = r.ddp_logging
        if logged and r.world_size > 1:
            times = ", ".join(f"{name} {logged[key]:.2f} ms" for name, key in (
                ("forward", "forward_ms"), ("backward compute", "backward_compute_ms"),
                ("backward comm", "backward_comm_ms"), ("overlap", "overlap_ms")) if logged.get(key) is not None)
            lines.append(f"  {where}: DDP's own logging: {times}; {logged['buckets']} bucket(s)"
                         f"{' (rebuilt)' if logged['rebuilt'] else ''}")
        for note in r.notes:
            lines.append(f"  {where}: {note}")
        if r.status != "ok" and r.reason:
            lines.append(f"  {where} {r.status.upper()}: {r.reason}")
            if r.repro and r.status in ("hang", "crash", "error"):
                lines.append(f"  reproduce: {r.repro}")
    if recommendation:
        lines += ["", f"recommendation: {recommendation}"]
    return "\n".join(lines).rstrip() + "\n"


# -- health ------------------------------------------------------------------------------


def render_health(checks: list[Check], bandwidth: list[Bandwidth], ranks: list[RankHealth], header: str,
                  pairs: Sequence[PairBandwidth] = ()) -> str:
    """The health table: checks, bandwidth per size, per pair (``--pairwise``), every rank,
    then the verdict."""
    lines = [header, *table([["check", "status", "detail"], *[[c.name, c.status.upper(), c.detail] for c in checks]]), ""]
    if bandwidth:
        lines += table([["size", "time", "algbw GB/s", "busbw GB/s"],
                        *[[f"{b.bytes / 2**20:g} MiB", f"{b.seconds * 1e3:.2f} ms", f"{b.algbw_gbps:.3f}",
                           "-" if b.busbw_gbps is None else f"{b.busbw_gbps:.3f}"] for b in bandwidth]])
        lines.append("")
    if pairs:
        lines += table([["pair", "time", "busbw GB/s", "through"],
                        *[[f"{p.unit}s {p.a}-{p.b}", f"{p.seconds * 1e3:.2f} ms", f"{p.busbw_gbps:.3f}",
                           "network only" if p.network_only else "any transport"] for p in pairs]])
        lines.append("")
    lines += table([["rank", "host", "device", "GFLOP/s", "barrier"],
                    *[[str(r.rank), r.host, f"{r.device} ({r.device_name})", f"{r.gflops:.1f}",
                       f"{r.barrier_s * 1e3:.1f} ms"] for r in sorted(ranks, key=lambda r: r.rank)]])
    failed = [c for c in checks if c.status == "fail"]
    skipped = [c.name for c in checks if c.status == "skip"]
    passed = len(checks) - len(skipped)
    lines.append("")
    lines.append(f"UNHEALTHY: {', '.join(c.name for c in failed)} failed" if failed else
                 f"HEALTHY: {passed} checks passed" + (" (with warnings)" if any(c.status == "warn" for c in checks) else "")
                 + (f"; {', '.join(skipped)} skipped (each row says why)" if skipped else ""))
    return "\n".join(lines) + "\n"
