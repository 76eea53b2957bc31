"""Every optimizer torch ships (``torch.optim``), in every replicated mode at 2 and 4 ranks:
the clean MLP passes, and a summed loss is caught under DDP and FSDP2. Where FSDP2's
DTensors cannot run an optimizer's own ops (Rprop's masked write, Adafactor's row norms),
the row is a crash that names the optimizer's file (never a pass, never the model's fault).
Measured on torch 2.13; an optimizer the installed torch lacks is skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddparity import Case, check
from ddparity.fixtures import bugs, models

pytestmark = [pytest.mark.breadth, pytest.mark.usefixtures("no_leftover_processes")]

OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
              "Rprop", "Adafactor", "Muon"]
NOT_ON_DTENSORS = {"Rprop", "Adafactor"}
"""torch 2.13's DTensor refuses an op of their step on FSDP2's shards."""


def _factory(name: str):  # noqa: ANN202
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{name}")

    def make(params):  # noqa: ANN001, ANN202
        params = list(params)
        if name == "Muon":  # it orthogonalises matrices only: the biases stay as they are
            params = [p for p in params if p.ndim == 2]
        return cls(params, lr=0.01, **({"momentum": 0.9} if name == "SGD" else {}))

    return make


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_torch_optimizer_passes_clean_and_catches_a_summed_loss_in_every_mode(name):
    make = _factory(name)
    clean = check(Case(model=models.MLP, data=models.vectors, optimizer=make, steps=3, name=f"clean, {name}"),
                  modes=("single", "dp", "ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    sharded = {"fsdp", "hsdp"}
    for run in clean.runs:
        if run.mode in sharded and name in NOT_ON_DTENSORS:
            assert run.status == "crash", clean.render()
            assert any(n.startswith(f"likely cause: torch.optim's {name.lower()}.py runs aten.") for n in run.notes), \
                run.notes
        else:
            assert run.status == "pass", clean.render()
    summed = check(dataclasses.replace(bugs.summed_loss(), optimizer=make), modes=("ddp", "fsdp"), world_sizes=(2,))
    for run in summed.runs:
        expected = "crash" if run.mode in sharded and name in NOT_ON_DTENSORS else "diverged"
        assert run.status == expected, summed.render()
        if expected == "diverged":
            d = run.first_divergence
            assert d.step == 0 and d.max_abs > 100 * d.tolerance, summed.render()
