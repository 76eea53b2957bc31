"""The version-1 JSON report, byte for byte: every kind of verdict, judged from hand-made
evidence, encoded and compared with ``tests/snapshots/report_v1.json``
(``DDPARITY_UPDATE_SNAPSHOTS=1`` rewrites it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddparity.checks.judge import judge_completed, judge_failure
from ddparity.errors import RankCrashed, StillRunning, TaskFailed, TaskStopped, TaskTimeout
from ddparity.harness.ranks.threaded import SimulatedRankError
from ddparity.harness.world.outcomes import RankOutcome
from ddparity.records import RankRecords
from ddparity.report import Report
from ddparity.verdicts import Divergence, RunResult

SNAPSHOT = Path(__file__).parent / "snapshots" / "report_v1.json"


def line(seq: int, t: float, desc: str = "all_reduce(tensor=float32[4], SUM)", key: str = "",
         step: int = 0, phase: str = "backward", via: str = "") -> str:
    return json.dumps({"g": "world", "s": seq, "op": desc.split("(")[0], "k": key or desc, "d": desc,
                       "site": "train.py:12 in step", "via": via, "step": step, "phase": phase, "t": t,
                       "async": False}, separators=(",", ":"))


def progress(step: int, phase: str, inflight: int | None, recent: list[str], n: int = 7) -> str:
    return json.dumps({"n": n, "step": step, "phase": phase, "inflight": inflight,
                       "recent": [json.loads(r) for r in recent]})


def fingerprints(values: dict[int, dict[str, int]]) -> str:
    return "".join(json.dumps({"step": s, "fp": fp}, separators=(",", ":")) + "\n" for s, fp in values.items())


def run(mode: str = "ddp", status: str = "pass", **fields) -> RunResult:  # noqa: ANN003
    return RunResult(mode=mode, world_size=2, backend="gloo", status=status, seconds=1.23456,
                     tolerance="auto (calibrated noise floor x32, torch.float32)",
                     repro="ddparity check cases.py:case --modes ddp --world-sizes 2", **fields)


def report() -> Report:
    runs = [RunResult(mode="single", world_size=1, backend="gloo", status="pass", seconds=0.5,
                      tolerance="reference")]

    # a pass with a straggler: rank 1 arrives last, 0.2 s late, at every collective
    late = {r: RankRecords(ledger="\n".join(line(s, 10.0 + s + 0.2 * r) for s in range(3)) + "\n")
            for r in range(2)}
    runs.append(judge_completed(run(notes=["a note"]), late, []))

    # a divergence from the reference (one error infinite: a NaN or a shape mismatch)
    found = [Divergence(0, "loss", "loss", 0, 68.9, 0.5, 4.4e-05),
             Divergence(0, "grad", "net.0.bias", 1, float("inf"), float("inf"), 1e-06)]
    diverged = judge_completed(run(), {}, found)
    diverged.worst = list(found)
    runs.append(diverged)

    # ranks issued different collectives at slot 1
    mismatch = {0: RankRecords(ledger=line(0, 1.0) + "\n" + line(1, 2.0) + "\n"),
                1: RankRecords(ledger=line(0, 1.0) + "\n" + line(1, 2.0, "broadcast(tensor=float32[4], root=1)",
                                                                 via="DDP gradient bucket 0") + "\n")}
    runs.append(judge_completed(run(), mismatch, []))

    # replicas drift apart after step 1, rank 1 diverges from the reference there
    same = {"param w": 1, "rng cpu": 5}
    drift = {0: RankRecords(fingerprints=fingerprints({0: same, 1: same})),
             1: RankRecords(fingerprints=fingerprints({0: same, 1: {"param w": 2, "rng cpu": 5}}))}
    runs.append(judge_completed(run(), drift, [Divergence(1, "param", "w", 1, 0.1, 0.01, 1e-6)]))

    # a hang: rank 1 sits in forward, rank 0 waits inside collective #3
    hung = {0: RankRecords(progress=progress(2, "backward", 3, [line(3, 5.0, step=2)])),
            1: RankRecords(progress=progress(2, "forward", None, [line(2, 4.0, step=1)]))}
    timeout = TaskTimeout("rank(s) [0, 1] made no progress for 5 s; the world was rebuilt", [0, 1],
                          {0: "Thread 1 (idle)\n    allreduce (gloo)\n", 1: "Thread 1\n    forward (model.py:3)\n"})
    timeout.records = hung
    runs.append(run().failed(judge_failure(timeout)))

    # a watcher stopped the task over mismatched collectives: a desync with stacks
    stopped = TaskStopped("the run was stopped: ranks issued different collectives", "differ", [0, 1],
                          {0: "stack 0\n", 1: "stack 1\n"})
    stopped.records = mismatch
    runs.append(run().failed(judge_failure(stopped)))

    # a rank died by a signal; its output has the rank loop's bootstrap frames below it
    output = ('Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n'
              '  File "/x/model.py", line 9 in forward\n  File "/x/ddparity/harness/ranks/rank.py", line 150 in _run_task\n'
              '  File "/x/multiprocessing/process.py", line 108 in run\n\n')
    crashed = RankCrashed("rank 1 died (signal SIGSEGV) during the run; the world will be rebuilt\nmore",
                          1, -11, output, {0: "Thread 1\n    allreduce\n"})
    crashed.records = {0: RankRecords(progress=progress(0, "backward", 1, [line(1, 1.0)])),
                       1: RankRecords(progress=progress(0, "forward", None, [line(0, 0.5)]))}
    runs.append(run().failed(judge_failure(crashed)))

    # a rank raised; the other was still waiting for it
    raised = TaskFailed("task failed on rank(s) 0, 1", [
        RankOutcome(0, False, error=StillRunning("rank 0 was still running 0.5 s after rank(s) [1] failed"),
                    output="stack of 0\n"),
        RankOutcome(1, False, error=ValueError("bad shard"), traceback="Traceback...\nValueError: bad shard\n"),
    ])
    raised.records = {0: RankRecords(progress=progress(0, "backward", 0, [line(0, 1.0)])),
                      1: RankRecords(progress=progress(0, "forward", None, []))}
    runs.append(run().failed(judge_failure(raised)))

    # a simulated rank raised (the threads' host process reports it)
    simulated = TaskFailed("task failed on rank(s) 0", [
        RankOutcome(0, False, error=SimulatedRankError(5, "ValueError: bad shard"), traceback="Traceback...\n")])
    runs.append(run(simulated=True).failed(judge_failure(simulated)))

    runs.append(run(status="error", reason="the global batch of step 0 has 3 samples, which cannot be split"))
    runs.append(run(status="skipped", reason="nccl needs 2 CUDA devices, 0 visible"))
    return Report("snapshot case", runs)


def test_the_json_report_is_byte_for_byte_the_snapshot():
    text = report().dumps() + "\n"
    if os.environ.get("DDPARITY_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text()


def test_the_report_text_is_the_snapshot():
    text = report().render() + "\n"
    path = SNAPSHOT.with_name("report_v1.txt")
    if os.environ.get("DDPARITY_UPDATE_SNAPSHOTS"):
        path.write_text(text)
    assert text == path.read_text()
