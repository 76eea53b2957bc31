"""``ddparity check`` and ``profile`` inside a launch, as users run them on a cluster:
``python -m torch.distributed.run --standalone --nproc-per-node 2 -m ddparity check ...``,
two torchrun agents forming one world over loopback (two "nodes": the second cannot use
the first one's spool), and processes started with only the ``env://`` variables (what
``srun`` or a hand-written launcher gives). Verdicts, exit codes of every process, and no
process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import needs_newer_torch, wait_gone

pytestmark = [pytest.mark.slow, needs_newer_torch]  # every test starts torchrun and torch in 3+ processes

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def _env(folder) -> dict[str, str]:  # noqa: ANN001
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    # torchrun's log folders and ddparity's spools in the test's folder (checked by _spools)
    (folder / "tmp").mkdir(exist_ok=True)
    env["TMPDIR"] = str(folder / "tmp")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(folder) -> set[int]:  # noqa: ANN001
    """Processes running in ``folder`` (every process a launch in it started)."""
    out = set()
    for proc in psutil.process_iter(["cwd"]):
        try:
            if proc.info["cwd"] == str(folder) and proc.pid != os.getpid():
                out.add(proc.pid)
        except psutil.Error:
            pass
    return out


def _spools(folder) -> list[str]:  # noqa: ANN001
    """ddparity's spools a launch left in its folder (none may outlive it)."""
    return [p.name for p in (folder / "tmp").glob("ddparity-spool-*")]


def _worker_exit_codes(stderr: str) -> list[int]:
    """The exit codes torchrun's failure summary lists for its workers."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]


def torchrun(folder, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float, dict | None]:  # noqa: ANN001
    out = folder / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ddparity",
           *args, "--json", str(out)]
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=folder, env=_env(folder), capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - started
    assert not wait_gone(_ours(folder), 10), "processes of the launch outlived it"
    assert _spools(folder) == []
    data = json.loads(out.read_text()) if out.exists() else None
    return result, seconds, data


def ddp_run(data: dict) -> dict:
    [run] = [r for r in data["runs"] if r["mode"] == "ddp"]
    return run


def test_a_clean_case_passes_and_every_rank_exits_0(tmp_path):
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.models:mlp_sgd", "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert data["ok"] and [(r["mode"], r["world_size"], r["status"]) for r in data["runs"]] == [
        ("single", 1, "pass"), ("ddp", 2, "pass")]
    assert result.stdout.count("ddparity check:") == 1  # rank 0 alone prints the report
    assert "launched: 2 processes" in result.stdout


@pytest.mark.parametrize("target, cause, where", [
    # (the README's launch, tests/e2e/test_readme.py, runs a summed loss in the default suite)
    pytest.param("bugs:summed_loss", "a loss summed over the batch (reduction='sum')", ("loss", 0),
                 marks=pytest.mark.breadth),
    pytest.param("bugs:loss_over_world_size", "a mean loss divided by the world size on every rank", ("loss", 0),
                 marks=pytest.mark.breadth),
    # (a module named under a launch: test_the_module_that_differs_on_the_last_rank_alone_is_named_on_it)
    pytest.param("bugs:batchnorm_on_shards", "BatchNorm on shards", ("forward", 0, "bn", "aten.native_batch_norm.default"),
                 marks=pytest.mark.breadth),
])
def test_a_data_parallel_bug_diverges_with_its_cause_and_every_rank_exits_1(tmp_path, target, cause, where):
    """The verdict, its cause, and where it first differs: every rank of the launch re-ran
    the first differing step module by module once rank 0 judged it."""
    result, _, data = torchrun(tmp_path, "check", f"ddparity.fixtures.{target}", "--steps", "2")
    run = ddp_run(data)
    assert run["status"] == "diverged" and run["first_divergence"]["step"] == 0
    assert cause in result.stdout
    assert ("evidence: on one device, the first batch given twice" in result.stdout) == ("loss" in target)
    module = run["first_divergence"]["module"]
    assert (module["phase"], module["rank"], module.get("module"), module.get("op"))[:len(where)] == where, module
    assert ("first differing module: bn" if module["phase"] == "forward" else "first to differ: the loss") in \
        result.stdout
    assert result.returncode == 1 and set(_worker_exit_codes(result.stderr)) == {1}


RERUN_RAISES = """
import torch
from torch import nn
from ddparity import Case
from ddparity.fixtures.models import MLP, regression

