"""Whose error a rank's traceback shows: ddparity's own harness code, or the user's."""

from __future__ import annotations

import os

import torch

from ddparity.frames import PACKAGE, own_error_site

TORCH = os.path.dirname(torch.__file__)
RANK = os.path.join(PACKAGE, "harness", "ranks", "rank.py")


def _tb(*files: str) -> str:
    lines = ["Traceback (most recent call last):"]
    for i, f in enumerate(files):
        lines += [f'  File "{f}", line {10 + i}, in fn{i}', "    code()"]
    return "\n".join(lines + ["RuntimeError: boom"])


def test_an_error_torch_raises_inside_a_harness_hook_is_ddparitys():
    tb = _tb(RANK, os.path.join(PACKAGE, "harness", "ranks", "stepping.py"), os.path.join(TORCH, "optim", "optimizer.py"),
             os.path.join(PACKAGE, "harness", "ranks", "spool.py"), os.path.join(TORCH, "_tensor.py"))
    assert own_error_site(tb) == "harness/ranks/spool.py:13"


def test_an_error_in_the_users_code_or_torch_under_it_is_the_users():
    user = "/home/me/project/model.py"
    assert own_error_site(_tb(RANK, os.path.join(PACKAGE, "harness", "ranks", "stepping.py"), user)) is None
    assert own_error_site(_tb(RANK, user, os.path.join(TORCH, "nn", "functional.py"))) is None
    # torch raising under the step driver over the user's set-up (an unused parameter)
    assert own_error_site(_tb(RANK, os.path.join(PACKAGE, "harness", "ranks", "stepping.py"),
                              os.path.join(TORCH, "nn", "parallel", "distributed.py"))) is None
    # the fixtures stand for a user's model
    assert own_error_site(_tb(RANK, os.path.join(PACKAGE, "fixtures", "faults.py"))) is None
    assert own_error_site("no traceback at all") is None


def test_the_observers_named_are_files_that_exist():
    """A file moved to another room must not silently turn its errors into the user's."""
    from ddparity.frames import OBSERVERS, WRAPPERS

    missing = [f for f in OBSERVERS + WRAPPERS if not os.path.isfile(os.path.join(PACKAGE, f))]
    assert not missing, f"frames names files that are not in the package: {missing}"


def test_torch_raising_under_a_collective_the_recorder_passes_on_is_the_users():
    user = "/home/me/project/train.py"
    recorder = os.path.join(PACKAGE, "harness", "recording", "recorder.py")
    c10d = os.path.join(TORCH, "distributed", "distributed_c10d.py")
    assert own_error_site(_tb(RANK, user, recorder, c10d)) is None
    # the recorder's own line raising is ddparity's
    assert own_error_site(_tb(RANK, user, recorder)) == "harness/recording/recorder.py:12"
    # torch raising inside the comparison (distances, the comparer) is ddparity's
    comparer = os.path.join(PACKAGE, "harness", "ranks", "comparer.py")
    distances = os.path.join(PACKAGE, "distances.py")
    assert own_error_site(_tb(RANK, comparer, distances, os.path.join(TORCH, "_tensor.py"))) == "distances.py:12"
