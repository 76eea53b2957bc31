"""The ``ddparity`` command's arguments, help texts and exit codes (parsing only: what
each verb does is :mod:`ddparity.cli`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ddparity import parsing, settings
from ddparity.compile_spec import COMPILE_DDP
from ddparity.errors import UsageError

EXIT_CODES = """exit codes:
  0    every run equivalent (profile: every world size profiled or skipped; health: healthy)
  1    a divergence or a desync (health: a check failed)
  2    bad input: a usage error, a Case that cannot run (the message names the fix)
  3    a hang, a crash, or a world that could not start
  4    an internal error of ddparity (rerun with DDPARITY_DEBUG=1 and report it)
  130  interrupted (Ctrl-C)
A closed output pipe (| head) ends the output quietly; the exit code is still the verdict's."""

CHECK_EXAMPLES = """examples:
  ddparity check --demo                                 the built-in models, a few seconds
  ddparity check my_cases.py:case                       your Case at world sizes 1, 2 and 4
  ddparity check my_cases.py:case --world-sizes 2,8 --backend threaded
  ddparity check my_cases.py:case --json - | python -m json.tool     the JSON on stdout
  ddparity check my_cases.py:case --modes single,ddp --compile inductor   eager beside torch.compile'd
  torchrun --nproc-per-node 4 -m ddparity check my_cases.py:case     the launch is the world
"""

PROFILE_EXAMPLES = """examples:
  ddparity profile --demo
  ddparity profile my_cases.py:case --world-sizes 1,2,4 --plot profile.png
  ddparity profile my_cases.py:case --modes ddp,fsdp --world-sizes 2,4   DDP beside FSDP2: time, bytes, state a rank
  ddparity profile my_cases.py:case --bucket-cap-mb 1,5,25,100 --comm-hook fp16   DDP's settings swept, one row an arm
"""

WATCH_EXAMPLES = """examples:
  ddparity watch --nproc-per-node 2 train.py --lr 0.1      your script on 2 local ranks, watched
  ddparity watch --nproc-per-node 2 -m ddparity.fixtures.scripts.ddp_train --fault hang --on 0   a planted hang
  torchrun --nproc-per-node 8 -m ddparity watch --timeout 600 train.py --lr 0.1
  torchrun --nnodes 2 --nproc-per-node 8 ... -m ddparity watch --json watch.json train.py
the script runs as `python train.py ARGS` would (as __main__, its argv, output and exit code);
ddparity's options come before the script's path, the script's own after it
"""

HEALTH_EXAMPLES = """examples:
  ddparity health                                       this machine: 2 CPU ranks, or one per GPU
  ddparity health --min-busbw 100                       fail below 100 GB/s of all-reduce bus bandwidth
  ddparity health --world-size 4 --pairwise             which pair of ranks has a slow link
  torchrun --nnodes 2 --nproc-per-node 8 ... -m ddparity health --json health.json
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise UsageError(message)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (examples, exit codes)."""


class BadFlag(Exception):  # noqa: N818 - carries the UsageError past argparse
    """A flag's value refused by its setting's parser: ``error`` is the UsageError that says
    why. Not a ValueError, so argparse (which turns a ``type``'s ValueError into its own
    "invalid value" line) lets it through to the CLI, which reports ``error`` as it is."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(str(error))
        self.error = error


def _text(parse: Callable[..., Any], where: str, *args: Any) -> Callable[[str], Any]:
    """An argparse ``type``: the setting's own parser, its errors naming the flag."""

    def convert(text: str) -> Any:
        try:
            return parse(text, where, *args)
        except UsageError as exc:
            raise BadFlag(exc) from None

    convert.__name__ = parse.__name__
    return convert


def _csv(values: tuple[object, ...]) -> str:
    return ",".join(map(str, values))


