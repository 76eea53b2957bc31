"""The pytest plugin as users meet it: real pytest subprocesses (pytester)."""

from __future__ import annotations

import json
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]

HEADER = '''
import time
import pytest
import torch
from torch import nn
from ddparity import Case

def data(step, generator):
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)

class Net(nn.Module):          # a class defined in the test module
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
    def forward(self, x):
        return self.fc(x)
'''

TESTS = HEADER + '''
@pytest.mark.world_size(2, 4)
def test_clean(parity):
    parity(Case(model=Net, data=data, steps=2))

@pytest.mark.world_size(2)
def test_summed_loss(parity):
    width = 6                    # a closure and a lambda
    parity(Case(model=lambda: nn.Linear(width, 3), data=data, steps=2,
                loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum")))

@pytest.mark.world_size(2)
def test_world(world, world_size):
    assert world.run(lambda ctx: (ctx.rank, ctx.world_size)) == [(0, 2), (1, 2)]
'''


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=300)


def test_passes_fails_and_parametrizes_like_pytest(pytester):
    pytester.makepyfile(test_user=TESTS)
    result = run(pytester, "-v", "--strict-markers")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*test_clean?ws2? PASSED*", "*test_clean?ws4? PASSED*", "*test_summed_loss?ws2? FAILED*",
        "*test_world?ws2? PASSED*",
    ])
    out = result.stdout.str()
    # the failure: the report's table, the first divergence, and a last line that reproduces it
    assert "ddparity check: test_summed_loss[ws2]" in out
    assert "ddp world_size=2 (gloo): DIVERGED" in out
    assert "first divergence: step 0, the loss, rank 0" in out
    assert "reproduce: pytest 'test_user.py::test_summed_loss[ws2]' --ddparity-backend auto" in out
    assert "Traceback" not in out and "ddparity/verbs/check.py" not in out


SNAPSHOTS = Path(__file__).parent / "snapshots"


def normalized_failure(out: str, test: str) -> str:
    """The failure section of ``test``, numbers replaced by N and column padding collapsed
    (timings and float noise vary; the layout and wording are what is pinned)."""
    section = out.split(f" {test} ", 1)[1].split("short test summary info", 1)[0]
    section = section.split("\n", 1)[1].rsplit("\n", 1)[0]
    section = re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "N", section)
    lines = [re.sub(r" {2,}", "  ", line).rstrip() for line in section.strip().splitlines()]
    # the worst offenders' order depends on float noise: pin the set, not the order
    worst = [i for i, line in enumerate(lines) if re.match(r"  (loss|grad|param|buffer)  ", line)]
    for i, line in zip(worst, sorted(lines[i] for i in worst)):
        lines[i] = line
    return "\n".join(lines) + "\n"


def test_failure_text_matches_the_snapshot(pytester):
    """Update with DDPARITY_UPDATE_SNAPSHOTS=1 after an intended change of the report."""
    pytester.makepyfile(test_user=TESTS)
    result = run(pytester, "-k", "summed")
    got = normalized_failure(result.stdout.str(), "test_summed_loss[ws2]")
    path = SNAPSHOTS / "plugin_failure.txt"
    if os.environ.get("DDPARITY_UPDATE_SNAPSHOTS"):
        path.write_text(got)
    assert got == path.read_text()


def test_session_report_and_junit_properties(pytester):
    pytester.makepyfile(test_user=TESTS)
    result = run(pytester, "--ddparity-report", "out/report.json", "--junitxml", "junit.xml")
    result.assert_outcomes(passed=3, failed=1)
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert report["version"] == 1 and report["ok"] is False
    ddp = {(r["test"], r["world_size"]): r["status"] for r in report["runs"] if r["mode"] == "ddp"}
    assert ddp == {("test_user.py::test_clean[ws2]", 2): "pass", ("test_user.py::test_clean[ws4]", 4): "pass",
                   ("test_user.py::test_summed_loss[ws2]", 2): "diverged"}
    props = {(p.get("name"), p.get("value")) for p in ET.parse(pytester.path / "junit.xml").iter("property")}
    assert ("ddparity[ddp ws2] status", "diverged") in props
    assert ("ddparity[ddp ws2] first_divergence", "step 0, the loss, rank 0") in props
    [module] = [v for n, v in props if n == "ddparity[ddp ws2] first_divergence module"]
    assert module.startswith("first to differ: the loss (step 0, rank 0)") and "is 0.5x the reference's" in module
    [summed] = [r for r in report["runs"] if r["mode"] == "ddp" and r["status"] == "diverged"]
    assert summed["first_divergence"]["module"]["phase"] == "loss"
    assert ("ddparity[ddp ws4] world_size", "4") in props


def test_under_xdist_each_worker_owns_its_worlds_and_the_report_merges(pytester):
    pytester.makepyfile(test_user=TESTS)
    result = run(pytester, "-n", "2", "--ddparity-report", "report.json")
    result.assert_outcomes(passed=3, failed=1)
    report = json.loads((pytester.path / "report.json").read_text())
    assert sorted({r["test"] for r in report["runs"]}) == [
        "test_user.py::test_clean[ws2]", "test_user.py::test_clean[ws4]", "test_user.py::test_summed_loss[ws2]"]


def test_each_xdist_worker_keeps_at_most_its_share_of_rank_processes(pytester, monkeypatch):
    from ddparity.settings import default_max_ranks

    pytester.makepyfile(test_cap='''
import os
import pytest

@pytest.mark.world_size(1, 2, 3)
@pytest.mark.parametrize("again", range(2))
def test_world(world, world_size, ddparity_pool, again):
    assert world.run(lambda ctx: ctx.world_size) == [world_size] * world_size
    assert ddparity_pool.max_ranks == int(os.environ["EXPECTED_CAP"])
    assert len(ddparity_pool.pids) <= max(ddparity_pool.max_ranks, world_size)
''')
    monkeypatch.setenv("EXPECTED_CAP", str(default_max_ranks(2)))  # the machine's budget, halved
    run(pytester, "-n", "2").assert_outcomes(passed=6)
    monkeypatch.setenv("EXPECTED_CAP", "3")
    run(pytester, "-n", "2", "--ddparity-max-ranks", "3").assert_outcomes(passed=6)


