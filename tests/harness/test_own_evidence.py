"""What a launched rank reports about itself in a hang: its native stack (py-spy on itself)
and its own Flight Recorder's state (tests/e2e/test_watch.py and test_torchrun.py drive
both through a real hang)."""

from __future__ import annotations

import threading

from ddparity.harness.launch.flight import own_flight_state
from ddparity.harness.world import stacks


def _parked(ready: threading.Event, done: threading.Event) -> None:
    ready.set()
    done.wait(30)


def test_a_process_dumps_its_own_stack_with_native_frames_and_every_thread():
    ready, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=_parked, args=(ready, done), name="parked-worker")
    worker.start()
    ready.wait(5)
    try:
        text = stacks.own_native_stacks(10.0)
    finally:
        done.set()
        worker.join()
    assert 'Thread' in text and "parked-worker" in text and "_parked (tests/harness/test_own_evidence.py:" in text
    assert "(libc.so" in text or "(libpython" in text  # native frames, where C waits
    assert "test_a_process_dumps_its_own_stack" in text  # the main thread, dumping itself


def test_without_py_spy_it_returns_nothing_for_the_python_stacks_to_stand_in(monkeypatch):
    monkeypatch.setattr(stacks, "_py_spy", lambda: None)
    assert stacks.own_native_stacks(1.0) == ""


def test_the_flight_recorder_outside_a_process_group_says_why_it_has_nothing():
    state = own_flight_state()
    assert "groups" not in state and state["error"]


def test_a_rank_stopped_before_the_mismatch_reads_as_missing_from_it_alone(tmp_path):
    """PyTorch's own analyser over three ledgers written as Flight Recorder dumps: rank 0
    was stopped in its forward after its all-reduce completed, rank 2 broadcast where rank 1
    all-reduced. The one collective with errors is the mismatch, rank 0 missing from it."""
    import subprocess
    import sys

    from ddparity.harness.launch.flight import fr_dump, write_fr_dump
    from ddparity.records import encode_entry

    def line(seq, op, desc, async_):
        return encode_entry("world", seq, op, op, desc, "train.py:28 in main", "", 0, "forward", 1.0 + seq, async_)

    reduce = "all_reduce(tensor=float32[8], op=SUM)"
    ledgers = {0: ([line(0, "all_reduce", reduce, True)], False),
               1: ([line(0, "all_reduce", reduce, True), line(1, "all_reduce", reduce, True)], True),
               2: ([line(0, "all_reduce", reduce, True), line(1, "broadcast", "broadcast(tensor=float32[5], root=0)",
                                                             False)], True)}
    for rank, (lines, running) in ledgers.items():
        write_fr_dump(str(tmp_path / "fr"), rank, fr_dump(lines, rank, 3, {}, running))
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "fr"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    shown = fr.stdout + fr.stderr
    assert "Not all ranks joining collective, sequence number: 2" in shown and "missing ranks: {0}" in shown, shown
    assert "has errors" not in shown, shown  # the all-reduce rank 0 completed is not read as where it stopped