def _verb(sub: Any, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    verb = sub.add_parser(name, help=summary, description=description, epilog=f"{examples}\n{EXIT_CODES}",
                          formatter_class=_Help)
    talk = verb.add_mutually_exclusive_group()
    if name != "profile":  # a profile is figures: it has no verdict line
        talk.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")
    talk.add_argument("-v", "--verbose", action="store_true",
                      help="keep ddparity's own threads and frames in the ranks' stacks and tracebacks "
                           "(folded by default)")
    return verb


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddparity", formatter_class=_Help, epilog=EXIT_CODES,
                     description="Prove that data-parallel training matches one device: run your model and "
                                 "training step single-device, under DataParallel and under DDP, compare every "
                                 "step, and report divergence, desync, hangs and crashes with each rank's place.")
    parser.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{check,profile,health,watch}")
    target_help = "module:function or path/to/file.py:function returning a ddparity.Case"
    json_help = "write the JSON report (version 1) to PATH; '-' writes it to stdout (the text report goes to stderr)"
    chk = _verb(sub, "check", "run a Case single-device and under DDP and compare them step by step",
                "Train the Case's model from one initial state on one device (the reference) and as DDP ranks "
                "at each world size, and compare the loss, every gradient, parameter and buffer after every "
                "step; collectives are checked across ranks as they are issued.", CHECK_EXAMPLES)
    chk.add_argument("target", nargs="?", help=target_help)
    chk.add_argument("--demo", action="store_true", help="check the built-in reference models")
    chk.add_argument("--demo-faults", action="store_true",
                     help="run the built-in fault injections (hang, crash, desync, straggler) and show each report")
    chk.add_argument("--modes", type=_text(parsing.parse_modes, "--modes"), default=settings.CHECK_MODES,
                     help=f"comma-separated, of single, dp, ddp, fsdp, hsdp (default {_csv(settings.CHECK_MODES)}; "
                          "dp is simulated without enough GPUs; fsdp and hsdp are FSDP2's fully_shard)")
    chk.add_argument("--hsdp-shard", type=_text(parsing.parse_count, "--hsdp-shard"), default=None, metavar="S",
                     help=f"mode hsdp's shard size: a (W/S replicas, S shards) mesh (default: the Case's, else "
                          f"{settings.HSDP_SHARD})")
    chk.add_argument("--compile", default=None, metavar="BACKEND",
                     help="also run every mode torch.compile'd with this backend (inductor, aot_eager, ...), judged "
                          "against the same eager reference; compile's own numerics measured on one device")
    chk.add_argument("--compile-ddp", default=None, choices=COMPILE_DDP, metavar="MODE",
                     help="Dynamo's DDP path for the compiled ddp runs: ddp_optimizer (the default: the graph split "
                          "at bucket boundaries) or python_reducer (all-reduces traced by compiled autograd)")
    chk.add_argument("--world-sizes", type=_text(parsing.parse_world_sizes, "--world-sizes"), default=None,
                     help=f"comma-separated, e.g. 1,2,4 (default {_csv(settings.CHECK_WORLD_SIZES)}; "
                          f"{_csv(settings.DEMO_FAULTS_WORLD_SIZES)} with --demo-faults)")
    chk.add_argument("--backend", type=_text(settings.validate_backend, "--backend"), default="auto",
                     help="auto | gloo | nccl | threaded (simulated ranks: threads in one process); default auto: "
                          "nccl with a GPU per rank, else gloo, threaded above this machine's rank limit")
    chk.add_argument("--steps", type=_text(parsing.parse_count, "--steps"), default=None,
                     help="override the Case's number of steps (default: the Case's)")
    chk.add_argument("--tolerance", type=_text(parsing.parse_tolerance, "--tolerance"), default="auto",
                     help="auto (calibrated noise floor, the default) or a relative tolerance (0 = bit-exact)")
    chk.add_argument("--timeout", type=_text(parsing.parse_timeout, "--timeout"), default=None,
                     help=f"{settings.TIMEOUT_HELP} (default {settings.TIMEOUT_S:g}; "
                          f"{settings.DEMO_FAULTS_TIMEOUT_S:g} with --demo-faults)")
    chk.add_argument("--json", metavar="PATH", help=json_help)
    prof = _verb(sub, "profile", "time a Case's DDP (or FSDP2) communication at each world size",
                 "Time DDP (or FSDP2) steps of the Case at each world size: compute, communication, exposed "
                 "communication, each collective's time and bytes, bus bandwidth, scaling against the smallest "
                 "world size, and the state (parameters, gradients, optimizer) a rank holds.", PROFILE_EXAMPLES)
    prof.add_argument("target", nargs="?", help=target_help)
    prof.add_argument("--demo", action="store_true", help="profile the built-in wide MLP (several buckets)")
    prof.add_argument("--modes", type=_text(parsing.parse_modes, "--modes"), default=("ddp",),
                      help="comma-separated, of ddp, fsdp, hsdp (default ddp)")
    prof.add_argument("--hsdp-shard", type=_text(parsing.parse_count, "--hsdp-shard"), default=None, metavar="S",
                      help=f"mode hsdp's shard size (default: the Case's, else {settings.HSDP_SHARD})")
    prof.add_argument("--bucket-cap-mb", type=_text(parsing.parse_bucket_caps, "--bucket-cap-mb"), default=None,
                      metavar="MB,...", help="sweep DDP's bucket cap: one arm (a row at each world size) a size, "
                                             "e.g. 1,5,25,100")
    prof.add_argument("--bucket-cap-mb-list", type=_text(parsing.parse_bucket_lists, "--bucket-cap-mb-list"),
                      default=None, metavar="MB:MB,...", help="sweep DDP's caps bucket by bucket (its "
                      "bucket_cap_mb_list, newer torch): one arm a list, e.g. 1:25,5:25 (the first bucket 1 MB, "
                      "then 25 MB)")
    prof.add_argument("--ddp", type=_text(parsing.parse_names, "--ddp"), default=None, metavar="OPTION,...",
                      help="sweep DDP's options: one arm an option turned on, of gradient_as_bucket_view, "
                           "static_graph, find_unused_parameters")
    prof.add_argument("--comm-hook", type=_text(parsing.parse_names, "--comm-hook"), default=None,
                      metavar="HOOK,...", help="sweep torch's comm hooks: one arm a hook, of allreduce, fp16, bf16, "
                                               "powersgd")
    prof.add_argument("--world-sizes", type=_text(parsing.parse_world_sizes, "--world-sizes"),
                      default=None,
                      help=f"comma-separated (default {_csv(settings.PROFILE_WORLD_SIZES)})")
    prof.add_argument("--backend", default="auto", help="auto | gloo | nccl (real rank processes; default auto)")
    prof.add_argument("--steps", type=_text(parsing.parse_count, "--steps"), default=settings.PROFILE_STEPS,
                      help=f"measured iterations per world size (default {settings.PROFILE_STEPS})")
    prof.add_argument("--warmup", type=_text(parsing.parse_count, "--warmup", 0), default=settings.PROFILE_WARMUP,
                      help=f"iterations run first and not measured (default {settings.PROFILE_WARMUP})")
    prof.add_argument("--timeout", type=_text(parsing.parse_timeout, "--timeout"), default=settings.TIMEOUT_S,
                      help=f"{settings.TIMEOUT_HELP} (default {settings.TIMEOUT_S:g})")
    prof.add_argument("--json", metavar="PATH", help=json_help)
    prof.add_argument("--plot", metavar="PATH.png", help="draw step time (compute, exposed communication), "
                                                        "bus bandwidth and scaling per world size (needs matplotlib)")
    hl = _verb(sub, "health", "check that this machine or cluster can train: collectives, compute, bandwidth",
               "A pre-deployment check: every rank joins, every collective returns the right values, each "
               "device computes right and as fast as the others, versions match, and the all-reduce bus "
               "bandwidth is measured (against a floor with --min-busbw).", HEALTH_EXAMPLES)
    hl.add_argument("--world-size", type=_text(parsing.parse_count, "--world-size"), default=None,
                    help="local ranks (default: one per GPU, else 2 CPU ranks); under torchrun, torchrun decides")
    hl.add_argument("--backend", default="auto", help="auto | gloo | nccl (default auto)")
    hl.add_argument("--timeout", type=_text(parsing.parse_timeout, "--timeout"), default=settings.TIMEOUT_S,
                    help=f"seconds a rank may wait before the check counts as a hang (default {settings.TIMEOUT_S:g})")
    hl.add_argument("--min-busbw", type=_text(parsing.parse_gbps, "--min-busbw"), default=None, metavar="GBPS",
                    help="fail when the all-reduce bus bandwidth at the largest size is below this (GB/s; "
                         "default: measured, not judged)")
    hl.add_argument("--sizes", type=_text(parsing.parse_sizes_mib, "--sizes"), default=None, metavar="MIB,MIB",
                    help=f"all-reduce message sizes in MiB (default {_csv(settings.HEALTH_SIZES_MIB)})")
    hl.add_argument("--thresholds", metavar="FILE", default=None,
                    help="a JSON file of the GPU readings' limits, e.g. {\"temperature_c\": 80} (default: gcm's; "
                         "see docs/health.md)")
    hl.add_argument("--pairwise", action="store_true",
                    help="also time an all-reduce pair by pair of nodes (of ranks on one node) and name a slow "
                         "link; under nccl locally, again through the network alone")
    hl.add_argument("--long", nargs="?", const=settings.HEALTH_LONG_S, default=None, metavar="SECONDS",
                    type=_text(parsing.parse_seconds, "--long"),
                    help=f"add a stress pass: a matmul and an all-reduce repeated for SECONDS (default "
                         f"{settings.HEALTH_LONG_S:g}), every result checked, and a {settings.HEALTH_LONG_SIZES_MIB[-1]} MiB "
                         f"bandwidth size")
    hl.add_argument("--json", metavar="PATH", help=json_help + " (rank 0 under torchrun)")
    wt = _verb(sub, "watch", "run your unmodified training script on every rank, watched for hangs, crashes and desync",
               "Run a training script as it is (no Case) in every rank of a launch, with every collective "
               "recorded, a heartbeat per rank and, after each optimizer.step(), a fingerprint of the parameters "
               "compared across the ranks that hold the same replica: a hang, a crash, a mismatched collective "
               "or replicas drifting apart are reported live, like a check's. The script's output and exit code "
               "pass through when nothing is found.", WATCH_EXAMPLES)
    wt.add_argument("--nproc-per-node", type=_text(parsing.parse_count, "--nproc-per-node"), default=None,
                    metavar="N", help="start N ranks on this machine (outside torchrun; under torchrun, torchrun "
                                      "decides)")
    wt.add_argument("--timeout", type=_text(parsing.parse_timeout, "--timeout"), default=settings.WATCH_TIMEOUT_S,
                    help=f"seconds a rank may stand still (no collective, no optimizer step, its Python not moving) "
                         f"before it counts as a hang (default {settings.WATCH_TIMEOUT_S:g})")
    wt.add_argument("--json", metavar="PATH", help="write the JSON report (version 1) to PATH (rank 0 under torchrun)")
    wt.add_argument("--flight-recorder", metavar="DIR", default=None,
                    help="write each rank's collectives as a PyTorch Flight Recorder dump to DIR/ddparity_fr_<rank> "
                         "(read it with python -m torch.distributed.flight_recorder.fr_trace DIR)")
    wt.add_argument("-m", dest="module", action="store_true",
                    help="SCRIPT is a module, run as python -m SCRIPT would (as torchrun -m does)")
    wt.add_argument("script", help="your training script (path/to/train.py), or a module's name with -m")
    wt.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser
