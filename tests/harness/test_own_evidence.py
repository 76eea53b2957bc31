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
