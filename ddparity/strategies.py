"""Hypothesis strategies for property tests of data-parallel training.

    from hypothesis import HealthCheck, given, settings
    from ddparity import strategies as dps

    @pytest.mark.world_size(2)
    @settings(max_examples=20, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])  # parity is reusable
    @given(case=dps.cases(world_size=2))
    def test_ddp_matches_one_device(case, parity):   # parity: the pytest plugin's fixture
        parity(case)

Every generated piece has a readable, reproducible ``repr`` (a falsifying example prints
``Case(model=MLPFactory(sizes=(3, 7, 2)), data=RandomBatches(batch=6, ...), ...)``, which
can be pasted back into a test), and every batch splits evenly over the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from ddparity.case import Case

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class MLPFactory:
    """Builds ``Linear -> act -> ... -> Linear`` through ``sizes`` (a Case's ``model``)."""

    sizes: tuple[int, ...]
    activation: str = "tanh"

    def __call__(self) -> Any:
        from torch import nn

        layers: list[Any] = []
        for i, (a, b) in enumerate(zip(self.sizes, self.sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(self.sizes) - 2:
                layers.append({"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}[self.activation]())
        return nn.Sequential(*layers)


@dataclass(frozen=True)
class RandomBatches:
    """A Case's ``data``: ``batch`` random vectors of ``features`` and class labels."""

    batch: int
    features: int
    classes: int

    def __call__(self, step: int, generator: Any) -> tuple[Any, Any]:
        import torch

        inputs = torch.randn(self.batch, self.features, generator=generator)
        targets = torch.randint(0, self.classes, (self.batch,), generator=generator)
        return inputs, targets


def layer_sizes(min_hidden: int = 0, max_hidden: int = 3, max_width: int = 24) -> st.SearchStrategy[tuple[int, ...]]:
    """Input width, hidden widths, and at least 2 classes."""
    return st.tuples(
        st.integers(1, max_width),
        st.lists(st.integers(1, max_width), min_size=min_hidden, max_size=max_hidden),
        st.integers(2, max(2, max_width)),
    ).map(lambda t: (t[0], *t[1], t[2]))


def world_sizes(max_size: int = 4) -> st.SearchStrategy[int]:
    return st.integers(1, max_size)


def batch_sizes(world_size: int, max_per_rank: int = 6) -> st.SearchStrategy[int]:
    """Global batch sizes every rank gets an equal, non-empty share of."""
    return st.integers(1, max_per_rank).map(lambda per_rank: per_rank * world_size)


def ddp_options() -> st.SearchStrategy[dict[str, Any]]:
    """DDP settings that must not change the result."""
    return st.fixed_dictionaries(
        {},
        optional={
            "gradient_as_bucket_view": st.booleans(),
            "bucket_cap_mb": st.sampled_from([0.001, 1, 25]),
            "broadcast_buffers": st.booleans(),
            "static_graph": st.booleans(),
        },
    )


@st.composite
def cases(draw: Any, world_size: int | None = None, max_world_size: int = 4,
          optimizers: tuple[str, ...] = OPTIMIZERS, max_steps: int = 3) -> Case:
    """Whole Cases: an MLP, its batches (divisible by ``world_size``, or by every world
    size up to ``max_world_size``), an optimizer, a learning rate, steps, DDP options."""
    sizes = draw(layer_sizes())
    if world_size is None:
        divisor = 1
        for ws in range(2, max_world_size + 1):
            divisor = divisor * ws // _gcd(divisor, ws)
    else:
        divisor = world_size
    batch = draw(batch_sizes(divisor, max_per_rank=4 if world_size is None else 6))
    return Case(
        model=MLPFactory(sizes, draw(st.sampled_from(["tanh", "relu", "gelu"]))),
        data=RandomBatches(batch, sizes[0], sizes[-1]),
        optimizer=draw(st.sampled_from(optimizers)),
        lr=draw(st.sampled_from([1e-3, 1e-2, 1e-1])),
        steps=draw(st.integers(1, max_steps)),
        seed=draw(st.integers(0, 2**16)),
        ddp_options=draw(ddp_options()),
    )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
