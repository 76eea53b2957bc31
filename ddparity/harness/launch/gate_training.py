"""The health gate's training step inside a launch (``torchrun ... -m ddparity health``).

After its measurements, every launched process starts one child, ``python -m ddparity
check ddparity.verbs.health:gate_case``, with the launch's own rank, world size and local
rank: the children are a launch of their own across the same machines and devices, the
launched check as a user would run it (:mod:`ddparity.verbs.launched`), on a fresh port of
rank 0's host (``MASTER_ADDR``) and in a store namespace of their own. Rank 0's child
writes the check's JSON, which rank 0 reads back for the gate's ``training`` row. Each
child dies with its process (``PR_SET_PDEATHSIG``) and is killed past its limit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ddparity.harness.health.probe import HealthOptions, health_task
from ddparity.harness.protocol import RankContext
from ddparity.harness.ranks.rank import die_with_parent
from ddparity.harness.recording.recorder import active
from ddparity.measurements import RankHealth

TARGET = "ddparity.verbs.health:gate_case"
START_MARGIN_S = 60.0
"""A child's limit beyond its check's own timeout: starting Python and torch, forming the world."""


@dataclass(frozen=True, slots=True)
class Training:
    modes: tuple[str, ...]
    timeout: float


def health_then_training(ctx: RankContext, options: HealthOptions, training: Training) -> RankHealth:
    """``health_task``, then this process's part of the gate's training launch."""
    out = health_task(ctx, options)
    out.training = run_training(ctx, training)
    return out


def run_training(ctx: RankContext, training: Training) -> dict[str, Any]:
    """Start this rank's child and wait for it; rank 0 returns the check's runs (its JSON),
    every rank its child's exit code (None past the limit) and the tail of its output."""
    import torch.distributed as dist

    chosen: list[Any] = [_free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    folder = tempfile.mkdtemp(prefix="ddparity-gate-") if ctx.rank == 0 else ""
    path = os.path.join(folder, "training.json")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "launch")
    env = {**os.environ, "MASTER_PORT": str(chosen[0]), "TORCHELASTIC_RUN_ID": f"{run_id}-gate-training"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # the children's store is rank 0's child's, not the agent's
    command = [sys.executable, "-m", "ddparity", "check", TARGET, "--modes", ",".join(training.modes),
               "--backend", ctx.backend, "--timeout", f"{training.timeout:g}", "-q"]
    if ctx.rank == 0:
        command += ["--json", path]
    limit = training.timeout + START_MARGIN_S
    result: dict[str, Any] = {"command": " ".join(command[2:])}  # "ddparity check ...", run as python -m
    try:
        code, output = _child(command, env, limit)
        result.update(exit=code, output=output)
        if ctx.rank == 0 and code is not None and os.path.exists(path):
            with open(path) as f:
                result["runs"] = json.load(f).get("runs", [])
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    return result


def _child(command: list[str], env: dict[str, str], limit: float) -> tuple[int | None, str]:
    """Run ``command`` to its end or for ``limit`` seconds (then killed: exit None); its
    output's tail. While it runs, this rank's phase moves, so the launch's watch sees a rank
    that waits on its child, not one that hangs."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        child = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                                 preexec_fn=die_with_parent)
        try:
            while child.poll() is None and time.monotonic() - started < limit:
                active().set_phase(-1, "training launch")  # each poll: the record moves
                time.sleep(0.5)
        finally:
            killed = child.poll() is None
            if killed:
                child.kill()
            child.wait()
        output.seek(0)
        tail = output.read()[-2000:]
    return (None, f"did not finish within {limit:g} s") if killed else (child.returncode, tail)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
