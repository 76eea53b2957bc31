"""The ``ddparity`` command line (an adapter: parse, call the library, render).

Exit codes (SPEC): 0 equivalent (``profile``: every world size profiled or skipped;
``health``: healthy), 1 divergence or desync (``health``: a check failed), 2 usage error
or bad input, 3 hang or crash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ddparity import settings
from ddparity.errors import UsageError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise UsageError(message)


def _text(parse: Callable[..., Any], where: str, *args: Any) -> Callable[[str], Any]:
    """An argparse ``type``: the setting's own parser, its errors naming the flag."""

    def convert(text: str) -> Any:
        return parse(text, where, *args)

    convert.__name__ = parse.__name__
    return convert


def _csv(values: tuple[object, ...]) -> str:
    return ",".join(map(str, values))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddparity", description="Prove that data-parallel training matches one device.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    chk = sub.add_parser("check", help="run a Case as single-device and DDP and compare them step by step")
    chk.add_argument("target", nargs="?", help="module:function or path/to/file.py:function returning a Case")
    chk.add_argument("--demo", action="store_true", help="check the built-in reference models")
    chk.add_argument("--demo-faults", action="store_true",
                     help="run the built-in fault injections (hang, crash, desync, straggler) and show each report")
    chk.add_argument("--modes", type=_text(settings.parse_modes, "--modes"), default=settings.CHECK_MODES, help="comma-separated: single,dp,ddp (dp is simulated without enough GPUs)")
    chk.add_argument("--world-sizes", type=_text(settings.parse_world_sizes, "--world-sizes"), default=None,
                     help=f"comma-separated, e.g. 1,2,4 (default {_csv(settings.CHECK_WORLD_SIZES)}; "
                          f"{_csv(settings.DEMO_FAULTS_WORLD_SIZES)} with --demo-faults)")
    chk.add_argument("--backend", type=_text(settings.validate_backend, "--backend"), default="auto",
                     help="auto | gloo | nccl | threaded (simulated ranks: threads in one process)")
    chk.add_argument("--steps", type=_text(settings.parse_count, "--steps"), default=None, help="override the Case's number of steps")
    chk.add_argument("--tolerance", type=_text(settings.parse_tolerance, "--tolerance"), default="auto",
                     help="auto (calibrated noise floor) or a relative tolerance (0 = bit-exact)")
    chk.add_argument("--timeout", type=_text(settings.parse_timeout, "--timeout"), default=None,
                     help=f"{settings.TIMEOUT_HELP} (default {settings.TIMEOUT_S:g}; "
                          f"{settings.DEMO_FAULTS_TIMEOUT_S:g} with --demo-faults)")
    chk.add_argument("--json", metavar="PATH", help="write the JSON report (version 1) here")
    prof = sub.add_parser("profile", help="time a Case's DDP communication at each world size")
    prof.add_argument("target", nargs="?", help="module:function or path/to/file.py:function returning a Case")
    prof.add_argument("--demo", action="store_true", help="profile the built-in wide MLP (several buckets)")
    prof.add_argument("--world-sizes", type=_text(settings.parse_world_sizes, "--world-sizes"),
                      default=None,
                      help=f"comma-separated (default {_csv(settings.PROFILE_WORLD_SIZES)})")
    prof.add_argument("--backend", default="auto", help="auto | gloo | nccl (real rank processes)")
    prof.add_argument("--steps", type=_text(settings.parse_count, "--steps"), default=settings.PROFILE_STEPS,
                      help=f"measured iterations per world size (default {settings.PROFILE_STEPS})")
    prof.add_argument("--warmup", type=_text(settings.parse_count, "--warmup", 0), default=settings.PROFILE_WARMUP,
                      help=f"iterations run first and not measured (default {settings.PROFILE_WARMUP})")
    prof.add_argument("--timeout", type=_text(settings.parse_timeout, "--timeout"), default=settings.TIMEOUT_S,
                      help=f"{settings.TIMEOUT_HELP} (default {settings.TIMEOUT_S:g})")
    prof.add_argument("--json", metavar="PATH", help="write the JSON profile (version 1) here")
    hl = sub.add_parser("health", help="check that this machine or cluster can train: collectives, compute, bandwidth")
    hl.add_argument("--world-size", type=_text(settings.parse_count, "--world-size"), default=None,
                    help="local ranks (default: one per GPU, else 2 CPU ranks); under torchrun, torchrun decides")
    hl.add_argument("--backend", default="auto", help="auto | gloo | nccl")
    hl.add_argument("--timeout", type=_text(settings.parse_timeout, "--timeout"), default=settings.TIMEOUT_S,
                    help=f"seconds a rank may wait before the check counts as a hang (default {settings.TIMEOUT_S:g})")
    hl.add_argument("--min-busbw", type=_text(settings.parse_gbps, "--min-busbw"), default=None, metavar="GBPS",
                    help="fail when the all-reduce bus bandwidth at the largest size is below this (GB/s)")
    hl.add_argument("--sizes", type=_text(settings.parse_sizes_mib, "--sizes"), default=None, metavar="MIB,MIB",
                    help=f"all-reduce message sizes in MiB (default {_csv(settings.HEALTH_SIZES_MIB)})")
    hl.add_argument("--json", metavar="PATH", help="write the JSON health report (version 1) here (rank 0)")
    prof.add_argument("--plot", metavar="PATH.png", help="draw step time (compute, exposed communication), "
                                                        "bus bandwidth and scaling per world size (needs matplotlib)")
    return parser


