"""Eager against compiled, block by block: where the compiled single-device run differs from
the eager reference, the first block whose compiled output differs from its eager output on
the same input is named, with its graph breaks; blocks in a ModuleList are searched too; a
model whose compiled forward agrees names none."""

from __future__ import annotations

import pytest
import torch

from ddparity import check
from ddparity.fixtures import compiled
from ddparity.harness.ranks.compiled_blocks import first_differing_block
from ddparity.render import module_line
from ddparity.verbs import compiled as compiled_module


def single(report):
    [run] = [r for r in report.runs if r.mode == "single" and r.compile]
    return run


def test_a_block_in_a_module_list_is_named_with_its_graph_break():
    report = check(compiled.block_differs_when_compiled(), modes=("single",), world_sizes=(2,), compile="aot_eager")
    run = single(report)
    assert run.status == "diverged"
    block = run.first_divergence.module
    assert (block.phase, block.module, block.type) == ("compiled", "blocks.1", "_Block"), module_line(block)
    assert block.error > block.tolerance
    assert block.note.startswith("1 graph break(s) in it: Unsupported Tensor.item() call"), block.note
    assert "none of its children differs compiled alone: the difference is in its own forward" in block.note
    assert "first block that differs compiled: blocks.1 (_Block)" in report.render()
    assert report.to_json()["runs"][1]["first_divergence"]["module"]["phase"] == "compiled"


@pytest.mark.breadth
def test_a_difference_in_the_models_own_forward_names_the_model():
    report = check(compiled.differs_when_compiled(), modes=("single",), world_sizes=(2,), compile="aot_eager")
    block = single(report).first_divergence.module
    assert (block.module, block.type) == ("", "TracedDifferently"), module_line(block)
    assert "the model (TracedDifferently)" in module_line(block)


def test_a_model_whose_compiled_forward_agrees_names_no_block():
    torch.manual_seed(0)
    model = compiled.Wide()
    x = torch.randn(8, 16)
    assert first_differing_block(model, "", ((x,), {}), "aot_eager") is None


def _failing_search(ctx, case, spool, spec):
    raise RuntimeError("the search broke")


def test_a_search_that_fails_is_a_note(monkeypatch):
    monkeypatch.setattr(compiled_module, "compiled_blocks_task", _failing_search)
    report = check(compiled.differs_when_compiled(), modes=("single",), world_sizes=(2,), compile="aot_eager")
    run = single(report)
    assert run.status == "diverged" and run.first_divergence.module is None
    [note] = [n for n in run.notes if n.startswith("first block that differs compiled: not found")]
    assert "the search failed" in note, note


@pytest.mark.parametrize(("mode", "ws"), [("ddp", 2), ("fsdp", 2), pytest.param("hsdp", 4, marks=pytest.mark.breadth)])
def test_a_compiled_data_parallel_run_searches_its_own_ranks_blocks(mode, ws):
    # the block differs compiled on one device and on every rank's shard: the row names it from its own ranks
    # (FSDP2's sharded parameters gathered whole for the search)
    report = check(compiled.block_differs_when_compiled(), modes=("single", mode), world_sizes=(ws,),
                   compile="aot_eager")
    [run] = [r for r in report.runs if r.mode == mode and r.compile]
    assert run.status == "diverged", report.render()
    block = run.first_divergence.module
    assert (block.phase, block.module, block.type, block.step, block.rank) == ("compiled", "blocks.1", "_Block", 0, 0)
    assert block.note.startswith("1 graph break(s) in it: Unsupported Tensor.item() call"), block.note
    assert "first block that differs compiled: blocks.1 (_Block), step 0, rank 0" in report.render()
    [row] = [r for r in report.to_json()["runs"] if r["mode"] == mode and r["compile"]]
    assert row["first_divergence"]["module"]["module"] == "blocks.1"


def test_the_rank_search_computes_in_a_mixed_precision_policys_dtype():
    """Under FSDP2 with bf16 parameters the kept call's inputs are bf16: the plain copy searched
    computes in bf16 too (it failed on "mat1 and mat2 must have the same dtype")."""
    from ddparity.fixtures import sharded

    report = check(sharded.summed_bf16(), modes=("single", "fsdp"), world_sizes=(2,), compile="aot_eager")
    [run] = [r for r in report.runs if r.mode == "fsdp" and r.compile]
    [note] = [n for n in run.notes if n.startswith("first differing module: ")]
    assert "every block, compiled alone, agrees with eager on each rank's input of step 0" in note, note


def _failing_rank_search(ctx, case, spool, mode, shard_size, spec, step):
    raise RuntimeError("the rank search broke")


def test_a_rank_search_that_fails_is_said_and_the_eager_twin_decides(monkeypatch):
    from ddparity.fixtures import bugs
    from ddparity.verbs import check as check_module

    monkeypatch.setattr(check_module, "compiled_replica_blocks_task", _failing_rank_search)
    report = check(bugs.summed_loss(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager")
    [eager] = [r for r in report.runs if r.mode == "ddp" and not r.compile]
    [run] = [r for r in report.runs if r.mode == "ddp" and r.compile]
    assert run.first_divergence.module == eager.first_divergence.module
    [note] = [n for n in run.notes if n.startswith("first differing module: ")]
    assert "the block search failed: the re-run of step 0 failed" in note, note


class _Cache:  # as a transformers DynamicCache: a call appends to what it holds
    def __init__(self):
        self.keys = []


class _AppendsToItsCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        cache.keys.append(self.fc(x))
        return torch.cat(cache.keys)  # its output grows with every call given the same cache


def test_every_call_of_the_search_gets_a_fresh_copy_of_what_the_call_held():
    torch.manual_seed(0)
    cache = _Cache()
    cache.keys.append(torch.randn(2, 4))
    # given the same cache each time, eager, float64 and compiled outputs would differ in shape: a false "differs"
    assert first_differing_block(_AppendsToItsCache(), "", ((torch.randn(2, 4),), {"cache": cache}),
                                 "aot_eager") is None
    assert len(cache.keys) == 1  # the call's own cache untouched
