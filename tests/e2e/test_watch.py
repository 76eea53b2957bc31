"""``ddparity watch``: a training script nobody wrote for ddparity, run as it is on every
rank, as users run it — ``ddparity watch --nproc-per-node N script ARGS`` (ranks started
here), ``torchrun ... -m ddparity watch ...`` and two torchrun agents over loopback. Each
planted fault (:mod:`ddparity.fixtures.scripts`) on rank 0, 1 or the last one is found
with its rank; a clean run passes with the script's own output and exit code; no process
outlives a run, even when the launcher is killed."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import needs_newer_torch, wait_gone
from tests.e2e.test_torchrun import _env, _free_port, _ours

pytestmark = [pytest.mark.slow, needs_newer_torch, pytest.mark.usefixtures("no_leftover_processes")]

DDP = "ddparity.fixtures.scripts.ddp_train"
FSDP = "ddparity.fixtures.scripts.fsdp_train"


def watch(folder, nproc: int, *script: str, timeout: float = 60, module: bool = True,  # noqa: ANN001
          flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = folder / "watch.json"
    cmd = [sys.executable, "-m", "ddparity", "watch", "--nproc-per-node", str(nproc), "--timeout", f"{timeout:g}",
           "--json", str(out), *flags, *(["-m"] if module else []), *script]
    result = subprocess.run(cmd, cwd=folder, env=_env(folder), capture_output=True, text=True, timeout=240)
    assert not wait_gone(_ours(folder), 10), "processes of the watched run outlived it"
    assert [p.name for p in (folder / "tmp").glob("ddparity-*")] == [], "the run left files of ddparity's behind"
    return result, json.loads(out.read_text()) if out.exists() else None


def only_run(data: dict) -> dict:
    [run] = data["runs"]
    return run


def test_a_clean_ddp_script_passes_with_its_own_output_and_exit_code(tmp_path):
    result, data = watch(tmp_path, 2, DDP)
    assert result.returncode == 0, result.stderr
    assert "step 7: loss" in result.stdout  # the script's own output, on stdout
    assert "OK: no hang, crash, collective mismatch or replica drift" in result.stderr
    run = only_run(data)
    assert (run["mode"], run["world_size"], run["status"]) == ("ddp", 2, "pass")
    assert any("8 optimizer step(s) fingerprinted and compared across ddp replicas" in n for n in run["notes"])


GAN = "ddparity.fixtures.scripts.gan_train"


@pytest.mark.parametrize("skip_on", [None, -1], ids=["clean", "last-skips"])
def test_a_gan_with_two_ddp_models_names_each_and_a_rank_out_of_step(tmp_path, skip_on):
    """Two DDP models, two optimizers: two steps a batch. Their parameters were both named
    "0.weight" (each model's own names); a rank that skips one optimizer's step was a desync
    of "param 0.weight" four steps on, its cause unnamed."""
    result, data = watch(tmp_path, 2, GAN, *(["--skip-on", str(skip_on)] if skip_on is not None else []))
    run = only_run(data)
    if skip_on is None:
        assert result.returncode == 0 and run["status"] == "pass", result.stderr
        assert any("10 optimizer step(s) fingerprinted" in n for n in run["notes"]), run["notes"]
        return
    assert result.returncode == 1 and run["status"] == "desync", result.stderr
    assert run["desync"]["step"] == 4, run["desync"]  # the third batch's first step (two a batch)
    assert sorted(run["desync"]["differs"][:2]) == ["stepped the optimizer of Discriminator.net.0.weight",
                                                    "stepped the optimizer of Generator.net.0.weight"], run["desync"]
    assert "param Generator.net.0.weight" in run["desync"]["differs"], run["desync"]
    assert any(n.startswith("likely cause: the ranks' optimizer steps are out of step: at step 4") for n in run["notes"])


def test_an_optimizer_stepping_inside_backward_under_ddp_is_named_as_the_cause(tmp_path):
    """torch's optimizer-in-backward recipe (each parameter's optimizer steps in its
    post-accumulate-grad hook) under DDP steps before the all-reduce: a desync at step 0,
    whose cause was unnamed."""
    result, data = watch(tmp_path, 2, DDP, "--step-in-backward", "--steps", "3")
    run = only_run(data)
    assert result.returncode == 1 and run["status"] == "desync" and run["desync"]["step"] == 0, result.stderr
    assert run["desync"]["in_backward"] is True, run["desync"]
    assert any(n.startswith("likely cause: the optimizer stepped inside backward") for n in run["notes"]), run["notes"]


def test_the_scripts_argv_and_exit_code_pass_through_when_nothing_is_found(tmp_path):
    (tmp_path / "train.py").write_text(
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(2))\n"
        "print(f'argv {sys.argv[1:]} {__name__}', flush=True)\n"
        "dist.destroy_process_group()\n"
        "sys.exit(5)\n")
    result, data = watch(tmp_path, 2, "train.py", "--lr", "0.1", "--timeout", "3", module=False, flags=("-q",))
    assert result.returncode == 5, result.stderr
    assert "OK: no hang" in result.stderr and "ddparity watch:" not in result.stderr  # -q: the verdict line alone
    assert result.stdout.count("argv ['--lr', '0.1', '--timeout', '3'] __main__") == 2
    assert only_run(data)["status"] == "pass"
    assert any("exit code(s), passed through: {0: 5, 1: 5}" in n for n in only_run(data)["notes"])


def test_an_optimizer_subclass_calling_super_step_is_fingerprinted_once_per_step(tmp_path):
    """Once ``SGD.step`` is hooked (a plain SGD built first), torch runs the global step hook
    in the subclass's ``step`` and again in its ``super().step()``, and a wrapper stepping
    its base optimizer runs it in both: one step, fingerprinted once (it was counted as
    two, then three)."""
    (tmp_path / "train.py").write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Clipped(torch.optim.SGD):\n"
        "    def step(self, closure=None):\n"
        "        torch.nn.utils.clip_grad_norm_(self.param_groups[0]['params'], 1.0)\n"
        "        return super().step(closure)\n"
        "class Ahead(torch.optim.Optimizer):  # a wrapper stepping its base, as timm's Lookahead\n"
        "    def __init__(self, base):\n"
        "        super().__init__(base.param_groups, {})\n"
        "        self.base, self.param_groups = base, base.param_groups\n"
        "    def step(self, closure=None):\n"
        "        return self.base.step(closure)\n"
        "dist.init_process_group('gloo')\n"
        "torch.manual_seed(0)\n"
        "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
        "model = DDP(torch.nn.Linear(4, 2))\n"
        "optimizer = Ahead(Clipped(model.parameters(), lr=0.1))\n"
        "for step in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.randn(8, 4)).square().mean().backward()\n"
        "    optimizer.step()\n"
        "dist.destroy_process_group()\n")
    result, data = watch(tmp_path, 2, "train.py", module=False)
    assert result.returncode == 0, result.stderr
    assert any("3 optimizer step(s) fingerprinted and compared across ddp replicas" in n
               for n in only_run(data)["notes"]), only_run(data)["notes"]


def test_a_rank_that_stops_is_a_hang_naming_it_with_every_ranks_place_and_stack(tmp_path):
    result, data = watch(tmp_path, 3, DDP, "--fault", "hang", "--on", "-1", timeout=5)
    assert result.returncode == 3, result.stderr
    run = only_run(data)
    assert run["status"] == "hang"
    assert run["hang"]["suspect_ranks"] == [2]
    places = run["hang"]["ranks"]
    assert "DDP gradient bucket 0" in places["0"]["collective"]
    # native frames (py-spy on itself): where rank 0 waits inside DDP's reducer, where rank 2 sleeps
    assert "planted.py:" in places["2"]["stack"] and "(libc.so" in places["2"]["stack"]
    assert "ddp_train.py:" in places["0"]["stack"] and "c10d::Reducer" in places["0"]["stack"]
    flight = run["hang"]["flight_recorder"]  # each rank's own Flight Recorder: rank 2 never issued the all-reduce
    assert (flight["finding"], flight["not_issued_by"], flight["issued_by"]) == ("host", [2], [0, 1])
    assert flight["collective"].startswith("gloo:all_reduce(float[")


def test_a_rank_that_raises_is_a_crash_with_its_traceback_from_the_script(tmp_path):
    result, data = watch(tmp_path, 2, DDP, "--fault", "raise", "--on", "0")
    assert result.returncode == 3, result.stderr
    crash = only_run(data)["crash"]
    assert crash["rank"] == 0
    assert "ValueError: batch 2 on rank 0: labels out of range" in crash["error"]
    assert 'ddp_train.py", line' in crash["traceback"] and "runpy" not in crash["traceback"]


def test_a_killed_rank_is_a_crash_naming_it(tmp_path):
    result, data = watch(tmp_path, 2, DDP, "--fault", "die", "--on", "1")
    assert result.returncode == 3, result.stderr
    run = only_run(data)
    assert (run["status"], run["crash"]["rank"]) == ("crash", 1)


def test_a_broadcast_of_another_size_on_the_last_rank_is_a_desync_with_its_source_line(tmp_path):
    """... and the ranks' ledgers, written as Flight Recorder dumps, show PyTorch's own
    analyser the same mismatch at the same collective."""
    result, data = watch(tmp_path, 3, DDP, "--fault", "mismatch", "--on", "-1", flags=("--flight-recorder", "fr"))
    assert result.returncode == 1, result.stderr
    desync = only_run(data)["desync"]
    assert desync["ranks"] == [2]
    issued = desync["collective"]["ranks"]["2"]
    assert issued["collective"].startswith("broadcast(tensor=float32[5], root=0)")
    assert issued["site"].startswith("ddparity/fixtures/scripts/planted.py:")
    assert sorted(p.name for p in (tmp_path / "fr").iterdir()) == ["ddparity_fr_0", "ddparity_fr_1", "ddparity_fr_2"]
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "fr"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    shown = fr.stdout + fr.stderr  # its analysis is logged
    seq = desync["collective"]["seq"] + 1  # Flight Recorder counts from 1
    issued = {int(p.name[-1]) for p in (tmp_path / "fr").iterdir()
              if any(e["collective_seq_id"] == seq for e in pickle.loads(p.read_bytes())["entries"])}
    if issued == {0, 1, 2}:
        assert f"Collective sequence number: {seq} has errors" in shown and "COLLECTIVE_TYPE_MISMATCH" in shown, shown
    else:  # rank 0 was stopped before it issued its all-reduce: the analyser says it is missing
        assert f"Not all ranks joining collective, sequence number: {seq}" in shown, (issued, shown)
        assert "missing ranks: {0}" in shown, (issued, shown)
    errors = shown.count("has errors")
    if issued == {0, 1, 2}:
        assert errors == 1, shown  # those before it completed everywhere
    else:  # rank 0 may be stopped before it saw its step's gradient all-reduce (DDP's bucket) complete
        assert errors == 0 or (errors == 1 and f"Collective sequence number: {seq - 1} has errors" in shown
                                and "COLLECTIVE_STATE_MISMATCH" in shown and "found state: 'started'" in shown), shown
    assert "planted.py:" in shown


def test_a_metric_all_reduced_on_rank_0_alone_is_a_desync_naming_rank_0(tmp_path):
    result, data = watch(tmp_path, 2, DDP, "--fault", "rank_only", "--on", "0")
    assert result.returncode == 1, result.stderr
    assert only_run(data)["desync"]["ranks"] == [0]


def test_a_rank_local_learning_rate_is_replica_drift_from_the_next_step(tmp_path):
    result, data = watch(tmp_path, 3, DDP, "--fault", "drift", "--on", "1")
    assert result.returncode == 1, result.stderr
    run = only_run(data)
    desync = run["desync"]
    assert (desync["step"], desync["ranks"]) == (3, [1])
    assert "param 0.weight" in desync["what"]
    [cause] = [n for n in run["notes"] if n.startswith("likely cause")]
    assert cause.startswith("likely cause: the optimizer's lr differs between the ranks at step 3 ([1] against "
                            "[0, 2])"), cause


@pytest.mark.parametrize("on", [0, pytest.param(-1, marks=pytest.mark.breadth)], ids=["rank0", "last"])
def test_a_nan_on_one_of_two_ranks_names_that_rank(tmp_path, on):
    """Two ranks that disagree: nothing in the fingerprints says which is wrong, but a NaN
    in one rank's parameters does."""
    result, data = watch(tmp_path, 2, DDP, "--fault", "nan", "--on", str(on))
    assert result.returncode == 1, result.stderr
    desync = only_run(data)["desync"]
    assert (desync["step"], desync["ranks"]) == (2, [on % 2]), desync
    assert f"(rank {on % 2}'s parameters hold a NaN or inf, the other's none)" in desync["what"]


