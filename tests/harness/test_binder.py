"""The ledger's fast argument binding agrees with ``inspect.Signature.bind`` on every
recorded collective, for every way of passing its arguments, good or bad: the ledger
compares these arguments across ranks, so a rank passing them by keyword, in another
order, must compare alike, and a bad call must still reach torch's own error."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ddparity.harness.recording.calls import RECORDED, Binder

OPS = [op for op in RECORDED if callable(getattr(dist, op, None))]


def _expected(signature: inspect.Signature, args: tuple, kwargs: dict) -> list | type:
    try:
        return list(signature.bind(*args, **kwargs).arguments.items())
    except TypeError:
        return TypeError


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_binds_as_the_signature_does(op, data):
    binder = Binder(getattr(dist, op))
    names = list(binder.signature.parameters)
    positional = data.draw(st.integers(0, len(names) + 1), label="positional")
    args = tuple(f"arg{i}" for i in range(positional))
    keywords = data.draw(st.lists(st.sampled_from(names + ["bogus"]), unique=True), label="keywords")
    kwargs = {name: f"kw-{name}" for name in keywords}
    expected = _expected(binder.signature, args, kwargs)
    if expected is TypeError:
        with pytest.raises(TypeError):
            binder.bind(args, kwargs)
    else:
        assert list(binder.bind(args, kwargs).items()) == expected  # the same names, values and order


def test_every_recorded_collective_takes_the_fast_path():
    """No recorded collective falls back to ``Signature.bind`` on an ordinary call (the
    fast path is what keeps the ledger cheap)."""
    slow = [op for op in OPS if not Binder(getattr(dist, op)).fast]
    assert slow == []
