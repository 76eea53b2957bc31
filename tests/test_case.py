"""Case validation and target loading: every bad input names the problem and the fix."""

from __future__ import annotations

import textwrap

import pytest
import torch

from ddparity.case import Case, load_case, load_target, resolve_loss
from ddparity.errors import UsageError
from ddparity.fixtures.models import MLP, vectors


def good(**changes):
    fields = dict(model=MLP, data=vectors)
    fields.update(changes)
    return Case(**fields)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(loss="no_such_loss"), "unknown loss 'no_such_loss'"),
        (dict(loss="relu"), "unknown loss 'relu'"),
        (dict(optimizer="lbfgs2"), "unknown optimizer 'lbfgs2'"),
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(seed="x"), "seed must be an int"),
        (dict(lr=-1.0), "lr must be a positive, finite number"),
        (dict(lr=float("nan")), "lr must be a positive, finite number"),
        (dict(lr=float("inf")), "lr must be a positive, finite number"),
        (dict(seed=2**70), "seed must be an int with 0 <= seed < 2"),
        (dict(dtype=torch.int64), "dtype must be a floating torch.dtype"),
        (dict(ddp_options={"bucket_size": 3}), "unknown DDP option"),
        (dict(model=3), "Case.model must be a callable"),
        (dict(data=None), "Case.data must be a callable"),
    ],
)
def test_bad_fields_are_named(changes, message):
    with pytest.raises(UsageError, match=message):
        good(**changes).validate()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model=lambda: None), "the model factory returned NoneType, not a torch.nn.Module"),
        (dict(optimizer=lambda params: None), "the optimizer factory returned NoneType, not a torch.optim.Optimizer; "
                                              "return the optimizer it builds"),
        (dict(optimizer=lambda params: torch.optim.SGD), "the optimizer factory returned type"),
    ],
)
def test_a_factory_returning_the_wrong_thing_is_named_on_every_mode_not_as_ddparitys_own_error(changes, message):
    """An optimizer factory returning None ran into ddparity's hooks ("AttributeError: 'NoneType'
    object has no attribute 'register_step_pre_hook'", with ddparity's frames)."""
    from ddparity import check

    report = check(good(**changes), modes=("single", "ddp"), world_sizes=(1, 2), timeout=60)
    assert [r.status for r in report.runs] == ["error"] * 3, report.render()
    assert message in report.render() and "AttributeError" not in report.render(), report.render()


def test_named_losses_resolve():
    assert resolve_loss("mse_loss") is torch.nn.functional.mse_loss
    assert resolve_loss("cross_entropy") is torch.nn.functional.cross_entropy


def test_module_and_file_targets_load(tmp_path):
    assert load_target("ddparity.fixtures.models:mlp_sgd")().name == "demo: MLP + SGD"
    path = tmp_path / "my_case.py"
    path.write_text(textwrap.dedent(
        """
        from ddparity import Case
        from ddparity.fixtures.models import MLP, vectors
        def case():
            return Case(model=MLP, data=vectors)
        """
    ))
    case = load_case(f"{path}:case")
    assert case.target == f"{path}:case" and case.name == f"{path}:case"


def test_a_target_file_calling_torch_ops_and_backends_travels_to_the_ranks(tmp_path):
    """A function pickled by value that used ``torch.ops.aten...`` was refused before any
    work ("cannot pickle '_Ops' object ... pass plain data"): cloudpickle took torch's
    module-like namespaces for submodules to pickle."""
    from ddparity import check

    path = tmp_path / "ops_case.py"
    path.write_text(textwrap.dedent(
        """
        import torch
        from ddparity import Case
        from ddparity.fixtures.models import MLP, vectors
        class OpsMLP(MLP):
            def forward(self, x):
                assert not torch.backends.cudnn.is_available() or torch.backends.cudnn.enabled
                return torch.ops.aten.relu.default(super().forward(x))
        def case():
            return Case(model=OpsMLP, data=vectors, steps=2)
        """
    ))
    report = check(load_case(f"{path}:case"), world_sizes=(2,))
    assert report.ok, report.render()


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_colon", "must look like"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("ddparity.fixtures.models:nothing", "has no attribute 'nothing'"),
        ("/does/not/exist.py:f", "does not exist"),
        ("ddparity.fixtures.models:MLP", "returned MLP, not a ddparity.Case"),
    ],
)
def test_bad_targets_are_named(target, message):
    with pytest.raises(UsageError, match=message):
        load_case(target)


def test_a_target_that_raises_is_a_usage_error(tmp_path):
    path = tmp_path / "raises.py"
    path.write_text("def case():\n    raise RuntimeError('nope')\n")
    with pytest.raises(UsageError, match="raised RuntimeError: nope"):
        load_case(f"{path}:case")