def _health(args: argparse.Namespace) -> int:
    from ddparity.harness import torchrun

    if not torchrun.launched() or os.environ.get("RANK") == "0":
        _check_writable(args.json, "JSON health report")
    if torchrun.launched():
        from ddparity.errors import WorldStartError
        from ddparity.verbs.health import health_under_torchrun

        if args.world_size is not None:
            raise UsageError("--world-size is torchrun's to decide here (--nnodes x --nproc-per-node)")

        def emit(report: Any) -> None:
            print(report.render(), flush=True)
            if args.json:
                _write_data(args.json, report.to_json(), "JSON health report")

        try:
            health_under_torchrun(emit, args.backend, args.timeout, args.min_busbw, args.sizes)
        except WorldStartError as exc:
            print(f"ddparity: {exc}", file=sys.stderr)
            return 3
    from ddparity.verbs.health import health

    report = health(args.world_size, args.backend, args.timeout, args.min_busbw, args.sizes)
    print(report.render(), flush=True)
    if args.json:
        _write_data(args.json, report.to_json(), "JSON health report")
    return report.exit_code


def _profile(args: argparse.Namespace) -> int:
    from ddparity.case import load_case
    from ddparity.harness import torchrun
    from ddparity.harness.pool import default_pool
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
        report = profile(case, world_sizes=args.world_sizes, backend=args.backend, timeout=args.timeout,
                         steps=args.steps, warmup=args.warmup)
    finally:
        default_pool().close()
    print(report.render(), flush=True)
    if args.json:
        _write_data(args.json, report.to_json(), "JSON profile")
    if args.plot:
        from ddparity.plot import plot_profile

        plot_profile(report, args.plot)
        print(f"plot written to {args.plot}")
    return report.exit_code