TRAININGS = []


def step(model, batch, optimizer, ctx):
    if ctx.step == 0 and ctx.rank == ctx.world_size - 1 and ctx.world_size > 1:
        TRAININGS.append(1)
        if len(TRAININGS) > 1:
            raise RuntimeError("only in the re-run")
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    optimizer.step()
    return loss.detach()


def case():
    return Case(model=MLP, data=regression, optimizer="sgd", lr=0.01, steps=2, train_step=step)
"""


def test_a_rerun_that_fails_on_the_last_rank_is_a_note_and_the_verdict_stands(tmp_path):
    """The re-run is the launch's last stage, after rank 0 judged: its failure on a rank is a
    note of the report (never a finding, never a hang), every process exits with the verdict."""
    (tmp_path / "rerun_raises.py").write_text(RERUN_RAISES)
    result, _, data = torchrun(tmp_path, "check", "rerun_raises.py:case")
    run = ddp_run(data)
    assert run["status"] == "diverged" and "module" not in run["first_divergence"], result.stdout
    assert any(n.startswith("first differing module: not found (the re-run of step 0 failed: rank 1: RuntimeError: "
                            "only in the re-run") for n in run["notes"]), run["notes"]
    assert result.returncode == 1 and set(_worker_exit_codes(result.stderr)) == {1}


def test_the_module_that_differs_on_the_last_rank_alone_is_named_on_it(tmp_path):
    """A replica moved on the last rank only: the re-run names that rank and the module whose
    output first differs there (rank 0's own re-run agrees)."""
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.bugs:replica_nudged", "--steps", "2")
    module = ddp_run(data)["first_divergence"]["module"]
    assert (module["phase"], module["rank"], module["module"]) == ("forward", 1, "net.0"), result.stdout
    assert result.returncode == 1


def test_sharded_modes_run_after_ddp_in_one_launch_each_judged_with_its_cause(tmp_path):
    """--modes ddp,fsdp,hsdp: one launch, one stage a mode, each judged against the same
    reference; a parameter left out of sharding is FSDP's bug only (ddp passes), caught
    in fsdp and in an hsdp mesh of 2 replicas x 1 shard, cause named."""
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.sharded:ignored_param", "--modes",
                               "single,ddp,fsdp,hsdp", "--hsdp-shard", "1", "--steps", "2")
    assert [(r["mode"], r["status"]) for r in data["runs"]] == [
        ("single", "pass"), ("ddp", "pass"), ("fsdp", "diverged"), ("hsdp", "diverged")], result.stdout
    for run in data["runs"][2:]:
        assert run["first_divergence"]["step"] == 0
        assert any("left out of sharding" in n for n in run["notes"])
        module = run["first_divergence"]["module"]  # every rank re-ran each sharded mode's step in the launch
        assert (module["phase"], module["module"]) == ("backward", "net.4"), module
    assert "--modes hsdp --hsdp-shard 1" in data["runs"][3]["repro"]
    assert result.returncode == 1 and set(_worker_exit_codes(result.stderr)) == {1}


def test_a_stuck_rank_is_a_hang_naming_it_and_ends_every_rank_in_time(tmp_path):
    result, seconds, data = torchrun(tmp_path, "check", "ddparity.fixtures.faults:stuck_rank", "--timeout", "5")
    run = ddp_run(data)
    assert run["status"] == "hang" and run["hang"]["suspect_ranks"] == [1]
    stack = run["hang"]["ranks"]["1"]["stack"]
    # the stuck rank's own stack with native frames, less python -m's and ddparity's frames
    assert "time_sleep" in stack and "ddparity/fixtures/faults.py:" in stack
    assert "<frozen runpy>" not in stack and "frames of ddparity's own" in stack and "stepping.py" not in stack
    assert "all_reduce" in run["hang"]["ranks"]["0"]["collective"]  # and where the other waits
    assert "(libtorch_cpu.so)" in run["hang"]["ranks"]["0"]["stack"]  # inside gloo or DDP's reducer
    flight = run["hang"]["flight_recorder"]  # the ranks' own Flight Recorders agree: rank 1 never issued it
    assert (flight["finding"], flight["not_issued_by"], flight["issued_by"]) == ("host", [1], [0])
    assert set(_worker_exit_codes(result.stderr)) == {3}
    assert seconds < 90  # the process group's own timeout would be 30 minutes


