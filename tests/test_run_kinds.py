"""The table of run kinds (``ddparity.run_kinds``): each mode's row says what differs, and
what the rest of the package derives from it (mode lists, skips, notes, reproduce lines,
the task that trains it) follows from that row alone."""

from __future__ import annotations

import inspect

import pytest

from ddparity import Case, check, settings
from ddparity.errors import UsageError
from ddparity.fixtures.models import MLP, vectors
from ddparity.harness.ranks import tasks, threaded
from ddparity.run_kinds import KINDS, MODES, REPLICA_MODES, SHARDED_MODES, asked, kind
from ddparity.settings import CheckOptions
from ddparity.verbs.plan import check_repro, profile_repro


def test_the_mode_lists_are_read_from_the_rows():
    assert MODES == ("single", "dp", "ddp", "fsdp", "hsdp") == settings.MODES
    assert REPLICA_MODES == ("ddp", "fsdp", "hsdp")
    assert SHARDED_MODES == ("fsdp", "hsdp")
    assert len({k.name for k in KINDS}) == len(KINDS)
    assert [k.name for k in KINDS if k.reference] == ["single"]
    assert asked(["hsdp", "ddp", "single"], "replicated") == ["hsdp", "ddp"]
    # a row is one of: the reference, replicas in one process, or a replica on every rank
    assert all(k.reference + k.one_process + k.replicated == 1 for k in KINDS)
    assert all(k.replicated for k in KINDS if k.sharded or k.buckets)
    assert all(k.sharded for k in KINDS if k.mesh)


def test_an_unknown_mode_is_named_with_the_choices():
    with pytest.raises(UsageError, match=r"unknown mode 'tp'; choose from single, dp, ddp, fsdp, hsdp"):
        kind("tp")


def test_only_a_mesh_kind_skips_a_world_size_its_shard_size_does_not_divide():
    hsdp, fsdp = kind("hsdp"), kind("fsdp")
    assert hsdp.skip_reason(4, 2) is None and hsdp.skip_reason(4, 4) is None
    reason = hsdp.skip_reason(6, 4)
    assert reason is not None and "divisible by the shard size 4" in reason and "divisor of 6" in reason
    assert fsdp.skip_reason(6, 4) is None and kind("ddp").skip_reason(6, 4) is None
    assert (hsdp.shard_size(8, 2), fsdp.shard_size(8, 2), kind("ddp").shard_size(8, 2)) == (2, 8, 0)
    assert hsdp.mesh_note(8, 2) == "hsdp mesh: 4 replica(s) x 2 shard(s)" and fsdp.mesh_note(8, 2) is None


def test_reproduce_lines_carry_a_kinds_own_options_only():
    case = Case(model=MLP, data=vectors, steps=2)
    opts = CheckOptions.validated("check", hsdp_shard=2)
    assert "hsdp_shard=2" in check_repro(case, opts, "hsdp", 4, "gloo")
    assert "hsdp_shard" not in check_repro(case, opts, "fsdp", 4, "gloo")
    target = Case(model=MLP, data=vectors, steps=2, target="train.py")
    assert check_repro(target, opts, "hsdp", 4, "gloo") == (
        "ddparity check train.py --modes hsdp --hsdp-shard 2 --world-sizes 4 --backend gloo --steps 2 --tolerance auto")
    assert " --modes " not in profile_repro(target, 2, "gloo", 3, 1, 60)  # profile's default mode: said by none
    assert " --modes hsdp --hsdp-shard 2 " in profile_repro(target, 2, "gloo", 3, 1, 60, "hsdp", 2)
    assert "modes=('fsdp',), world_sizes" in profile_repro(case, 2, "gloo", 3, 1, 60, "fsdp", 0)


def test_local_and_launched_reproduce_lines_are_one_line_with_the_timeout_asked_for():
    """A launched run's line is a local one without the world size (torchrun decides it);
    both keep a timeout other than the default (a hang's line reproduces the hang)."""
    target = Case(model=MLP, data=vectors, steps=2, target="train.py")
    opts = CheckOptions.validated("check", timeout=5, tolerance=1e-4)
    local = check_repro(target, opts, "ddp", 2, "gloo")
    assert local == ("ddparity check train.py --modes ddp --world-sizes 2 --backend gloo --steps 2 "
                     "--tolerance 0.0001 --timeout 5")
    launched = check_repro(target, opts, "ddp", None, "gloo")
    assert launched == local.replace("ddparity check", "torchrun <the same launch options> -m ddparity check").replace(
        " --world-sizes 2", "")
    assert ", timeout=5)" in check_repro(Case(model=MLP, data=vectors), opts, "ddp", 2, "gloo")
    assert "--timeout" not in check_repro(target, CheckOptions.validated("check"), "ddp", 2, "gloo")


def test_one_task_trains_every_replicated_kind_and_simulated_ranks_are_handed_it():
    """No mode name reaches the simulated ranks' host: it runs the task it is given."""
    params = inspect.signature(tasks.replica_task).parameters
    assert list(params)[:5] == ["ctx", "case", "spool", "mode", "shard_size"]
    assert "mode" not in inspect.signature(threaded.threaded_task).parameters
    with pytest.raises(UsageError, match="does not run a replica on every rank"):
        tasks.replica_task(None, Case(model=MLP, data=vectors), "", "dp")


def test_a_usage_error_is_a_value_error_to_code_that_catches_bad_arguments():
    """Hypothesis, argparse-style wrappers and plain ``except ValueError`` catch ddparity's."""
    with pytest.raises(ValueError, match="unknown mode 'tp'"):
        check(Case(model=MLP, data=vectors), modes=("tp",))
    assert issubclass(UsageError, ValueError)
