"""``ddparity health`` as users run it: locally and under torchrun, healthy and with each
fault drill (a bad node of each kind), with bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from ddparity.harness.world.rendezvous import cuda_device_count
from ddparity.settings import NEWER_TORCH, torch_release
from tests.e2e.test_cli import ddparity

CHECKS = ["versions", "hardware", "transfers", "collectives", "compute", "speed", "bandwidth", "latency", "training"]


def run_health(*args: str, fault: str | None = None, torchrun: bool = False, timeout: float = 180, nproc: int = 2):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if fault:
        env["DDPARITY_HEALTH_FAULT"] = fault
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if torchrun \
        else [sys.executable]
    with tempfile.TemporaryDirectory(prefix="ddparity-test-") as tmp:  # torchrun leaves its log folders in $TMPDIR
        env["TMPDIR"] = tmp
        return subprocess.run([*launcher, "-m", "ddparity.cli", "health", "--sizes", "1,2", *args],
                              capture_output=True, text=True, timeout=timeout, env=env)


def statuses(data) -> dict[str, tuple[str, list[int]]]:
    return {c["name"]: (c["status"], c["ranks"]) for c in data["checks"]}


def test_a_healthy_local_world_passes_with_figures(tmp_path):
    out = tmp_path / "health.json"
    result = run_health("--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "HEALTHY: 7 checks passed; hardware, transfers skipped (each row says why)" in result.stdout
    data = json.loads(out.read_text())
    assert (data["version"], data["launcher"], data["backend"], data["world_size"], data["healthy"]) == \
        (1, "local", "gloo", 2, True)
    assert list(statuses(data)) == CHECKS and {s for n, (s, _) in statuses(data).items() if n not in ("hardware", "transfers")} == {"pass"}
    hardware = next(c for c in data["checks"] if c["name"] == "hardware")  # no GPU here: NVML has nothing to read
    assert (hardware["status"], hardware["detail"]) == ("skip", "no CUDA device (the ranks run on cpu)")
    assert all(r["hardware"] == r["transfers"] == "no CUDA device (the ranks run on cpu)" for r in data["ranks"])
    assert statuses(data)["transfers"] == ("skip", [])
    training = next(c for c in data["checks"] if c["name"] == "training")  # the gate ends with a real training
    modes = "ddp and fsdp" if torch_release() >= NEWER_TORCH else "ddp"  # FSDP2 where this torch runs it
    assert training["detail"].startswith(f"a small MLP trains the same under {modes} at 2 rank(s) as on one device")
    assert [b["bytes"] for b in data["bandwidth"]] == [1 << 20, 2 << 20]
    assert all(b["seconds"] > 0 and b["busbw_gbps"] == pytest.approx(b["algbw_gbps"]) for b in data["bandwidth"])
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and all(r["gflops"] > 0 for r in data["ranks"])


@pytest.mark.parametrize(("fault", "check"), [
    ("wrong_allreduce@1", "collectives"), ("wrong_matmul@1", "compute"),
    pytest.param("slow_compute@1", "speed", marks=pytest.mark.breadth)])  # (speed's rule: tests/checks/test_health.py)
def test_each_fault_drill_fails_its_check_naming_the_rank(fault, check, tmp_path):
    out = tmp_path / "health.json"
    result = run_health("--json", str(out), fault=fault)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"UNHEALTHY: {check} failed" in result.stdout
    assert f"reproduce: DDPARITY_HEALTH_FAULT={fault} ddparity health --world-size 2 --backend gloo" in result.stdout
    got = statuses(json.loads(out.read_text()))
    assert got[check] == ("fail", [1])
    assert all(status == "pass" for name, (status, _) in got.items() if name not in (check, "hardware", "transfers"))


def test_a_flipped_bit_no_tolerance_sees_is_named_by_the_devices_of_its_model(tmp_path):
    """Silent data corruption: one bit of one element of rank 2's matmul, far inside the
    float64 tolerance; three CPU ranks of one machine compute the same bits, so the odd one
    is named."""
    out = tmp_path / "health.json"
    result = run_health("--world-size", "3", "--json", str(out), fault="flip_bits@2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "UNHEALTHY: compute failed" in result.stdout
    compute = statuses(json.loads(out.read_text()))["compute"]
    assert compute == ("fail", [2])
    assert "rank 2 cpu" in result.stdout and "silent data corruption" in result.stdout


@pytest.mark.parametrize(("rank", "torchrun"), [(0, False), pytest.param(1, False, marks=pytest.mark.breadth),
                                               pytest.param(1, True, marks=pytest.mark.breadth),
                                               pytest.param(0, True, marks=pytest.mark.breadth)],
                         ids=["rank0", "last", "torchrun-last", "torchrun-rank0"])
def test_a_rank_that_trains_wrong_fails_the_gates_training_naming_it(rank, torchrun, tmp_path):
    """Every other check passes (the collectives, the matmul, the links are fine); only a
    real training step shows that one rank's replica trains otherwise. Under torchrun the
    training is a launch of its own across the launched processes."""
    out = tmp_path / "health.json"
    result = run_health("--json", str(out), fault=f"wrong_step@{rank}", torchrun=torchrun)
    assert result.returncode != 0, result.stdout + result.stderr
    assert result.stdout.count("UNHEALTHY: training failed") == 1
    got = statuses(json.loads(out.read_text()))
    assert got["training"] == ("fail", [rank])
    assert all(status == "pass" for name, (status, _) in got.items() if name not in ("training", "hardware", "transfers"))
    assert f"rank {rank} alone drifts" in result.stdout
    assert ("in the launch than on one device" in result.stdout) == torchrun
    if torchrun:
        assert result.stderr.count("exitcode  : 1") == 2  # every rank exits with the verdict


@pytest.mark.parametrize("torchrun", [False, pytest.param(True, marks=pytest.mark.breadth)], ids=["local", "torchrun"])
def test_pairwise_names_the_slow_link_between_rank_0_and_the_last_and_no_other_pair(torchrun, tmp_path):
    out = tmp_path / "health.json"
    extra = () if torchrun else ("--world-size", "4")
    result = run_health(*extra, "--sizes", "1,16", "--pairwise", "--json", str(out), fault="slow_link@0-3",
                        torchrun=torchrun, nproc=4)  # 16 MiB pairs: bandwidth, not scheduling, decides
    assert result.returncode != 0, result.stdout + result.stderr
    assert "UNHEALTHY: pairwise failed" in result.stdout
    data = json.loads(out.read_text())
    assert statuses(data)["pairwise"] == ("fail", [0, 3])
    assert [(p["a"], p["b"], p["unit"], p["network_only"]) for p in data["pairs"]] == \
        [(a, b, "rank", False) for a in range(4) for b in range(a + 1, 4)]
    slowest = min(data["pairs"], key=lambda p: p["busbw_gbps"])
    assert (slowest["a"], slowest["b"]) == (0, 3) and all(p["bytes"] == 16 << 20 for p in data["pairs"])
    assert "ranks 0-3" in result.stdout and "--pairwise" in result.stdout.split("reproduce:")[1]
    if torchrun:  # gloo: no NCCL transports to leave out, so no network-only row
        assert not any(c["name"] == "pairwise (network only)" for c in data["checks"])


@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.breadth)], ids=["rank0", "last"])
def test_long_holds_ranks_under_load_and_names_one_whose_bits_change_on_a_repeat(rank, tmp_path):
    out = tmp_path / "health.json"
    result = run_health("--long", "2", "--json", str(out), fault=f"flaky_bits@{rank}")
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert statuses(data)["stress"] == ("fail", [rank])
    assert statuses(data)["compute"] == ("pass", [])  # one bit of one repeat: only the stress pass sees it
    stress = {r["rank"]: r["stress"] for r in data["ranks"]}
    assert stress[rank]["matmul_mismatches"] == 1 and stress[rank]["first_mismatches"] == [3]
    assert stress[1 - rank]["matmul_mismatches"] == 0 and stress[0]["repeats"] == stress[1]["repeats"] >= 3
    assert all(s["seconds"] >= 2 and s["allreduce_errors"] == 0 for s in stress.values())
    assert f"rank {rank} cpu" in result.stdout and "unstable under load" in result.stdout
    assert "--long 2" in result.stdout.split("reproduce:")[1]


def test_the_reproduce_line_keeps_a_sites_thresholds(tmp_path):
    limits = tmp_path / "site limits.json"
    limits.write_text('{"temperature_c": 80}')
    result = run_health("--thresholds", str(limits), fault="wrong_allreduce@1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"--thresholds '{limits}'" in result.stdout.split("reproduce:")[1]


def test_on_a_terminal_the_live_line_follows_the_gates_phases():
    """The line is polled (every quarter second): a phase shorter than that may not show;
    the stress pass's two seconds always do."""
    from tests.e2e.test_cli import _through_a_terminal

    code, text = _through_a_terminal(["health", "--world-size", "3", "--sizes", "1,8", "--pairwise", "--long", "2"])
    assert code == 0, text
    shown = [part.strip("\x1b[K") for part in text.split("\r")]
    phases = [line[len("ddparity: health: "):] for line in shown if line.startswith("ddparity: health: ")]
    assert "stress" in phases, phases
    known = re.compile(r"(starting|hardware|collectives|compute|transfers|bandwidth|stress|pairwise)"
                       r"( · no progress for .*)?")
    assert all(known.fullmatch(p) for p in phases), phases


