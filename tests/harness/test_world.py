"""World: real rank processes, reused; failures become errors that name the rank."""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from ddparity import World
from ddparity.errors import RankCrashed, TaskFailed, TaskTimeout, UsageError
from tests.conftest import wait_gone

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


class Doubler:  # a class defined in a test module travels to the ranks
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, ctx, x):
        return self.k * x + ctx.rank


@pytest.fixture(scope="module")
def world2():
    with World(2) as world:
        yield world


def test_results_come_back_by_rank_with_real_collectives(world2):
    def task(ctx):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
        return ctx.rank, ctx.world_size, float(t)

    assert world2.run(task) == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.parametrize("clean_start", [False, True], ids=["forked", "forkserver"])
def test_a_worlds_env_reaches_every_rank_before_its_process_group_and_not_the_controller(clean_start):
    """NCCL reads NCCL_P2P_DISABLE once per process: a world's env is how a pass through the
    network alone reaches fresh ranks (health --pairwise on nccl)."""
    with World(2, env=(("DDPARITY_TEST_ENV", "network-only"),), clean_start=clean_start) as world:
        assert world.run(lambda ctx: os.environ.get("DDPARITY_TEST_ENV")) == ["network-only"] * 2
    assert "DDPARITY_TEST_ENV" not in os.environ
    with pytest.raises(UsageError, match="env must be"):
        World(2, env=(("DDPARITY_TEST_ENV", 1),))


def test_lambdas_closures_and_test_module_classes_work(world2):
    offset = 10
    assert world2.run(lambda ctx: ctx.rank + offset) == [10, 11]
    assert world2.run(Doubler(3), 5) == [15, 16]


def test_output_is_captured_per_rank_including_c_level(world2):
    def noisy(ctx):
        print(f"hello from {ctx.rank}")
        os.write(2, b"raw fd write\n")
        return None

    outcomes = world2.execute(noisy)
    for rank, outcome in enumerate(outcomes):
        assert f"hello from {rank}" in outcome.output
        assert "raw fd write" in outcome.output
        assert "ddparity-task-end" not in outcome.output


def _flood(ctx):
    import sys

    line = "x" * 1023 + "\n"
    for _ in range(5 * 1024):  # 5 MiB on every rank
        sys.stdout.write(line)
    print(f"last line of rank {ctx.rank}")
    return ctx.rank


def test_a_rank_that_prints_megabytes_keeps_only_its_tail_with_a_note(world2):
    outcomes = world2.execute(_flood)
    for o in outcomes:
        assert len(o.output) < (1 << 20) + 200
        assert o.output.startswith("[ddparity: ") and "bytes of this rank's earlier output dropped" in o.output
        assert o.output.rstrip().endswith(f"last line of rank {o.rank}")
    assert world2.run(lambda ctx: ctx.rank) == [0, 1]  # the stream is still cut at task ends


def test_a_raising_task_reports_the_rank_and_leaves_a_usable_world(world2):
    def fails_on_one(ctx):
        if ctx.rank == 1:
            raise ValueError("rank one is broken")
        return "fine"

    with pytest.raises(TaskFailed) as info:
        world2.run(fails_on_one)
    assert info.value.failed_ranks == [1]
    assert "rank one is broken" in str(info.value)
    assert "fails_on_one" in info.value.outcomes[1].traceback
    assert world2.run(lambda ctx: ctx.rank) == [0, 1]


def test_unpicklable_exceptions_come_back_as_remote_errors(world2):
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a)

    def raise_odd(ctx):
        raise Odd("x", "y")

    with pytest.raises(TaskFailed) as info:
        world2.run(raise_odd)
    assert "Odd" in str(info.value)


def test_a_rank_stuck_after_a_peer_failed_is_rebuilt_not_waited_for():
    import torch.distributed as dist  # noqa: F401  (imported in the task)

    with World(2, error_grace=1.0) as world:
        def one_raises_other_waits(ctx):
            import torch.distributed as dist

            if ctx.rank == 0:
                raise RuntimeError("boom")
            dist.barrier()

        started = time.monotonic()
        with pytest.raises(TaskFailed) as info:
            world.run(one_raises_other_waits, timeout=60)
        assert time.monotonic() - started < 30
        assert "boom" in str(info.value)
        assert world.run(lambda ctx: ctx.rank) == [0, 1]


def test_timeout_reports_the_stuck_rank_with_its_stack_and_rebuilds():
    with World(2) as world:
        gen = world.generation

        def stuck(ctx):
            if ctx.rank == 1:
                time.sleep(600)
            return ctx.rank

        with pytest.raises(TaskTimeout) as info:
            world.run(stuck, timeout=1.5)
        assert info.value.pending_ranks == [1]
        stack = info.value.stacks[1]  # py-spy "stuck (file:line)", or faulthandler "in stuck"
        assert "stuck (" in stack or "in stuck" in stack
        assert world.run(lambda ctx: ctx.rank) == [0, 1]
        assert world.generation == gen + 1


