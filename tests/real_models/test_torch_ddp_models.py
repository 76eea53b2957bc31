"""PyTorch's own DDP test models (``torch/testing/_internal``), trained as users would:
every clean one passes in every mode at world sizes 1, 2 and 4; its summed-loss twin is
caught at step 0 at 2 and 4 ranks; BatchNorm in training mode on shards is caught clean."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ddparity import check
from ddparity.fixtures import torch_tests

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"),
              pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                                 reason="torch.testing._internal needs expecttest (the [real] extra; .ci/run installs it)")]


@pytest.mark.parametrize("name", torch_tests.NAMES)
def test_torchs_own_ddp_test_models_pass_clean_and_are_caught_summed(name):
    clean = check(torch_tests.case(name), modes=("single", "dp", "ddp"), world_sizes=(1, 2, 4))
    if name in torch_tests.ON_SHARDS:
        assert [r.status for r in clean.runs if r.world_size > 1] == ["diverged"] * 4, clean.render()
    else:
        assert clean.ok, clean.render()
    summed = check(torch_tests.case(name, summed=True), modes=("ddp",), world_sizes=(2, 4))
    for run in summed.runs:
        d = run.first_divergence
        assert run.status == "diverged" and d is not None and d.step == 0, summed.render()
        assert d.max_abs >= 100 * d.tolerance, (run.world_size, d)
        assert any("a loss summed over the batch" in note for note in run.notes), run.notes


def test_importing_torchs_test_module_leaves_no_launch_variables_behind():
    before = {k: os.environ.get(k) for k in ("BACKEND", "WORLD_SIZE")}
    torch_tests.models()
    assert {k: os.environ.get(k) for k in ("BACKEND", "WORLD_SIZE")} == before
