"""The one rule that ends a running task (``harness/deadlines.py``), shared by a local World
and a launch's watch: what ends it, in which order, and when."""

import math

import pytest

from ddparity.harness.deadlines import Ending, TaskClock


def clock(**kw):
    return TaskClock(started=0.0, timeout=10.0, error_grace=2.0, **kw)


def test_a_task_that_keeps_progressing_runs_on_until_its_hard_deadline():
    c = clock(hard_deadline=30.0)
    for now in range(1, 30):
        c.progressed(float(now))
        assert c.decide(float(now)) is None
    assert c.decide(30.0) is Ending.TIMED_OUT


def test_silence_past_the_timeout_is_a_hang():
    c = clock()
    c.progressed(3.0)
    assert c.decide(12.9) is None and c.due() == 13.0
    assert c.decide(13.0) is Ending.TIMED_OUT


def test_a_raise_ends_the_task_after_the_error_grace_not_the_timeout():
    c = clock()
    c.raised(1.0)
    c.raised(1.5)  # only the first counts
    assert c.decide(2.9) is None
    assert c.decide(3.0) is Ending.FAILED
    assert c.decide(3.0, grace=6.0) is None and c.decide(7.0, grace=6.0) is Ending.FAILED


def test_after_a_raise_a_quiet_world_ends_early():
    c = clock(quiet_s=0.25)
    c.raised(1.0)
    assert c.due() == 1.25
    c.progressed(1.2)  # a rank finished meanwhile: quiet counts from there
    assert c.due() == pytest.approx(1.45)


@pytest.mark.parametrize("first_failure", [None, 1.0])
def test_a_stop_on_purpose_comes_first_then_a_death(first_failure):
    c = clock(first_failure=first_failure)
    assert c.decide(99.0, stopped=True, dead=True) is Ending.STOPPED
    assert c.decide(99.0, dead=True) is Ending.CRASHED
    assert c.decide(0.5, dead=True) is Ending.CRASHED  # a death needs no deadline


def test_the_defaults_leave_no_deadline_but_the_timeout():
    c = TaskClock(started=5.0, timeout=1.0, error_grace=1.0)
    assert c.last_progress == 5.0 and c.quiet_s == math.inf and c.due() == 6.0
