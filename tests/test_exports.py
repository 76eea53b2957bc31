"""The public surface is pinned: names exported and CLI flags."""

import subprocess
import sys

import ddparity
from ddparity.cli import build_parser


def test_exported_names_are_pinned():
    assert sorted(ddparity.__all__) == [
        "Case", "DdparityError", "Divergence", "HealthReport", "ParityError", "ProfileReport", "RankContext",
        "RankOutcome", "Report", "RunResult", "StepContext", "UsageError", "World", "batched", "check", "health",
        "profile", "samples", "whole",
    ]
    for name in ddparity.__all__:
        assert getattr(ddparity, name) is not None


def test_cli_flags_are_pinned():
    parser = build_parser()
    check = parser._subparsers._group_actions[0].choices["check"]
    flags = sorted(opt for action in check._actions for opt in action.option_strings)
    assert flags == sorted(["--backend", "--compile", "--compile-ddp", "--demo", "--demo-faults", "--hsdp-shard", "--json",
                            "--modes", "--steps", "--timeout", "--tolerance",
                            "--world-sizes", "-h", "--help", "-q", "--quiet", "-v", "--verbose"])
    profile = parser._subparsers._group_actions[0].choices["profile"]
    flags = sorted(opt for action in profile._actions for opt in action.option_strings)
    assert flags == sorted(["--backend", "--bucket-cap-mb", "--bucket-cap-mb-list", "--comm-hook", "--ddp", "--demo", "--hsdp-shard", "--json",
                            "--modes", "--plot", "--steps", "--timeout", "--warmup", "--world-sizes", "-h", "--help", "-v",
                            "--verbose"])
    health = parser._subparsers._group_actions[0].choices["health"]
    flags = sorted(opt for action in health._actions for opt in action.option_strings)
    assert flags == sorted(["--backend", "--json", "--long", "--min-busbw", "--pairwise", "--sizes", "--thresholds", "--timeout", "--world-size", "-h", "--help",
                            "-q", "--quiet", "-v", "--verbose"])


def test_importing_ddparity_does_not_import_torch():
    code = "import sys, ddparity; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
