"""The CLI as a user runs it: subprocesses, exit codes, reports, and no tracebacks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ddparity.harness.world.rendezvous import cuda_device_count

USER_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from ddparity import Case

    def data(step, generator):
        return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)

    def clean():
        return Case(model=lambda: nn.Linear(6, 3), data=data, optimizer="adam", lr=1e-2, steps=3)

    def summed():
        return Case(model=lambda: nn.Linear(6, 3), data=data, steps=3,
                    loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))

    def uneven():
        return Case(model=lambda: nn.Linear(6, 3), data=lambda s, g: data(s, g)[:1] + (torch.zeros(7),))

    def odd_batch():
        return Case(model=lambda: nn.Linear(6, 3),
                    data=lambda s, g: (torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)))

    def broken_factory():
        def model():
            raise RuntimeError("layer sizes do not match")
        return Case(model=model, data=data)

    def not_a_case():
        return 42

    def bad_loss():
        return Case(model=lambda: nn.Linear(6, 3), data=data, loss="cross_entropyy")

    def bad_optimizer():
        return Case(model=lambda: nn.Linear(6, 3), data=data, optimizer="sgdd")

    def exits():
        import sys
        sys.exit(5)

    def exits_hard():
        import os
        os._exit(9)

    def no_params():
        return Case(model=nn.ReLU, data=data)

    def per_sample_loss():
        return Case(model=lambda: nn.Linear(6, 3), data=data,
                    loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    """
)