def test_a_hanging_and_a_crashing_rank_fail_their_tests_and_the_session_goes_on(pytester):
    pytester.makepyfile(test_faults=HEADER + '''
class Faulty(nn.Module):
    def __init__(self, fault):
        super().__init__()
        self.fc, self.fault, self.calls = nn.Linear(6, 3), fault, 0
    def forward(self, x):
        import torch.distributed as dist
        self.calls += 1
        if dist.get_world_size() > 1 and dist.get_rank() == 1 and self.calls == 2:
            if self.fault == "hang":
                time.sleep(600)
            raise RuntimeError("rank 1 gave up")
        return self.fc(x)

@pytest.mark.world_size(2)
def test_hangs(parity):
    parity(Case(model=lambda: Faulty("hang"), data=data, steps=3))

@pytest.mark.world_size(2)
def test_crashes(parity):
    parity(Case(model=lambda: Faulty("raise"), data=data, steps=3))

@pytest.mark.world_size(2)
def test_next_one_passes(parity):
    parity(Case(model=Net, data=data, steps=2))
''')
    started = time.monotonic()
    result = run(pytester, "--ddparity-timeout", "3")
    result.assert_outcomes(passed=1, failed=2)
    # no rank of that session is left (ranks are forks of it: same command line)
    def leftovers() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline", "status"])
                if str(pytester.path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 10
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers() == []
    out = result.stdout.str()
    assert "ddp world_size=2 (gloo): HANG" in out and "suspect ranks: [1]" in out
    assert "--- rank 1 stack ---" in out
    assert "ddp world_size=2 (gloo): CRASH" in out and "rank 1 raised: RuntimeError: rank 1 gave up" in out
    assert time.monotonic() - started < 60  # one 3 s timeout, not 30 minutes


def test_settings_precedence_and_bad_values(pytester, monkeypatch):
    pytester.makeini("[pytest]\nddparity_world_sizes = 4\nddparity_timeout = 30\n")
    pytester.makepyfile(test_sizes='''
import pytest

@pytest.mark.world_size
def test_sizes(world_size):
    print("SIZE", world_size)
''')
    result = run(pytester, "-v")
    result.stdout.fnmatch_lines(["*test_sizes?ws4? PASSED*"])  # ini
    monkeypatch.setenv("DDPARITY_WORLD_SIZES", "1,2")
    result = run(pytester, "-v")
    result.stdout.fnmatch_lines(["*test_sizes?ws1? PASSED*", "*test_sizes?ws2? PASSED*"])  # env over ini
    result = run(pytester, "-v", "--ddparity-world-sizes", "3")
    result.stdout.fnmatch_lines(["*test_sizes?ws3? PASSED*"])  # option over env
    result = run(pytester, "--ddparity-timeout", "soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--ddparity-timeout: timeout must be a positive number of seconds, got 'soon'*"])
    result = run(pytester, "--ddparity-max-ranks", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--ddparity-max-ranks: max ranks must be an integer >= 1, got '0'*"])
    monkeypatch.setenv("DDPARITY_BACKEND", "mpi")
    result = run(pytester)
    result.stderr.fnmatch_lines(["*$DDPARITY_BACKEND: unknown backend 'mpi'*"])


def test_nccl_without_gpus_skips_with_the_reason(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(test_user=TESTS)
    result = run(pytester, "--ddparity-backend", "nccl", "-rs")
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(["*ddparity: backend 'nccl' needs one CUDA device per rank*use --backend gloo*"])


def test_a_session_without_ddparity_tests_does_not_import_torch(pytester):
    pytester.makepyfile(test_plain='''
import sys

def test_no_torch():
    assert "torch" not in sys.modules
''')
    run(pytester).assert_outcomes(passed=1)


def test_hypothesis_strategies_generate_cases_that_print_as_code(pytester):
    pytester.makepyfile(test_props='''
import pytest
from hypothesis import HealthCheck, given, settings
from ddparity import strategies as dps

@pytest.mark.world_size(2)
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=dps.cases(world_size=2))
def test_ddp_matches_one_device(case, parity):
    parity(case)

@settings(max_examples=1, deadline=None, derandomize=True)
@given(case=dps.cases(world_size=2))
def test_falsifying_example_is_printed(case):
    assert False
''')
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    # hypothesis < 6.170 heads the example "Falsifying example:", newer ones "Failing test case:"
    result.stdout.re_match_lines([r".*(Falsifying example|Failing test case).*", r".*case=Case\(model=MLPFactory\(sizes=\(.*"])


def test_the_world_fixture_honours_the_session_timeout_and_a_tests_own(pytester):
    pytester.makepyfile(test_world_hang='''
import time
import pytest

def wait_or_sleep(ctx):
    import torch.distributed as dist
    if ctx.rank == 1:
        time.sleep(600)
    dist.barrier()

@pytest.mark.world_size(2)
def test_session_timeout(world):
    world.run(wait_or_sleep)

@pytest.mark.world_size(2)
@pytest.mark.ddparity_timeout(2)
def test_own_timeout(world):
    world.run(wait_or_sleep)

@pytest.mark.world_size(2)
def test_after(world):
    assert world.run(lambda ctx: ctx.rank) == [0, 1]
''')
    started = time.monotonic()
    result = run(pytester, "--ddparity-timeout", "4", "-v")
    assert time.monotonic() - started < 120  # not the World's own 300 s, twice
    result.stdout.fnmatch_lines(["*test_session_timeout?ws2? FAILED*", "*test_own_timeout?ws2? FAILED*",
                                 "*test_after?ws2? PASSED*"])
    result.stdout.fnmatch_lines(["*made no progress for 4 s*", "*suspect rank(s) [[]1[]]: behind in the collective*"])
    result.stdout.fnmatch_lines(["*made no progress for 2 s*", "*suspect rank(s) [[]1[]]: behind in the collective*"])


def test_parity_checks_fsdp_and_hsdp_as_a_user_writes_it(pytester):
    """``parity(case, modes=("fsdp", "hsdp"), hsdp_shard=...)``: the user's own FSDP
    wrapping (``Case.fsdp``) passes; a parameter left out of sharding fails the test with
    its cause."""
    pytester.makepyfile(test_sharded=HEADER + '''
from torch.distributed.fsdp import fully_shard

def wrapped(model, mesh):
    fully_shard(model.fc, mesh=mesh)
    fully_shard(model, mesh=mesh)

def left_out(model, mesh):
    fully_shard(model, mesh=mesh, ignored_params={model.fc.bias})

@pytest.mark.world_size(2)
def test_sharded_clean(parity):
    parity(Case(model=Net, data=data, steps=2, fsdp=wrapped), modes=("fsdp", "hsdp"), hsdp_shard=2)

@pytest.mark.world_size(2)
def test_sharded_bug(parity):
    parity(Case(model=Net, data=data, steps=2, fsdp=left_out), modes=("fsdp",))
''')
    result = run(pytester, "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_sharded_clean*PASSED*", "*test_sharded_bug*FAILED*",
                                 "*fsdp world_size=2 (gloo): DIVERGED*",
                                 "*likely cause: fc.bias left out of sharding (ignored_params)*"])


COMPILED = HEADER + '''
@pytest.mark.world_size(2)
def test_compiled(parity):
    parity(Case(model=Net, data=data, steps=2), compile="aot_eager")

@pytest.mark.world_size(2)
def test_compiled_summed(parity):
    parity(Case(model=Net, data=data, steps=2,
                loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum")), compile="aot_eager")
'''


def test_parity_compiles_every_mode_and_names_the_compiled_runs(pytester):
    pytester.makepyfile(test_user=COMPILED)
    result = run(pytester, "--junitxml", "junit.xml")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "ddp (compiled aot_eager, ddp_optimizer) world_size=2 (gloo): DIVERGED" in out
    assert "Traceback" not in out
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="ddparity[ddp (compiled aot_eager, ddp_optimizer) ws2] status" value="pass"' in junit
    assert 'name="ddparity[single (compiled aot_eager) ws1] status" value="pass"' in junit