def test_a_drill_naming_a_rank_the_world_lacks_exits_2_before_starting():
    result = run_health("--pairwise", fault="slow_link@0-2")
    assert result.returncode == 2 and "drills a rank the world of 2 does not have" in result.stderr


def test_a_rank_that_never_arrives_is_a_hang_naming_it_in_time():
    started = time.monotonic()
    result = run_health("--timeout", "3", fault="hang@1")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "HANG:" in result.stdout and "suspect ranks: [1]" in result.stdout
    assert time.monotonic() - started < 60


def test_a_bandwidth_floor_fails_the_check():
    result = run_health("--min-busbw", "1000000")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "below --min-busbw 1e+06 GB/s" in result.stdout


def test_quiet_prints_the_verdict_line_even_when_a_repro_line_follows_it():
    result = run_health("-q", "--min-busbw", "1000000")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["UNHEALTHY: bandwidth failed"]


def _our_processes(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]


def test_under_torchrun_rank_0_reports_and_every_rank_agrees(tmp_path):
    out = tmp_path / "health.json"
    result = run_health("--json", str(out), torchrun=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("HEALTHY: 7 checks passed; hardware, transfers skipped") == 1  # rank 0 only
    data = json.loads(out.read_text())
    assert (data["launcher"], data["world_size"], data["healthy"]) == ("torchrun", 2, True)
    training = next(c for c in data["checks"] if c["name"] == "training")  # a launch of its own, every process
    modes = "ddp and fsdp" if torch_release() >= NEWER_TORCH else "ddp"
    assert training["detail"].startswith(f"a small MLP trains the same under {modes} at 2 rank(s) in the launch")
    assert all(r["training"]["exit"] == 0 for r in data["ranks"]) and "runs" in data["ranks"][0]["training"]


@pytest.mark.breadth  # (a failing gate under torchrun, every rank exiting with it: the training drill's test too)
def test_a_wrong_collective_under_torchrun_fails_every_rank():
    bad = run_health(torchrun=True, fault="wrong_allreduce@1")
    assert bad.returncode != 0 and "UNHEALTHY: collectives failed" in bad.stdout
    assert bad.stderr.count("exitcode  : 1") == 2  # every rank exits with the verdict


def test_a_hang_under_torchrun_ends_every_rank_with_its_stack(tmp_path):
    started = time.monotonic()
    result = run_health("--timeout", "4", "--json", str(tmp_path / "hang.json"), torchrun=True, fault="hang@1")
    assert result.returncode != 0
    assert time.monotonic() - started < 60  # not NCCL's 30 minutes
    failure = json.loads((tmp_path / "hang.json").read_text())["failure"]
    assert failure["status"] == "hang" and failure["hang"]["suspect_ranks"] == [1]
    assert "all_reduce" in failure["hang"]["ranks"]["0"]["collective"]  # where the other one waits
    assert "health/probe.py" in result.stdout  # every rank's stack in rank 0's report
    assert result.stderr.count("exitcode  : 3") == 2  # every rank exits with the verdict
    assert _our_processes(str(tmp_path)) == []


@pytest.mark.parametrize(("args", "message"), [
    (("--min-busbw", "-1"), "expected GB/s >= 0"),
    (("--sizes", "0"), "message sizes must be positive MiB"),
    (("--world-size", "0"), "expected a positive integer"),
    (("--backend", "threaded"), "need real processes"),
    (("--thresholds", "/no/such/limits.json"), "--thresholds '/no/such/limits.json': cannot read it"),
    (("--long", "0"), "--long: give a positive number of seconds, e.g. 30, got '0'"),
    (("--long", "soon"), "--long: give a positive number of seconds"),
])
def test_bad_input_exits_2(args, message):
    result = ddparity("health", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_bad_fault_drill_and_nccl_without_gpus_exit_2():
    result = run_health(fault="melt@1")
    assert result.returncode == 2 and "use KIND@RANK" in result.stderr
    if cuda_device_count() == 0:
        result = ddparity("health", "--backend", "nccl")
        assert result.returncode == 2 and "nccl" in result.stderr and "Traceback" not in result.stderr


def test_world_size_under_torchrun_is_a_usage_error():
    result = run_health("--world-size", "2", torchrun=True)
    assert result.returncode != 0
    assert "--world-size is torchrun's to decide here" in result.stderr


def test_a_rank_whose_peers_never_join_exits_3_in_time():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ddparity.cli", "health", "--timeout", "3"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "ddparity: rank 0: reaching the launch's store did not finish within 3 s" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60