def test_a_raising_rank_is_a_crash_with_its_traceback(tmp_path):
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.faults:raising_rank")
    run = ddp_run(data)
    assert run["status"] == "crash" and run["crash"]["rank"] == 1
    assert "injected fault: rank 1 raised at step 1" in run["crash"]["traceback"]
    assert set(_worker_exit_codes(result.stderr)) == {3}


def test_a_dead_rank_is_a_crash_naming_it_not_the_peer_that_lost_it(tmp_path):
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.faults:exiting_rank")
    run = ddp_run(data)
    assert run["status"] == "crash" and run["crash"]["rank"] == 1
    assert "rank 1 (pid" in run["crash"]["error"] and "died" in run["crash"]["error"]
    assert 7 in _worker_exit_codes(result.stderr)  # torchrun's summary: the fault's own exit code


def test_a_skipped_collective_is_a_desync_naming_the_rank(tmp_path):
    _, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.faults:skipped_collective", "--timeout", "20")
    run = ddp_run(data)
    assert run["status"] == "desync" and run["desync"]["ranks"] == [1], run


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_experts_idle_on_some_ranks_are_named_under_a_launch(tmp_path, mode):
    """A mixture of experts that skips experts no token was routed to: under DDP the rank that
    reached optimizer.step() with the reduction unfinished names them (gloo had aborted every
    rank on a size mismatch); under FSDP2 the desync of its reduce-scatters names them, as a
    local check does (the launch's failure report had no cause)."""
    _, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.moe:idle_experts", "--modes", mode, "--timeout", "30")
    [run] = [r for r in data["runs"] if r["mode"] == mode]
    if mode == "ddp":
        assert run["status"] == "crash" and "find_unused_parameters" in run["crash"]["error"], run
        assert "did not all-reduce every gradient of step 0" in run["crash"]["error"]
        return
    assert run["status"] == "desync", run
    assert any(n.startswith("likely cause: parameters used on some ranks only") for n in run["notes"]), run["notes"]


STALLS = "from ddparity.fixtures import faults\n" + "".join(
    f"def {where}_{'first' if on == 0 else 'last'}(): return faults.stalled_at({where!r}, {on})\n"
    for where in ("data", "forward", "inforward", "backward", "step", "inoptim", "end") for on in (0, -1))


@pytest.mark.breadth
@pytest.mark.parametrize("where, on", [
    (w, on) for w in ("data", "forward", "inforward", "backward", "step", "inoptim", "end") for on in ("first", "last")])
def test_the_rank_that_stalls_is_blamed_at_every_place_of_a_step(tmp_path, where, on):
    """The hang blame matrix under torchrun: rank 0 (which holds the reference and reports)
    or the last rank stalls at one place of step 1; the suspect is that rank, and the ranks'
    own Flight Recorders agree where they saw a collective the stalled rank never issued.
    (The default suite's launches hang rank 0 and the last rank in forward:
    ``test_a_fault_on_rank_0_...[stuck]`` and ``test_a_stuck_rank_is_a_hang_...``.)"""
    (tmp_path / "stalls.py").write_text(STALLS)
    _, _, data = torchrun(tmp_path, "check", f"stalls.py:{where}_{on}", "--timeout", "5")
    run = ddp_run(data)
    stalled = 0 if on == "first" else 1
    assert run["status"] == "hang" and run["hang"]["suspect_ranks"] == [stalled], run["hang"]
    flight = run["hang"].get("flight_recorder")
    if flight is not None and flight["finding"] == "host":
        assert flight["not_issued_by"] == [stalled], flight


RANK_0_FAULTS = """
from ddparity.fixtures import faults

def stuck(): return faults.stuck_rank(0)
def raising(): return faults.raising_rank(0)
def exiting(): return faults.exiting_rank(0)
def skipped(): return faults.skipped_collective(0)
def straggler(): return faults.straggler(0)
"""


@pytest.mark.parametrize("fault", ["stuck", *(pytest.param(f, marks=pytest.mark.breadth)
                                                for f in ("raising", "exiting", "skipped", "straggler"))])