@pytest.mark.parametrize("how", ["exit", "segfault"])
def test_a_dying_rank_is_reported_and_the_world_rebuilt(how):
    with World(2) as world:
        def dies(ctx):
            import ctypes

            import torch.distributed as dist

            if ctx.rank == 1:
                if how == "exit":
                    os._exit(7)
                ctypes.string_at(0)  # segfault
            dist.barrier()

        with pytest.raises(RankCrashed) as info:
            world.run(dies, timeout=60)
        assert info.value.rank == 1
        if how == "exit":
            assert info.value.exitcode == 7
        else:
            assert info.value.exitcode == -signal.SIGSEGV
            assert "Segmentation fault" in info.value.output
        assert world.run(lambda ctx: ctx.rank) == [0, 1]


def test_close_leaves_no_process():
    world = World(3).start()
    pids = set(world.pids)
    assert len(pids) == 3
    world.close()
    assert not wait_gone(pids)
    with pytest.raises(UsageError):
        world.run(lambda ctx: 1)


def test_store_and_gloo_listen_on_loopback_only(world2):
    world2.run(lambda ctx: None)
    me = psutil.Process()
    procs = [me] + [psutil.Process(p) for p in world2.pids]
    listening = [c for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "expected the store and gloo to listen somewhere"
    assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening


def test_world_size_is_validated():
    with pytest.raises(UsageError, match="world_size must be >= 1"):
        World(0)
    with pytest.raises(UsageError, match="unknown backend"):
        World(1, backend="mpi").start()


def test_killing_the_parent_with_sigkill_leaves_no_rank_behind(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(
        """
        import sys, time
        from ddparity import World
        world = World(3).start()
        world.run(lambda ctx: None)
        print(" ".join(map(str, world.pids)), flush=True)
        time.sleep(600)
        """
    ))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        pids = {int(p) for p in line.split()}
        assert len(pids) == 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert not wait_gone(pids), "ranks outlived their SIGKILLed parent"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_submit_runs_worlds_side_by_side_one_task_per_world():
    with World(1) as one, World(2) as two:
        def slow(ctx, seconds):
            began = time.time()  # one clock for every process of the machine
            time.sleep(seconds)
            return ctx.world_size, began, time.time()

        a = one.submit(slow, 2.0)
        b = two.submit(slow, 2.0)
        with pytest.raises(UsageError, match="already running a task"):
            one.submit(slow, 0.0)
        done = [o.value for o in a.result()] + [o.value for o in b.result()]
        assert [size for size, _, _ in done] == [1, 2, 2]
        assert max(began for _, began, _ in done) < min(ended for _, _, ended in done)  # all slept at once
        with pytest.raises(UsageError, match="already collected"):
            a.result()
        assert one.run(lambda ctx: ctx.rank) == [0]


def test_forked_ranks_that_do_not_join_are_started_again_from_the_forkserver(monkeypatch):
    from ddparity.harness.world import spawn

    original = World._start_ranks
    methods = []

    def flaky(self, method, join_timeout):
        methods.append(method)
        if method == "fork":
            original(self, method, join_timeout)
            raise spawn.JoinTimeout([0, 1])  # as if a forked rank hung in start-up
        return original(self, method, join_timeout)

    monkeypatch.setattr(World, "_start_ranks", flaky)
    with World(2) as world:
        assert methods == ["fork", "forkserver"]
        assert world.run(lambda ctx: ctx.rank) == [0, 1]
        assert world.generation == 2


def test_a_rank_that_dies_after_its_task_is_noticed_and_replaced(caplog):
    with World(2) as world:
        def die_soon_after(ctx):
            import os
            import threading
            import time

            if ctx.rank == 1:  # e.g. a crash in a background thread once the work is done
                threading.Thread(target=lambda: (time.sleep(0.2), os._exit(9)), daemon=True).start()
            return ctx.rank

        assert world.run(die_soon_after) == [0, 1]
        time.sleep(1.0)
        gen = world.generation
        with caplog.at_level("WARNING", logger="ddparity"):
            assert world.run(lambda ctx: ctx.rank) == [0, 1]
        assert world.generation == gen + 1
        assert "rank 1 died after its last task finished (exit code 9)" in caplog.text


def test_a_world_started_from_a_thread_that_ends_keeps_its_ranks():
    """A rank's death signal is tied to the thread that forked it: ranks forked from a worker
    thread (a check in a ThreadPoolExecutor) must not die when that thread ends."""
    import threading

    world = World(2)
    try:
        starter = threading.Thread(target=world.start)
        starter.start()
        starter.join()
        pids = world.pids
        time.sleep(1.5)  # SIGKILL would have come at once
        assert all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        assert world.run(lambda ctx: ctx.rank) == [0, 1] and world.pids == pids  # the same ranks, no rebuild
    finally:
        world.close()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_parent_of_forkserver_ranks_busy_in_a_task_leaves_no_process(tmp_path, how):
    """``threads_per_rank=2`` starts ranks from the forkserver; the parent dies mid-task."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(
        """
        import time
        from ddparity import World
        world = World(2, threads_per_rank=2).start()
        print(" ".join(map(str, world.pids)), flush=True)
        world.run(lambda ctx: time.sleep(600))
        """
    ))
    # short: the forkserver's socket lives in it (AF_UNIX paths end at 108 bytes)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ddparity-test-", dir="/tmp"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        ranks = {int(p) for p in proc.stdout.readline().split()}
        assert len(ranks) == 2
        time.sleep(1.0)  # the task is running
        everything = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | ranks
        proc.send_signal(how)
        proc.wait(timeout=10)
        assert not wait_gone(everything, 15), "the forkserver, its tracker or ranks outlived their parent"
        assert list(tmp.glob("pymp-*")) == []  # multiprocessing's directory (the forkserver's socket) too
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def _late_to_the_all_reduce(ctx, late: float):
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        time.sleep(late)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_the_process_group_timeout_follows_the_task_timeout_not_the_worlds(monkeypatch):
    """The pool built worlds with the world's timeout, so torch's process-group timeout was
    always its own: a task allowed more (``--timeout 600``: a long compile) met gloo's
    timeout first, with gloo's message instead of ddparity's report. Here the world's PG
    timeout is 1 + 1 s; a task allowed 20 s whose rank 1 is 4 s late completes."""
    from ddparity.harness.world import world as world_module

    monkeypatch.setattr(world_module, "PG_TIMEOUT_MARGIN_S", 1.0)
    with World(2, timeout=1.0) as world:
        assert world.run(_late_to_the_all_reduce, 4.0, timeout=20.0) == [2.0, 2.0]
        # and a task allowed less than the delay is the controller's report, not gloo's error
        with pytest.raises(TaskTimeout):
            world.run(_late_to_the_all_reduce, 30.0, timeout=2.0)


@pytest.mark.parametrize("culprit", [0, 2])
def test_a_hang_names_the_rank_behind_in_the_collective_sequence(culprit):
    """A rank that never reaches the all-reduce the others wait in is the suspect (rank 0
    and the last rank, not only rank 1); the message said only "rank(s) [0, 1, 2] made no
    progress"."""
    with World(3) as world:
        with pytest.raises(TaskTimeout) as caught:
            world.run(_late_to_the_all_reduce_on, culprit, timeout=2.0)
    err = caught.value
    assert err.suspect_ranks == [culprit] and f"suspect rank(s) [{culprit}]" in str(err), str(err)
    assert sorted(err.pending_ranks) == [0, 1, 2]
    again = pickle.loads(pickle.dumps(err))
    assert again.suspect_ranks == [culprit] and again.pending_ranks == err.pending_ranks


def _late_to_the_all_reduce_on(ctx, culprit: int):
    import torch
    import torch.distributed as dist

    if ctx.rank == culprit:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def test_a_controller_whose_autograd_threads_started_starts_ranks_from_the_forkserver(tmp_path):
    """A rank forked after torch's autograd engine started its device threads dies at its
    first backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). The threads are told by their names: in a fresh process (a pytest
    worker may have started real ones), a thread named as torch names them stands in."""
    script = tmp_path / "named_thread.py"
    script.write_text(textwrap.dedent("""
        import ctypes
        import threading

        from ddparity.harness.world import spawn

        named, leave = threading.Event(), threading.Event()

        def autograd_like():
            ctypes.CDLL(None).prctl(15, b"pt_autograd_0", 0, 0, 0)  # PR_SET_NAME: this thread's name
            named.set()
            leave.wait(60)

        assert not spawn.autograd_threads_started()
        assert spawn.start_method("gloo", 1) == "fork"
        thread = threading.Thread(target=autograd_like, daemon=True)
        thread.start()
        assert named.wait(60)
        assert spawn.autograd_threads_started()
        assert spawn.start_method("gloo", 1) == "forkserver"
        leave.set()
        thread.join(60)
        assert not spawn.autograd_threads_started()
        print("told apart")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "told apart" in done.stdout, done.stdout + done.stderr


def test_a_check_after_a_compile_in_the_users_process_runs(tmp_path):
    """On torch 2.14 AOT autograd (a torch.compile in the user's process, an earlier test in
    the same pytest worker) starts autograd's device threads; ranks forked after that died,
    every row an error read as the user's (torch 2.13's CPU build starts none)."""
    script = tmp_path / "compiled_first.py"
    script.write_text(textwrap.dedent("""
        import torch
        from ddparity import check
        from ddparity.fixtures import bugs
        from ddparity.harness.world import spawn

        torch.compile(torch.nn.Linear(4, 4), backend="aot_eager")(torch.randn(2, 4)).sum()
        if spawn.autograd_threads_started():
            assert spawn.start_method("gloo", 1) == "forkserver"
        report = check(bugs.summed_loss(), modes=("single", "ddp"), world_sizes=(2,))
        print([(r.mode, r.status) for r in report.runs])
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[('single', 'pass'), ('ddp', 'diverged')]" in done.stdout, done.stdout + done.stderr