def ddparity(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddparity.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_cases.py"
    path.write_text(USER_FILE)
    return path


def test_demo_passes_and_prints_a_table():
    result = ddparity("check", "--demo", "--world-sizes", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo: MLP + SGD" in result.stdout
    assert "transformer block" in result.stdout
    assert result.stdout.count("OK:") == 4
    assert result.stdout.rstrip().endswith("OK: 3 of 3 cases equivalent to the reference in every run")
    quiet = ddparity("check", "--demo", "--world-sizes", "2", "--modes", "ddp", "-q")
    assert quiet.returncode == 0 and quiet.stdout.splitlines() == [
        "OK: 3 of 3 cases equivalent to the reference in every run"], quiet.stdout


def test_compile_through_the_cli_adds_compiled_rows_and_catches_the_bug(tmp_path):
    out = tmp_path / "report.json"
    result = ddparity("check", "ddparity.fixtures.compiled:graph_break_summed", "--modes", "ddp",
                      "--world-sizes", "2", "--compile", "aot_eager", "--compile-ddp", "python_reducer",
                      "--json", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ddp (compiled aot_eager, python_reducer)  2" in result.stdout
    assert "ddp world_size=2 (gloo): DIVERGED" in result.stdout  # the eager row beside it
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads(out.read_text())
    runs = {(r["mode"], r["compile"] and (r["compile"]["backend"], r["compile"]["ddp"])): r for r in report["runs"]}
    compiled_ddp = runs[("ddp", ("aot_eager", "python_reducer"))]
    assert compiled_ddp["status"] == "diverged" and compiled_ddp["first_divergence"]["step"] == 0
    assert compiled_ddp["repro"].endswith("--compile aot_eager --compile-ddp python_reducer")
    assert any("graph break(s) in your code" in n and "compiled.py" in n for n in compiled_ddp["notes"])
    assert ("single", ("aot_eager", None)) not in runs  # not asked for (its distance still the noise floor)
    for bad, message in ((["--compile", "nope"], "unknown torch.compile backend 'nope'"),
                         (["--compile-ddp", "python_reducer"], "given without compile")):
        refused = ddparity("check", "ddparity.fixtures.compiled:wide", *bad)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_python_dash_m_ddparity_is_the_ddparity_command(user_file, tmp_path):
    version = subprocess.run([sys.executable, "-m", "ddparity", "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("ddparity "), version.stderr
    # a check through it: its rank processes import no second copy of the command
    result = subprocess.run([sys.executable, "-m", "ddparity", "check", f"{user_file}:clean", "--world-sizes", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ddparity check:") == 1


def test_clean_user_file_passes_at_1_2_4_and_writes_json(user_file, tmp_path):
    out = tmp_path / "report.json"
    result = ddparity("check", f"{user_file}:clean", "--world-sizes", "1,2,4", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["ok"] is True
    assert [(r["mode"], r["world_size"], r["status"]) for r in data["runs"]] == [
        ("single", 1, "pass"), ("ddp", 1, "pass"), ("ddp", 2, "pass"), ("ddp", 4, "pass")]
    for run in data["runs"]:
        assert set(run) >= {"mode", "world_size", "backend", "simulated", "status", "reason",
                            "first_divergence", "desync", "hang", "crash", "seconds"}
        assert run["simulated"] is False and run["backend"] == "gloo"


def test_summed_loss_in_a_user_module_exits_1_with_first_divergence_and_repro(user_file, tmp_path):
    out = tmp_path / "report.json"
    result = ddparity("check", "my_cases:summed", "--world-sizes", "2", "--json", str(out), cwd=user_file.parent)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "first divergence: step 0, the loss, rank 0" in result.stdout
    assert "worst offenders" in result.stdout
    assert "reproduce: ddparity check my_cases:summed --modes ddp --world-sizes 2" in result.stdout
    run = json.loads(out.read_text())["runs"][1]
    assert run["status"] == "diverged"
    assert run["first_divergence"]["step"] == 0 and run["first_divergence"]["kind"] == "loss"


def test_known_bug_fixtures_through_the_cli():
    result = ddparity("check", "ddparity.fixtures.bugs:corrupted_grad_on_one_rank", "--world-sizes", "2")
    assert result.returncode == 1
    assert "desync at step 2: rank 1 differs from rank 0" in result.stdout
    assert "first divergence: step 2, grad 'net.0.weight', rank 1" in result.stdout


def test_a_hanging_rank_exits_3_with_suspect_positions_and_stacks_in_time(tmp_path):
    out = tmp_path / "hang.json"
    result = ddparity("check", "ddparity.fixtures.faults:stuck_rank", "--world-sizes", "2", "--timeout", "2",
                      "--json", str(out))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "suspect ranks: [1]" in result.stdout
    assert "rank 1: step 1, forward" in result.stdout and "_inject" in result.stdout
    assert "reproduce: ddparity check ddparity.fixtures.faults:stuck_rank --modes ddp --world-sizes 2" in result.stdout
    [_, run] = json.loads(out.read_text())["runs"]
    assert run["status"] == "hang" and run["hang"]["suspect_ranks"] == [1]
    ranks = run["hang"]["ranks"]
    assert ranks["0"]["collective_seq"] > ranks["1"]["collective_seq"] >= 0
    assert "DDP gradient bucket 0" in ranks["0"]["collective"]
    assert "_inject" in ranks["1"]["stack"]  # py-spy or, without it, faulthandler
    assert run["seconds"] < 2 + 15  # the timeout, plus stacks and teardown (however loaded): not the default 60 s


def test_a_crash_shows_the_users_frames_and_ddparitys_own_only_with_verbose():
    target = ("check", "ddparity.fixtures.faults:raising_rank", "--world-sizes", "2")
    plain, verbose = ddparity(*target), ddparity(*target, "-v")
    assert plain.returncode == verbose.returncode == 3, plain.stdout + plain.stderr
    for result in (plain, verbose):
        assert "injected fault: rank 1 raised at step 1" in result.stdout and "in _inject" in result.stdout
    assert "frames of ddparity's own: --verbose shows them]" in plain.stdout
    assert "harness/ranks/stepping.py" not in plain.stdout
    assert "harness/ranks/stepping.py" in verbose.stdout and "frames of ddparity's own" not in verbose.stdout


def test_a_mismatched_collective_exits_1_with_each_ranks_call_site(tmp_path):
    out = tmp_path / "desync.json"
    result = ddparity("check", "ddparity.fixtures.faults:mismatched_shape", "--world-sizes", "2", "--json", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    [_, run] = json.loads(out.read_text())["runs"]
    assert run["status"] == "desync" and run["desync"]["ranks"] == [1] and run["desync"]["step"] == 1
    sites = run["desync"]["collective"]["ranks"]
    assert "float32[1]" in sites["0"]["collective"] and "float32[2]" in sites["1"]["collective"]
    assert "faults.py" in sites["1"]["site"] and "_inject" in sites["1"]["site"]


USER_DESYNC = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from ddparity import Case


    def data(step, generator):
        return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


    class Metric(nn.Linear):
        def forward(self, x):
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(torch.ones(dist.get_rank() + 1))  # rank 1: shape [2]
            return super().forward(x)


    def mismatch():
        return Case(model=lambda: Metric(6, 3), data=data, steps=2)


    def data_raises():
        def shards(step, generator):
            raise FileNotFoundError("shard-0001")
        return Case(model=lambda: nn.Linear(6, 3), data=shards)
    """
)


def test_a_target_files_own_frames_and_call_sites_name_the_file(tmp_path):
    """Functions of a target file travel to the ranks by value; cloudpickle 3 renames their
    code ``<dynamic-code>``, which hid the file from tracebacks and call sites."""
    path = tmp_path / "user_desync.py"
    path.write_text(USER_DESYNC)
    out = tmp_path / "r.json"
    result = ddparity("check", f"{path}:mismatch", "--world-sizes", "2", "--json", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    sites = json.loads(out.read_text())["runs"][1]["desync"]["collective"]["ranks"]
    assert "user_desync.py:15 in forward" in sites["1"]["site"], sites
    result = ddparity("check", f"{path}:data_raises", "--world-sizes", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'File "{path}", line 25, in shards' in result.stdout
    assert "dynamic-code" not in result.stdout and "ddparity/harness" not in result.stdout


def test_demo_faults_reports_every_fault_as_expected():
    result = ddparity("check", "--demo-faults", "--world-sizes", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "OK: 15 of 15 fault runs reported as expected" in result.stdout
    for status in ("HANG", "CRASH", "DESYNC"):
        assert f"ddp world_size=2 (gloo): {status}" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["{file}:broken_factory"], "layer sizes do not match"),
        (["{file}:odd_batch", "--world-sizes", "4"], "cannot be split into 4 equal shards; use a batch size divisible by every world size (e.g. 4 or 8)"),
        (["{file}:clean", "--world-sizes", "0"], "world sizes must be integers >= 1"),
        (["{file}:exits"], "called sys.exit(5): code that builds a Case must not exit"),
        (["{file}:exits_hard"], "called os._exit(9): code that builds a Case must not exit"),
        (["{file}:no_params"], "the model (ReLU) has no parameters"),
        (["{file}:per_sample_loss"], "the loss must be a tensor with one element, got a tensor of shape [8]"),
        ([], "missing TARGET"),
        (["{file}:clean", "--steps", "1000000000"], "1000000000 steps need about"),
    ],
)
def test_bad_input_exits_2_with_a_message_and_no_traceback(user_file, args, message):
    result = ddparity("check", *[a.format(file=user_file) for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    text = result.stdout + result.stderr
    assert message in text
    assert "Traceback" not in result.stderr
    assert "ddparity/harness/ranks/rank.py" not in text  # never a traceback through ddparity's rank loop


@pytest.mark.parametrize(
    "args, message",
    [
        (["{file}:not_a_case"], "returned int, not a ddparity.Case"),
        (["{file}:bad_loss"], "unknown loss 'cross_entropyy'"),
        (["{file}:bad_optimizer"], "unknown optimizer 'sgdd'"),
        (["{file}:nothing"], "has no attribute 'nothing'"),
        (["no_such_module_abc:case"], "cannot import module 'no_such_module_abc'"),
        (["{file}:clean", "--world-sizes", "two"], "comma-separated list of integers"),
        pytest.param(["{file}:clean", "--backend", "nccl"], "nccl", marks=pytest.mark.skipif(
            cuda_device_count() > 0, reason="nccl is valid where GPUs exist")),
        (["{file}:clean", "--modes", "single,tpu"], "unknown mode 'tpu'"),
        (["{file}:clean", "--tolerance", "tight"], "tolerance must be 'auto' or a relative tolerance"),
        (["{file}:clean", "--tolerance", "inf"], "tolerance must be 'auto' or a relative tolerance 0 <= t < 1"),
        (["{file}:clean", "--tolerance", "nan"], "tolerance must be 'auto' or a relative tolerance 0 <= t < 1"),
        (["{file}:clean", "--timeout", "inf"], "timeout must be a finite number of seconds"),
        (["{file}:clean", "--timeout", "0.001"], "timeout must be at least 1 s"),
        (["{file}:clean", "--world-sizes", "1,,2"], "an empty world size in '1,,2'"),
        (["{file}:summed", "--json", "/no-such-dir-ddparity/r.json"], "no directory '/no-such-dir-ddparity'"),
        (["--demo-faults", "--world-sizes", "1,2"], "fault injections need world sizes >= 2"),
        (["--demo", "--demo-faults"], "give one of TARGET, --demo or --demo-faults"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_before_any_rank_starts(user_file, args, message, capsys):
    """The CLI's own main() in this process (the test above runs the command itself): each
    of these is refused before a rank process starts, so none is spawned here either."""
    import psutil

    from ddparity.cli import main

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(["check", *[a.format(file=user_file) for a in args]])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in out + err and "Traceback" not in err, out + err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no work started


def test_modes_single_dp_ddp_label_the_simulated_runs(tmp_path):
    out = tmp_path / "dp.json"
    result = ddparity("check", "ddparity.fixtures.bugs:batchnorm_on_shards", "--modes", "single,dp,ddp",
                      "--world-sizes", "2", "--json", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    runs = {(r["mode"], r["world_size"]): r for r in json.loads(out.read_text())["runs"]}
    assert runs[("dp", 2)]["simulated"] is True and runs[("ddp", 2)]["simulated"] is False
    assert runs[("dp", 2)]["status"] == "diverged"
    assert any("per-replica BatchNorm" in note for note in runs[("dp", 2)]["notes"])
    assert "dp      2      cpu (simulated)  diverged" in result.stdout


def test_version_flags():
    for flag in ("-V", "--version"):
        result = ddparity(flag)
        assert result.returncode == 0 and re.fullmatch(r"ddparity \d+\.\d+\.\d+\S*\n", result.stdout), result


def test_json_dash_writes_the_json_to_stdout_and_the_report_to_stderr():
    result = ddparity("check", "ddparity.fixtures.bugs:summed_loss", "--world-sizes", "2", "--json", "-")
    assert result.returncode == 1, result.stderr
    data = json.loads(result.stdout)  # nothing else on stdout
    assert [r["status"] for r in data["runs"]] == ["pass", "diverged"]
    assert "DIVERGED" in result.stderr and not os.path.exists("-")
    assert "\x1b[" not in result.stdout + result.stderr  # pipes get no colour


def test_a_reader_that_goes_away_is_no_error_and_the_exit_code_is_the_verdicts():
    """`ddparity check ... | head -1` ended in BrokenPipeError, "internal error", exit 4."""
    proc = subprocess.Popen([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.bugs:summed_loss",
                             "--world-sizes", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the report is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1, err
    assert "Traceback" not in err and "internal error" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("verb", ["check", "profile", "health"])
def test_each_verbs_help_has_a_description_its_defaults_examples_and_exit_codes(verb):
    result = ddparity(verb, "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "examples:" in text and f"ddparity {verb}" in text.split("examples:")[1]
    assert "exit codes:" in text and "130" in text and "4    an internal error" in text
    assert "(default" in text


def _ctrl_c_once_written(proc: subprocess.Popen, spooled: str, then: float) -> tuple[str, str]:
    """Ctrl-C to a running check ``then`` seconds after its reference wrote ``spooled`` to the
    check's spool; its stdout and stderr."""
    import glob
    import tempfile

    try:
        written = os.path.join(tempfile.gettempdir(), f"ddparity-spool-{proc.pid}-*", spooled)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not glob.glob(written):
            time.sleep(0.2)
        time.sleep(then)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        proc.kill()


def test_ctrl_c_prints_the_runs_finished_so_far_and_where_each_rank_was():
    """Ctrl-C printed `ddparity: interrupted` and threw away the finished reference run and
    every rank's position."""
    proc = subprocess.Popen([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.faults:stuck_rank",
                             "--world-sizes", "2", "--timeout", "120"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored
    # once the reference wrote its last step, rank 1 is stuck at step 1, its peer waits for it
    out, err = _ctrl_c_once_written(proc, "a2.json", then=2)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert re.search(r"single\s+1\s+gloo\s+pass", out) and "INTERRUPTED: 1 run(s) finished" in out, out
    assert "interrupted during ddp world_size=2 (gloo), where each rank was:" in err, err
    assert "rank 1: step 1, forward" in err and "rank 0: step 1," in err, err


def test_quiet_prints_only_the_verdict_line():
    result = ddparity("check", "ddparity.fixtures.bugs:summed_loss", "--world-sizes", "2", "--quiet")
    assert result.returncode == 1
    assert result.stdout == "FAILED: 1 of 2 runs equivalent to the reference\n", result.stdout


def _through_a_terminal(args: list[str], timeout: float = 120, env: dict | None = None) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as stdout and stderr (what a user's shell gives)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 40 rows, 200 columns
    proc = subprocess.Popen([sys.executable, "-m", "ddparity", *args], stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True, env={**os.environ, "TERM": "xterm", **(env or {})})
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        proc.kill()
        os.close(master)


def test_on_a_terminal_a_live_line_says_which_run_where_and_how_long_until_a_hang():
    """A check printed nothing until it ended (a hang at the default timeout: a minute of
    blank screen)."""
    code, text = _through_a_terminal(["check", "ddparity.fixtures.faults:stuck_rank", "--world-sizes", "2",
                                      "--timeout", "6"])
    assert code == 3, text
    # the first bytes, before torch is imported: the command says it started
    assert text.startswith("\r\x1b[Kddparity check: starting (loading torch, then the rank processes)..."), text[:200]
    lines = [part.strip("\x1b[K") for part in text.split("\r")]
    assert any(ln.startswith("ddparity: ddp world_size=2 (gloo): step 1, forward") for ln in lines), text
    assert any("no progress for" in ln and "(a hang at 6 s)" in ln for ln in lines), text
    report = text[text.index("ddparity check: fault: stuck_rank"):]
    assert "\x1b[K" not in report.split("FAILED")[0].split("HANG")[0]  # cleared before the report, not inside it
    # colour on a terminal: the failed run's status and the verdict
    assert "ddp world_size=2 (gloo): \x1b[1;31mHANG\x1b[0m" in report and "\x1b[1;31mFAILED\x1b[0m:" in report


def test_no_color_gets_no_colour_on_a_terminal():
    code, text = _through_a_terminal(["check", "ddparity.fixtures.bugs:summed_loss", "--world-sizes", "2"],
                                     env={"NO_COLOR": "1"})
    assert code == 1 and "FAILED: 1 of 2" in text and "\x1b[1;3" not in text, text
    # a pipe: test_json_dash_writes_the_json_to_stdout_and_the_report_to_stderr (no colour on either)


def test_piped_a_run_without_progress_gets_one_plain_line():
    import io

    from ddparity.cli_progress import QuietNotes, describe
    from ddparity.harness.protocol import RunName
    from ddparity.harness.world.progress import Snapshot
    from ddparity.records import encode_progress

    stuck = encode_progress(5, 1, "forward", None, [])
    snap = Snapshot(RunName("ddp", sized=True), 2, "gloo", [stuck, stuck], 12.0, 60.0)
    assert describe(snap) == "ddparity: ddp world_size=2 (gloo): step 1, forward · no progress for 12 s (a hang at 60 s)"
    out = io.StringIO()
    notes = QuietNotes(out)
    notes(Snapshot(RunName("ddp", sized=True), 2, "gloo", [stuck, stuck], 3.0, 60.0))  # moving: nothing
    notes(snap)
    notes(Snapshot(RunName("ddp", sized=True), 2, "gloo", [stuck, stuck], 14.0, 60.0))  # said once
    assert out.getvalue().splitlines() == [describe(snap)]


SLOW_CASE = """
import time
import torch
import torch.nn.functional as F
from ddparity import Case
from ddparity.fixtures.models import MLP, vectors


def slow_step(model, batch, optimizer, ctx):
    time.sleep(0.5)
    x, y = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def case():
    return Case(model=MLP, data=vectors, train_step=slow_step, steps=60)
"""


def test_ctrl_c_while_runs_train_side_by_side_prints_every_rank_of_each(tmp_path):
    """The reference and the first DDP run train side by side: Ctrl-C printed where the
    reference's rank 0 was, not the ranks of the DDP run in progress (docs/cli.md promises
    every rank)."""
    (tmp_path / "slow.py").write_text(SLOW_CASE)
    proc = subprocess.Popen([sys.executable, "-m", "ddparity", "check", "slow.py:case", "--world-sizes", "4",
                             "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = _ctrl_c_once_written(proc, "a0.json", then=3)  # the reference is training, the DDP run too
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert "the single-device reference: rank 0: step" in err, err
    for rank in range(4):
        assert f"ddp world_size=4 (gloo): rank {rank}: " in err, err


def test_simulated_ranks_start_from_a_temporary_folder_too_deep_for_a_socket(tmp_path):
    """The forkserver's socket lives in $TMPDIR: a job's or a test's folder can be too deep
    for a socket's path (CPython 3.11 raised "AF_UNIX path too long", reported as ddparity's
    internal error); the forkserver's folder is then made in /tmp."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    result = subprocess.run([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.bugs:summed_loss",
                             "--world-sizes", "4", "--backend", "threaded", "--steps", "2"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(deep)})
    assert result.returncode == 1 and "ddp world_size=4 (threaded, simulated): DIVERGED" in result.stdout, \
        result.stdout + result.stderr


SCRIPT_STEP_RAISES = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    import ddparity


    def data(step, generator):
        return torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)


    def step(model, batch, optimizer, ctx):
        if ctx.world_size > 1 and ctx.rank == ctx.world_size - 1:
            raise RuntimeError("the last rank's shard")
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss.detach()


    if __name__ == "__main__":
        case = ddparity.Case(model=lambda: nn.Linear(4, 2), data=data, train_step=step, steps=1)
        print(ddparity.check(case, modes=("single", "ddp"), world_sizes=(2,)).render())
    """
)


def test_a_scripts_own_functions_are_named_by_its_file_in_a_ranks_traceback(tmp_path):
    """A script that calls ``ddparity.check`` with its own functions: cloudpickle sends them by
    value (``__main__``) and named their code ``<dynamic-code>``; the crash names the file."""
    path = tmp_path / "train_check.py"
    path.write_text(SCRIPT_STEP_RAISES)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 raised: RuntimeError: the last rank's shard" in result.stdout, result.stdout
    assert f'File "{path}", line 15, in step' in result.stdout, result.stdout
    assert "dynamic-code" not in result.stdout