def test_a_fault_on_rank_0_the_reporting_rank_is_reported_and_blamed_on_it(tmp_path, fault):
    """Rank 0 holds the reference and prints the report: its own fault must still be
    reported, by rank 0 or for it, naming rank 0 (the other tests put it on rank 1 = W-1)."""
    (tmp_path / "rank0.py").write_text(RANK_0_FAULTS)
    result, _, data = torchrun(tmp_path, "check", f"rank0.py:{fault}", "--timeout", "5")
    assert data is not None and result.stdout.count("ddparity check:") == 1, result.stdout + result.stderr
    run = ddp_run(data)
    if fault == "stuck":
        assert run["status"] == "hang" and run["hang"]["suspect_ranks"] == [0], run
    elif fault in ("raising", "exiting"):
        assert run["status"] == "crash" and run["crash"]["rank"] == 0, run
        assert "injected fault: rank 0 raised" in run["crash"]["traceback"] if fault == "raising" \
            else "rank 0 (pid" in run["crash"]["error"]
    elif fault == "straggler":
        assert run["status"] == "pass" and "straggler: rank 0 arrived last" in result.stdout, result.stdout
    else:
        assert run["status"] == "desync" and run["desync"]["ranks"] == [0], run
    assert (result.returncode == 0) == (fault == "straggler")