def _check_writable(path: str | None, what: str) -> None:
    """An output path that cannot be written is bad input, found before any work (not a
    verdict thrown away, or a divergence's exit 1 turned into 2, at the end)."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"cannot write the {what} to {path!r}: no directory {folder!r}")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise UsageError(f"cannot write the {what} to {path!r}: permission denied")


def _under_torchrun(args: argparse.Namespace, verb: str) -> int:
    """``check`` or ``profile`` inside a torchrun (or srun) launch: this process is one rank."""
    from ddparity.case import load_case
    from ddparity.errors import WorldStartError
    from ddparity.verbs import launched

    if args.demo or getattr(args, "demo_faults", False):
        raise UsageError(f"under torchrun, {verb} one TARGET; the built-in demos run locally (ddparity {verb} --demo)")
    if not args.target:
        raise UsageError("missing TARGET (module:function or file.py:function returning a Case)")
    if os.environ.get("RANK") == "0":
        _check_writable(args.json, "JSON report")
    timeout = settings.TIMEOUT_S if args.timeout is None else args.timeout
    if verb == "check":
        opts = launched.launch_options(args.modes, args.world_sizes, args.backend, timeout, args.tolerance, args.steps)
    elif args.world_sizes is not None:
        raise UsageError("--world-sizes is torchrun's to decide here (--nnodes x --nproc-per-node)")
    case = load_case(args.target)

    def emit(report: Any) -> None:
        print(report.render(), flush=True)
        if args.json:
            if verb == "check":
                _write_json(args.json, [report])
            else:
                _write_data(args.json, report.to_json(), "JSON profile")
        if getattr(args, "plot", None):
            from ddparity.plot import plot_profile

            plot_profile(report, args.plot)
            print(f"plot written to {args.plot}")

    try:
        if verb == "check":
            launched.check_launched(case, opts, emit)
        launched.profile_launched(case, args.backend, timeout, args.steps, args.warmup, emit)
    except WorldStartError as exc:
        print(f"ddparity: {exc}", file=sys.stderr)
        return 3


def _check(args: argparse.Namespace) -> int:
    from ddparity.case import load_case
    from ddparity.harness import torchrun
    from ddparity.harness.pool import default_pool
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
                           timeout=args.timeout, tolerance=args.tolerance, steps=args.steps)
            reports.append(report)
            print(report.render(), flush=True)
            if len(cases) > 1:
                print(flush=True)
    finally:
        default_pool().close()
    if args.json:
        _write_json(args.json, reports)
    return max(r.exit_code for r in reports)


def _demo_faults(args: argparse.Namespace) -> int:
    """Every fault injection, with its report, then whether each got the right verdict."""
    from ddparity.fixtures.faults import FAULTS, reported_ranks
    from ddparity.harness.pool import default_pool
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
            print(f"=== fault {fault.name}: {fault.description}", flush=True)
            print(report.render(), flush=True)
            print(flush=True)
            for run in report.runs:
                if run.mode == "ddp":
                    as_expected = run.status == fault.status and reported_ranks(run) == fault.suspects(run.world_size)
                    rows.append((fault.name, str(run.world_size), fault.status, run.status,
                                 str(reported_ranks(run)), f"{run.seconds:.2f}", "yes" if as_expected else "NO"))
    finally:
        default_pool().close()
    header = ("fault", "world", "expected", "got", "ranks named", "seconds", "as expected")
    print("fault injection summary")
    print("\n".join(table([header, *rows], rule=False)))
    good = sum(r[-1] == "yes" for r in rows)
    print(f"{'OK' if good == len(rows) else 'FAILED'}: {good} of {len(rows)} fault runs reported as expected")
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
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write the {what} to {path!r}: {exc.strerror}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            from ddparity import __version__

            print(f"ddparity {__version__}")
            return 0
        if args.command == "check":
            return _check(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "health":
            return _health(args)
        parser.print_help()
        return EXIT_USAGE
    except UsageError as exc:
        print(f"ddparity: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ddparity: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # A bug in ddparity itself: say so plainly; the traceback is for the report.
        if os.environ.get("DDPARITY_DEBUG"):
            traceback.print_exc()
        else:
            print(traceback.format_exc().rstrip().splitlines()[-1], file=sys.stderr)
        print("ddparity: internal error; rerun with DDPARITY_DEBUG=1 and report it", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