def test_an_fsdp2_script_passes_and_says_its_shards_have_no_replicas(tmp_path):
    result, data = watch(tmp_path, 2, FSDP, flags=("--flight-recorder", "fr"))
    assert result.returncode == 0, result.stderr
    run = only_run(data)
    assert (run["mode"], run["status"]) == ("fsdp", "pass")
    assert any("no replicas to compare" in n for n in run["notes"])
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "fr"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    assert fr.returncode == 0 and "has errors" not in fr.stdout + fr.stderr, fr.stdout + fr.stderr  # 66 agree


@pytest.mark.breadth
def test_an_fsdp2_script_with_a_collective_on_rank_0_alone_is_a_desync(tmp_path):
    result, data = watch(tmp_path, 2, FSDP, "--fault", "rank_only", "--on", "0")
    assert result.returncode == 1, result.stderr
    desync = only_run(data)["desync"]
    assert desync["ranks"] == [0]


@pytest.mark.breadth
def test_hsdp_replicas_of_one_shard_drifting_apart_are_a_desync_of_that_shard(tmp_path):
    result, data = watch(tmp_path, 4, FSDP, "--replicas", "2", "--fault", "drift", "--on", "-1", timeout=20)
    assert result.returncode == 1, result.stderr
    run = only_run(data)
    assert run["mode"] == "hsdp"
    assert run["desync"]["ranks"] == [1, 3]  # shard 1's two replicas: a tie, both named
    assert "[shard 1]" in run["desync"]["what"]


