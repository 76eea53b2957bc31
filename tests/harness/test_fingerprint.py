"""The non-finite count a step's fingerprint carries (the evidence of which of two ranks that
disagree went wrong): every NaN and inf in the part fingerprinted is counted, in every
floating dtype, and nothing else is."""

from __future__ import annotations

import pytest
import torch

from ddparity.harness.recording.fingerprint import SLICE_MIN, SLICES, nonfinite_count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_each_nan_or_inf_counts_its_tensor_once_and_large_finite_values_do_not(dtype):
    big = torch.finfo(dtype).max
    clean = [torch.full((4, 4), big, dtype=dtype), torch.full((3,), -big, dtype=dtype), torch.zeros(2, dtype=dtype)]
    assert int(nonfinite_count(clean)) == 0  # the largest values, summed, are no inf
    broken = [t.clone() for t in clean]
    broken[0][1, 2] = float("nan")
    broken[1][0] = float("inf")
    broken[2][:] = torch.tensor([float("inf"), float("-inf")], dtype=dtype)  # +inf and -inf: still counted
    assert int(nonfinite_count(broken)) == 3
    assert int(nonfinite_count([torch.arange(3)])) == 0  # integer tensors have no NaN


def test_a_large_tensor_is_read_a_slice_a_step():
    t = torch.zeros(SLICE_MIN * 2)
    size = -(-t.numel() // SLICES)
    t[3 * size + 5] = float("nan")  # in slice 3 only
    assert [int(nonfinite_count([t], part)) for part in range(SLICES)] == [int(p == 3) for p in range(SLICES)]
    assert int(nonfinite_count([t])) == 1  # no part: the whole tensor


def test_several_models_of_a_watched_script_get_their_class_as_a_prefix_and_blocks_none():
    """A GAN's two models under DDP each name a parameter "0.weight": each gets its class
    (and its build order where two share one); FSDP2's blocks inside their root, or a root
    holding one block and nothing else, leave one model, and no prefix."""
    from torch import nn

    from ddparity.harness.recording.replicas import _root_prefixes

    class Generator(nn.Sequential):
        pass

    g, d, e = Generator(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 1)), nn.Sequential(nn.Linear(2, 1))
    assert _root_prefixes([g, d]) == {id(g): "Generator.", id(d): "Sequential."}
    assert _root_prefixes([d, e]) == {id(d): "Sequential#0.", id(e): "Sequential#1."}
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert _root_prefixes([root[0], root[1], root]) == {}  # fully_shard on each block, then the root
    wrapper = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert _root_prefixes([wrapper[0], wrapper]) == {}  # the same parameters: one model