def test_profile_times_rank_0_alone_then_the_launch_in_ddp_and_fsdp_with_ddps_settings_swept(tmp_path):
    """The launch's own table: rank 0 alone (each arm's scaling baseline), then the launch,
    arm after arm in the same process group: DDP's bucket caps swept (the known answer: the
    same gradient bytes a step, fewer buckets as the cap grows), PowerSGD over gloo a skipped
    row saying why, FSDP's all-gathers and reduce-scatters."""
    result, _, data = torchrun(tmp_path, "profile", "ddparity.fixtures.models:profile_demo", "--modes", "ddp,fsdp",
                               "--bucket-cap-mb", "1,100", "--comm-hook", "powersgd", "--steps", "3", "--warmup", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [(r["arm"] or r["mode"], r["world_size"], r["status"]) for r in data["runs"]] == [
        ("ddp bucket 1 MB", 1, "ok"), ("ddp bucket 1 MB", 2, "ok"), ("ddp bucket 100 MB", 1, "ok"),
        ("ddp bucket 100 MB", 2, "ok"), ("ddp powersgd hook", 2, "skipped"), ("fsdp", 1, "ok"), ("fsdp", 2, "ok")]
    small, large, fsdp = data["runs"][1], data["runs"][3], data["runs"][6]
    assert small["busbw_gbps"] > 0 and small["bytes_per_step"] == large["bytes_per_step"]
    assert small["buckets"] >= 3 and large["buckets"] == 1 == large["ddp_logging"]["buckets"], (small, large)
    assert "not timed over gloo" in data["runs"][4]["reason"]
    assert {c["op"] for c in fsdp["collectives"]} == {"all_gather", "reduce_scatter"}
    assert fsdp["memory_per_rank"]["params"] < small["memory_per_rank"]["params"]
    assert "recommendation: " in result.stdout


def test_options_torchrun_decides_are_usage_errors_on_every_rank(tmp_path):
    result, _, data = torchrun(tmp_path, "check", "ddparity.fixtures.models:mlp_sgd", "--world-sizes", "2")
    assert data is None and "--world-sizes is torchrun's to decide here" in result.stderr
    assert 2 in _worker_exit_codes(result.stderr)


def _two_nodes(folder, *args: str) -> tuple[list[subprocess.CompletedProcess], dict | None]:  # noqa: ANN001
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1."""
    out = folder / "report.json"
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t",
                                "-m", "ddparity", *args, "--json", str(out)],
                               cwd=folder, env=_env(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = []
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    assert not wait_gone(_ours(folder), 10)
    assert _spools(folder) == []
    return results, json.loads(out.read_text()) if out.exists() else None


def test_two_nodes_on_loopback_compare_the_remote_rank_against_the_served_reference(tmp_path):
    """The remote rank (node 1) compares against the reference served by rank 0, and, when a
    step differs, re-runs it module by module against the reference's record fetched from
    rank 0 (the initial state and the record, into a spool of its own, removed after): a
    replica nudged on that rank alone is named there, at its module."""
    agents, data = _two_nodes(tmp_path, "check", "ddparity.fixtures.bugs:replica_nudged", "--steps", "2")
    run = ddp_run(data)
    assert run["status"] in ("diverged", "desync"), run
    assert any("compared against the reference served by rank 0" in n for n in run["notes"])
    module = run["first_divergence"]["module"]
    assert (module["phase"], module["rank"], module["module"]) == ("forward", 1, "net.0"), run["notes"]
    assert [a.returncode for a in agents] == [1, 1]
    # a pass needs every tensor of every step compared on every rank (one never compared is
    # an infinite distance): the served rank compared them all
    clean, data = _two_nodes(tmp_path, "check", "ddparity.fixtures.models:mlp_sgd", "--steps", "2")
    assert data["ok"] and [a.returncode for a in clean] == [0, 0]
    assert any("compared against the reference served by rank 0" in n for n in ddp_run(data)["notes"])


@pytest.mark.breadth
def test_two_nodes_fsdp_under_a_bf16_policy_compares_served_shards_without_a_false_alarm(tmp_path):
    """FSDP2 with bf16 parameters across two agents: the remote rank compares its shards
    with slices of the reference served by rank 0 (every one: one left out is an infinite
    distance), within the tolerance of the policy's own noise, measured on rank 0 alone."""
    agents, data = _two_nodes(tmp_path, "check", "ddparity.fixtures.sharded:transformer_bf16", "--modes", "fsdp",
                              "--steps", "2")
    [run] = data["runs"]
    assert run["status"] == "pass" and [a.returncode for a in agents] == [0, 0], agents[0].stdout
    assert "bfloat16 policy" in run["tolerance"]
    assert any("compared against the reference served by rank 0" in n for n in run["notes"])


def test_a_rank_dead_on_another_node_is_found_by_its_silence(tmp_path):
    agents, data = _two_nodes(tmp_path, "check", "ddparity.fixtures.faults:exiting_rank")
    run = ddp_run(data)
    assert run["status"] == "crash" and run["crash"]["rank"] == 1
    assert "stopped beating" in run["crash"]["error"]


def test_a_mismatch_that_aborts_the_store_holders_node_is_still_a_desync(tmp_path):
    """gloo aborts rank 0 over the mismatched collective; when its node's agent held the
    store, the store goes with it: rank 1 reports from the positions it last saw."""
    agents, data = _two_nodes(tmp_path, "check", "ddparity.fixtures.faults:skipped_collective", "--timeout", "20")
    run = ddp_run(data)
    assert run["status"] == "desync" and run["desync"]["ranks"] == [1], run
    assert sorted(a.returncode for a in agents) == [1, 1]


def _env_launch(folder, *args: str, world_size: int = 2) -> list[subprocess.Popen]:  # noqa: ANN001
    """Processes given only RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 holds the store)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {**_env(folder), "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "ddparity", *args], cwd=folder, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("target, code", [("bugs:summed_loss", 1), ("faults:raising_rank", 3)])
def test_every_process_of_an_env_launch_exits_with_the_verdicts_code(tmp_path, target, code):
    procs = _env_launch(tmp_path, "check", f"ddparity.fixtures.{target}", "--steps", "2", "--timeout", "5")
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [code, code], outputs
    assert outputs[0][0].count("ddparity check:") == 1 and "ddparity check:" not in outputs[1][0]
    assert not wait_gone(_ours(tmp_path), 10)
    assert _spools(tmp_path) == []


def test_a_launch_whose_agent_is_killed_leaves_no_process(tmp_path):
    """torchrun's agent holds the store; SIGKILL it mid-check and its workers, which it can
    no longer stop, notice the store is gone and exit on their own."""
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "ddparity", "check", "ddparity.fixtures.faults:stuck_rank", "--timeout", "60"],
                             cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_ours(tmp_path) - {agent.pid}) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(8)  # the workers are training (rank 1 is stuck)
    workers = _ours(tmp_path) - {agent.pid}
    assert len(workers) >= 2
    agent.send_signal(signal.SIGKILL)
    _, stderr = agent.communicate(timeout=30)
    assert not wait_gone(workers, 15), "workers outlived their killed agent"


def test_srun_tasks_are_a_launch_and_a_missing_master_addr_names_the_fix(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**_env(tmp_path), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NNODES": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.bugs:summed_loss",
                                       "--steps", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert "launched: 2 processes on 1 node(s)" in outputs[0][0]
    env = {**_env(tmp_path), "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    bad = subprocess.run([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.models:mlp_sgd"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "under srun, set MASTER_ADDR and MASTER_PORT" in bad.stderr


def test_nccl_without_a_gpu_in_a_launch_is_a_usage_error(tmp_path):
    env = {**_env(tmp_path), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.models:mlp_sgd", "--backend",
                             "nccl"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "backend nccl: LOCAL_RANK 0 but 0 CUDA device(s) visible" in result.stderr
