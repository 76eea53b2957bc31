"""The ``ddparity`` command line (an adapter: parse, call the library, render).

Arguments, help texts and exit codes: :mod:`ddparity.cli_parser`. Reports go to stdout
(to stderr when ``--json -`` puts the JSON there); a closed pipe (``| head``) silences
the rest of the output, and the exit code is still the verdict's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ddparity import cli_progress, settings
from ddparity.cli_parser import BadFlag, build_parser
from ddparity.errors import Exit, UsageError
from ddparity.run_kinds import kind


class _Out:
    """Where reports are written: stdout, or stderr while the JSON has stdout (``--json -``);
    with ``--quiet`` a report is its last line (the verdict)."""

    json_stream: Any = None  # the real stdout, while ``--json -`` holds it
    quiet = False
    live: Any = None  # the progress line (ddparity.cli_progress), cleared before a report


def _show(text: str = "") -> None:
    """Print a report (or a line of one); a reader that went away (``| head``) is no error:
    the rest of the output goes nowhere."""
    stream = sys.stderr if _Out.json_stream is not None else sys.stdout
    if _Out.live is not None:
        _Out.live.clear()
    if _Out.quiet:
        verdicts = [line for line in text.rstrip().splitlines() if _VERDICT.match(line)]
        if not verdicts:
            return
        text = verdicts[-1]
    try:
        print(coloured(text) if _colour(stream) else text, file=stream, flush=True)
    except BrokenPipeError:
        _silence(stream)


_GOOD, _BAD, _RESET = "\x1b[1;32m", "\x1b[1;31m", "\x1b[0m"
_HEADING = re.compile(r"^(\S+(?: \([^)]*\))? world_size=\d+ \([^)]*\): )(DIVERGED|DESYNC|HANG|CRASH|ERROR)$", re.M)
_VERDICT = re.compile(r"^(OK|HEALTHY|FAILED|UNHEALTHY|INTERRUPTED):", re.M)


def _colour(stream: Any) -> bool:
    """Colour on a terminal only, never with NO_COLOR set (https://no-color.org) or TERM=dumb."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def coloured(text: str) -> str:
    """A report with its verdicts in colour: the last line, and each failed run's status."""
    text = _HEADING.sub(lambda m: f"{m.group(1)}{_BAD}{m.group(2)}{_RESET}", text)
    return _VERDICT.sub(lambda m: f"{_GOOD if m.group(1) in ('OK', 'HEALTHY') else _BAD}{m.group(1)}{_RESET}:", text)


def _silence(stream: Any) -> None:
    """Point ``stream``'s descriptor at /dev/null: its reader is gone, and Python's own flush
    at exit would otherwise fail too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _health(args: argparse.Namespace) -> int:
    from ddparity.harness.launch import torchrun
    from ddparity.verbs.health import health, health_under_torchrun

    if not torchrun.launched() or os.environ.get("RANK") == "0":
        _check_writable(args.json, "JSON health report")
    given = (args.backend, args.timeout, args.min_busbw, args.sizes, args.thresholds, args.pairwise, args.long)
    if torchrun.launched():
        from ddparity.errors import WorldStartError

        if args.world_size is not None:
            raise UsageError("--world-size is torchrun's to decide here (--nnodes x --nproc-per-node)")

        def emit(report: Any) -> None:
            _show(report.render())
            if args.json:
                _write_data(args.json, report.to_json(), "JSON health report")

        try:
            health_under_torchrun(emit, *given)
        except WorldStartError as exc:
            print(f"ddparity: {exc}", file=sys.stderr)
            return Exit.HANG_OR_CRASH
    report = health(args.world_size, *given)
    _show(report.render())
    if args.json:
        _write_data(args.json, report.to_json(), "JSON health report")
    return report.exit_code


def _profile(args: argparse.Namespace) -> int:
    from ddparity.case import load_case
    from ddparity.harness.launch import torchrun
    from ddparity.harness.world.pool import default_pool
    from ddparity.verbs.profile import profile

    if args.plot:
        from ddparity.plot import check_plot_path

        check_plot_path(args.plot)  # before minutes of profiling, not after
    if torchrun.launched():
        return _under_torchrun(args, "profile")
    _check_writable(args.json, "JSON profile")
    if args.world_sizes is None:
        args.world_sizes = settings.PROFILE_WORLD_SIZES

    if args.demo and args.target:
        raise UsageError("give TARGET or --demo, not both")
    if not (args.demo or args.target):
        raise UsageError("missing TARGET (module:function or file.py:function returning a Case), or use --demo")
    if args.demo:
        from ddparity.fixtures.models import profile_demo

        case = profile_demo()
        case.target = "ddparity.fixtures.models:profile_demo"
    else:
        case = load_case(args.target)
    try:
        report = profile(case, world_sizes=args.world_sizes, backend=args.backend, timeout=args.timeout, steps=args.steps,
                         warmup=args.warmup, modes=args.modes, hsdp_shard=args.hsdp_shard,
                         bucket_cap_mb=args.bucket_cap_mb, bucket_cap_mb_list=args.bucket_cap_mb_list, ddp=args.ddp,
                         comm_hooks=args.comm_hook)
    finally:
        default_pool().close()
    _show(report.render())
    if args.json:
        _write_data(args.json, report.to_json(), "JSON profile")
    if args.plot:
        from ddparity.plot import plot_profile

        plot_profile(report, args.plot)
        _show(f"plot written to {args.plot}")
    return report.exit_code


def _check_writable(path: str | None, what: str) -> None:
    """An output path that cannot be written is bad input, found before any work (not a
    verdict thrown away, or a divergence's exit 1 turned into 2, at the end)."""
    if path and path != "-":
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"cannot write the {what} to {path!r}: no directory {folder!r}")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise UsageError(f"cannot write the {what} to {path!r}: permission denied")


def _under_torchrun(args: argparse.Namespace, verb: str) -> int:
    """``check`` or ``profile`` inside a torchrun (or srun) launch: this process is one rank."""
    from ddparity.case import load_case
    from ddparity.errors import WorldStartError
    from ddparity.verbs import launched, launched_profile, profile_arms

    if args.demo or getattr(args, "demo_faults", False):
        raise UsageError(f"under torchrun, {verb} one TARGET; the built-in demos run locally (ddparity {verb} --demo)")
    if not args.target:
        raise UsageError("missing TARGET (module:function or file.py:function returning a Case)")
    if os.environ.get("RANK") == "0":
        _check_writable(args.json, "JSON report")
    timeout = settings.TIMEOUT_S if args.timeout is None else args.timeout
    if verb == "check":
        opts = launched.launch_options(args.modes, args.world_sizes, args.backend, timeout, args.tolerance, args.steps,
                                         args.hsdp_shard, args.compile, args.compile_ddp)
    elif args.world_sizes is not None:
        raise UsageError("--world-sizes is torchrun's to decide here (--nnodes x --nproc-per-node)")
    case = load_case(args.target)

    def emit(report: Any) -> None:
        _show(report.render())
        if args.json:
            if verb == "check":
                _write_json(args.json, [report])
            else:
                _write_data(args.json, report.to_json(), "JSON profile")
        if getattr(args, "plot", None):
            from ddparity.plot import plot_profile

            plot_profile(report, args.plot)
            _show(f"plot written to {args.plot}")

    try:
        if verb == "check":
            launched.check_launched(case, opts, emit)
        sweep = profile_arms.Sweep.of(args.bucket_cap_mb, args.bucket_cap_mb_list, args.ddp, args.comm_hook)
        launched_profile.profile_launched(case, args.backend, timeout, args.steps, args.warmup, emit, args.modes,
                                          args.hsdp_shard, sweep)
    except WorldStartError as exc:
        print(f"ddparity: {exc}", file=sys.stderr)
        return Exit.HANG_OR_CRASH


def _watch(args: argparse.Namespace) -> int:
    """``watch``: one rank of a launch (under torchrun), or the launcher of local ranks."""
    from ddparity.verbs import watch

    def emit(report: Any) -> None:
        _Out.json_stream = sys.stdout  # the report goes to stderr: stdout is the script's
        _show(report.render())
        if args.json:
            _write_json(args.json, [report])

    return watch.watch_command(args.script, args.args, args.nproc_per_node, args.timeout, args.json, emit,
                               lambda path: _check_writable(path, "JSON report"), args.module, args.flight_recorder,
                               args.quiet)


def _check(args: argparse.Namespace) -> int:
    from ddparity.case import load_case
    from ddparity.harness.launch import torchrun
    from ddparity.harness.world.pool import default_pool
    from ddparity.report import Report
    from ddparity.verbs.check import check

    if torchrun.launched():
        return _under_torchrun(args, "check")
    _check_writable(args.json, "JSON report")

    if sum(map(bool, (args.demo, args.demo_faults, args.target))) > 1:
        raise UsageError("give one of TARGET, --demo or --demo-faults")
    if not (args.demo or args.demo_faults or args.target):
        raise UsageError("missing TARGET (module:function or file.py:function returning a Case), or use --demo")
    if args.demo_faults:
        return _demo_faults(args)
    if args.timeout is None:
        args.timeout = settings.TIMEOUT_S
    if args.world_sizes is None:
        args.world_sizes = settings.CHECK_WORLD_SIZES
    if args.demo:
        from ddparity.fixtures.models import DEMO_CASES

        cases = []
        for key, factory in DEMO_CASES.items():
            case = factory()
            case.target = f"ddparity.fixtures.models:{key}"
            cases.append(case)
    else:
        cases = [load_case(args.target)]
    reports: list[Report] = []
    try:
        for case in cases:
            report = check(case, modes=args.modes, world_sizes=args.world_sizes, backend=args.backend,
                           timeout=args.timeout, tolerance=args.tolerance, steps=args.steps,
                           hsdp_shard=args.hsdp_shard, compile=args.compile, compile_ddp=args.compile_ddp)
            reports.append(report)
            if len(cases) == 1 or not _Out.quiet:  # quiet, several cases: the overall line alone
                _show(report.render())
            if len(cases) > 1:
                _show()
    finally:
        default_pool().close()
    if len(cases) > 1:
        good = sum(r.ok for r in reports)
        _show(f"{'OK' if good == len(reports) else 'FAILED'}: {good} of {len(reports)} cases equivalent to the "
              f"reference in every run")
    if args.json:
        _write_json(args.json, reports)
    return max(r.exit_code for r in reports)


def _demo_faults(args: argparse.Namespace) -> int:
    """Every fault injection, with its report, then whether each got the right verdict."""
    from ddparity.fixtures.faults import FAULTS, reported_ranks
    from ddparity.harness.world.pool import default_pool
    from ddparity.render import table
    from ddparity.verbs.check import check

    sizes = args.world_sizes or settings.DEMO_FAULTS_WORLD_SIZES
    if any(ws < 2 for ws in sizes):
        raise UsageError("fault injections need world sizes >= 2 (a fault fires on rank 1), e.g. --world-sizes 2,4")
    timeout = args.timeout if args.timeout is not None else settings.DEMO_FAULTS_TIMEOUT_S
    rows, reports = [], []
    try:
        for fault in FAULTS.values():
            report = check(fault.case(), modes=args.modes, world_sizes=sizes, backend=args.backend,
                           timeout=timeout, tolerance=args.tolerance, steps=args.steps)
            reports.append(report)
            _show(f"=== fault {fault.name}: {fault.description}")
            _show(report.render())
            _show()
            for run in report.runs:
                if kind(run.mode).buckets:  # the fault matrix's DDP rows
                    as_expected = run.status == fault.status and reported_ranks(run) == fault.suspects(run.world_size)
                    rows.append((fault.name, str(run.world_size), fault.status, run.status,
                                 str(reported_ranks(run)), f"{run.seconds:.2f}", "yes" if as_expected else "NO"))
    finally:
        default_pool().close()
    header = ("fault", "world", "expected", "got", "ranks named", "seconds", "as expected")
    _show("fault injection summary")
    _show("\n".join(table([header, *rows], rule=False)))
    good = sum(r[-1] == "yes" for r in rows)
    _show(f"{'OK' if good == len(rows) else 'FAILED'}: {good} of {len(rows)} fault runs reported as expected")
    if args.json:
        _write_json(args.json, reports)
    return 0 if good == len(rows) else 1


def _write_json(path: str, reports: list) -> None:
    if len(reports) == 1:
        data = reports[0].to_json()
    else:
        runs = [dict(run, case=r.case) for r in reports for run in r.to_json()["runs"]]
        data = {"version": 1, "ok": all(r.ok for r in reports), "case": "demo", "runs": runs}
    _write_data(path, data, "JSON report")


def _write_data(path: str, data: dict, what: str) -> None:
    if path == "-":
        try:
            json.dump(data, _Out.json_stream or sys.stdout, indent=2)
            print(file=_Out.json_stream or sys.stdout, flush=True)
        except BrokenPipeError:
            _silence(_Out.json_stream or sys.stdout)
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write the {what} to {path!r}: {exc.strerror}") from None


def _interrupted(exc: KeyboardInterrupt) -> None:
    """Ctrl-C: the runs a check finished so far, the one in progress and where its ranks were."""
    report, during, places = (getattr(exc, k, None) for k in ("report", "during", "places"))
    if report is not None and getattr(report, "runs", None):
        text = report.render().rstrip().splitlines()
        if text and text[-1].startswith(("OK:", "FAILED:")):  # a verdict on part of the check is none
            text[-1] = f"INTERRUPTED: {len(report.runs)} run(s) finished before Ctrl-C, shown above"
        _show("\n".join(text))
    head = f"ddparity: interrupted during {during}" if during else "ddparity: interrupted"
    lines = [head + (", where each rank was:" if places else "")] + [f"  {p}" for p in places or []]
    print("\n".join(lines), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except BadFlag as bad:
            raise bad.error from None
        if args.version:
            from ddparity import __version__

            _show(f"ddparity {__version__}")
            return Exit.OK
        verbs = {"check": _check, "profile": _profile, "health": _health, "watch": _watch}
        if args.command not in verbs:
            parser.print_help()
            return Exit.USAGE
        if getattr(args, "json", None) == "-":
            _Out.json_stream = sys.stdout
        _Out.quiet = getattr(args, "quiet", False)
        if args.verbose:
            os.environ["DDPARITY_VERBOSE"] = "1"  # read where stacks are tidied (rank processes inherit it)
        _Out.live = cli_progress.watching(_Out.quiet or args.command == "watch", args.command)
        try:
            return verbs[args.command](args)
        finally:
            cli_progress.stop(_Out.live)
            _Out.json_stream, _Out.quiet, _Out.live = None, False, None
    except UsageError as exc:
        print(f"ddparity: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    except KeyboardInterrupt as exc:
        _interrupted(exc)
        return Exit.INTERRUPTED
    except Exception:
        # A bug in ddparity itself: say so plainly; the traceback is for the report.
        if os.environ.get("DDPARITY_DEBUG"):
            traceback.print_exc()
        else:
            print(traceback.format_exc().rstrip().splitlines()[-1], file=sys.stderr)
        print("ddparity: internal error; rerun with DDPARITY_DEBUG=1 and report it", file=sys.stderr)
        return Exit.INTERNAL


if __name__ == "__main__":
    sys.exit(main())