@pytest.mark.breadth
def test_one_rank_alone_passes_and_claims_no_comparison(tmp_path):
    result, data = watch(tmp_path, 1, DDP, "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert any("no replicas to compare" in n for n in only_run(data)["notes"])


def test_usage_errors_name_the_fix_before_any_rank_starts(tmp_path):
    cases = [(["watch", "train.py"], "no such script: 'train.py'"),
             (["watch", "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
             (["watch", "-m", DDP], "say how many ranks: ddparity watch --nproc-per-node N"),
             (["watch", "--nproc-per-node", "2", "--json", "-", "-m", DDP], "--json - would mix the JSON")]
    for argv, message in cases:
        result = subprocess.run([sys.executable, "-m", "ddparity", *argv], cwd=tmp_path, env=_env(tmp_path),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


def test_under_torchrun_a_crash_on_rank_1_is_reported_once_and_every_worker_ends(tmp_path):
    out = tmp_path / "watch.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ddparity",
           "watch", "--timeout", "8", "--json", str(out), "-m", DDP, "--fault", "raise", "--on", "1"]
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert not wait_gone(_ours(tmp_path), 10)
    assert result.returncode != 0
    assert result.stderr.count("ddparity watch: ddparity.fixtures.scripts.ddp_train") == 1
    assert only_run(json.loads(out.read_text()))["crash"]["rank"] == 1


def test_two_torchrun_agents_over_loopback_watch_one_script(tmp_path):
    """Two "nodes" (torchrun agents meeting at a c10d rendezvous on 127.0.0.1), one rank
    each: a clean run passes, a rank-local learning rate on the second node is drift."""
    for fault, code in (([], 0), (["--fault", "drift", "--on", "1"], 1)):
        out = tmp_path / "watch.json"
        port = _free_port()
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                    "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                    "--rdzv-id", "w", "-m", "ddparity", "watch", "--timeout", "20", "--json", str(out),
                                    "-m", DDP, *fault], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [agent.communicate(timeout=240) for agent in agents]
        assert not wait_gone(_ours(tmp_path), 10)
        run = only_run(json.loads(out.read_text()))
        assert run["status"] == ("pass" if code == 0 else "desync"), results
        if code:
            assert run["desync"]["ranks"] == [0, 1]  # two replicas: nothing shows which one is wrong
            assert "param 0.weight" in run["desync"]["what"]
        assert [a.returncode != 0 for a in agents] == [bool(code)] * 2, results
        out.unlink()


def test_killing_the_launcher_mid_hang_leaves_no_rank_behind(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "ddparity", "watch", "--nproc-per-node", "2", "--timeout", "120",
                                 "-m", DDP, "--fault", "hang", "--on", "1"], cwd=tmp_path, env=_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import threading

    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(launcher.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    # rank 0 prints "step 1" after the step's all-reduce; rank 1 then sleeps at step 2
    # before its backward, rank 0 waits for it there: both ranks are mid-hang (not assumed
    # from a sleep: on a loaded machine the imports alone may take longer)
    while not any(line.startswith("step 1:") for line in printed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(line.startswith("step 1:") for line in printed), printed
    time.sleep(0.5)
    ranks = _ours(tmp_path) - {launcher.pid}
    assert len(ranks) >= 2
    launcher.send_signal(signal.SIGKILL)
    launcher.communicate(timeout=30)
    assert not wait_gone(ranks, 15), "ranks outlived their killed launcher"


STALLED = "ddparity.fixtures.scripts.stalled"


def _blamed(tmp_path, nproc: int, where: str, on: int, *more: str) -> None:
    result, data = watch(tmp_path, nproc, STALLED, "--where", where, "--on", str(on), *more, timeout=4)
    run = only_run(data)
    assert result.returncode == 3 and run["status"] == "hang", result.stderr
    culprit = on % nproc
    assert run["hang"]["suspect_ranks"] == [culprit], (where, on, run["hang"])
    flight = run["hang"]["flight_recorder"]
    assert flight["not_issued_by"] == [culprit], flight  # the Flight Recorder agrees


@pytest.mark.parametrize("where, on", [("data", 0), pytest.param("end", -1, marks=pytest.mark.breadth)])
def test_a_rank_stalled_before_its_forward_is_blamed_not_the_ranks_waiting_for_it(tmp_path, where, on):
    """A rank that stops between steps still shows the phase it last set (the last step's
    optimizer); the ranks it leaves waiting issued one collective more: they are ahead.
    (The last rank's stop is the default suite's other watched hang.)"""
    _blamed(tmp_path, 2, where, on)


@pytest.mark.breadth
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("on", [0, -1])
@pytest.mark.parametrize("where", ["data", "forward", "inforward", "backward", "step", "inoptim", "end"])
def test_the_hang_blame_matrix(tmp_path, nproc, on, where):
    """Every place of a step, on rank 0 and on the last rank, at 2 and 3 ranks: the stalled
    rank is named, as its Flight Recorder says."""
    _blamed(tmp_path, nproc, where, on)


@pytest.mark.breadth
@pytest.mark.parametrize("on", [0, -1])
@pytest.mark.parametrize("where", ["forward", "backward", "inoptim"])
def test_the_hang_blame_under_hsdp_names_the_stalled_rank_not_its_shard_groups_peer(tmp_path, on, where):
    """FSDP2 on a 2 x 2 mesh: the stalled rank's shard-group peer waits in FSDP's all-gather
    as far behind as the culprit (suspects were [0, 1] for rank 0); the Flight Recorder's
    finding is the end of the chain of waits (it named rank 2, waiting for rank 3, as the
    host-side hang of the replicate group)."""
    _blamed(tmp_path, 4, where, on, "--hsdp")
