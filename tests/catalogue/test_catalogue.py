"""The catalogue sweep: every layer torch.nn ships that holds parameters or buffers or draws
random numbers, each in a small model, checked clean and with its planted twin (a summed
loss); and every structure of inputs, drawn by Hypothesis, reaching forward as DDP passes it.

The default suite runs a fast slice (every layer at 2 ranks in fp32); the whole sweep (every
mode at world sizes 1, 2, 4 and simulated 16, fp32 and bf16) is marked ``catalogue`` and
runs with ``--catalogue`` (.ci/run does). ``benchmarks/catalogue_sweep.py`` writes the
margins of every twin to ``docs/catalogue.md``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddparity import check
from ddparity.fixtures import catalogue, inputs
from ddparity.harness.world.pool import WorldPool
from tests.conftest import _children, needs_newer_torch, stray_processes

MEMBERS = catalogue.members()
NAMES = [m.name for m in MEMBERS]
UNALIGNED = {"RReLU"}
"""Layers that draw random numbers inside torch's kernels: an error naming the class.
(FractionalMaxPool draws its regions with ``torch.rand((n, C, 2))``: aligned per sample, it
passes clean and its summed twin is caught.)"""
CPU_ERRORS = {"SyncBatchNorm": "SyncBatchNorm expected input tensor to be on GPU"}
"""Layers torch itself runs on accelerators only: on CPU an error with torch's reason."""


@pytest.fixture(scope="module")
def pool():
    """Warm worlds for the module; once it is done, no process of its checks is left."""
    before = _children()
    pool = WorldPool()
    yield pool
    pool.close()
    assert not stray_processes(before), "processes left behind"


def test_every_class_torch_nn_ships_is_swept_or_said_why_not():
    assert catalogue.unaccounted() == []
    assert len(catalogue.module_classes()) > 150 and len(MEMBERS) >= 50
    kinds = {k for m in MEMBERS for k in m.state}
    assert kinds == {"parameters", "buffers", "random"}
    assert {"LSTM", "GRU", "RNN", "Transformer", "MultiheadAttention", "EmbeddingBag", "LazyLinear"} <= set(NAMES)
    assert UNALIGNED | {"FractionalMaxPool2d", "FractionalMaxPool3d"} <= set(NAMES)  # found by running them


def _expect(report, name: str, summed: bool) -> None:
    """Clean: every run passes. Twin: DDP at 2+ ranks diverges at step 0 by 2x its
    tolerance or more (DataParallel computes the loss on the whole batch: it passes). A
    layer that draws inside torch's kernels: every run is an error naming its class."""
    text = report.render()
    for run in report.runs:
        if name in CPU_ERRORS and not torch.cuda.is_available():
            assert run.status == "error" and CPU_ERRORS[name] in run.reason, text
        elif name in UNALIGNED:
            assert run.status == "error" and f"nn.{name}" in run.reason, text
        elif summed and run.mode == "ddp" and run.world_size > 1:
            d = run.first_divergence
            assert run.status == "diverged" and d.step == 0, text
            assert d.max_abs >= 2 * d.tolerance, (d, text)
        else:
            assert run.status == "pass", text


@pytest.mark.parametrize("summed", [False, True], ids=["clean", "summed"])
@pytest.mark.parametrize("name", NAMES)
def test_every_layer_at_two_ranks(name, summed, pool):
    report = check(catalogue.case(name, summed=summed), modes=("single", "ddp"), world_sizes=(2,), pool=pool)
    _expect(report, name, summed)


@pytest.mark.catalogue
@needs_newer_torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("summed", [False, True], ids=["clean", "summed"])
@pytest.mark.parametrize("name", NAMES)
def test_every_layer_in_every_mode_and_world_size(name, summed, dtype, pool):
    report = check(catalogue.case(name, dtype, summed), modes=("single", "dp", "ddp"), world_sizes=(1, 2, 4, 16),
                   backend="auto", pool=pool)
    _expect(report, name, summed)
    ran = [(r.mode, r.world_size, r.simulated) for r in report.runs if r.world_size == 16 and r.status != "error"]
    assert ran in ([("dp", 16, True), ("ddp", 16, True)], []), ran  # an error run (expected above) never started


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_an_rnn_with_inter_layer_dropout_is_checked_with_its_dropout_aligned(cell, pool):
    """Its dropout ran inside torch's fused RNN kernel, where no mask can be aligned: every
    run was an error. Run layer by layer, the same masks per sample in every mode."""
    name = f"{cell}(dropout=0.1)"
    for summed in (False, True):
        report = check(catalogue.case(name, summed=summed), modes=("single", "dp", "ddp"), world_sizes=(2, 16),
                       pool=pool)
        _expect(report, name, summed)
        assert "random draws compared on" in report.render()


layouts = st.builds(inputs.Layout, structure=st.sampled_from(inputs.STRUCTURES), leaves=st.integers(2, 3),
                    shared=st.booleans())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, summed=st.booleans())
def test_inputs_of_any_structure_reach_forward_as_ddp_passes_them(layout, summed, pool):
    """A NamedTuple whole, a tuple as positional arguments, a dict as keywords, nests of them
    and a tensor that is not batched: a model that raises on anything else passes clean
    and its summed twin is caught. (A NamedTuple was unpacked into positional arguments.)"""
    report = check(inputs.case(layout, summed), modes=("single", "ddp"), world_sizes=(1, 2), pool=pool)
    for run in report.runs:
        expected = "diverged" if summed and run.world_size == 2 else "pass"
        assert run.status == expected, report.render()


def test_dataparallel_scatters_a_tensor_that_is_not_batched_as_the_real_one_does(pool):
    """DataParallel cuts every tensor it is given on dim 0, a shared one too: the model sees
    a slice, as it would under real DataParallel (ddp hands it whole)."""
    report = check(inputs.case(inputs.Layout("dict", 2, shared=True)), modes=("dp",), world_sizes=(2,), pool=pool)
    [run] = [r for r in report.runs if r.mode == "dp"]
    assert run.status == "crash" and "the shared tensor arrived as (2, 4)" in run.reason, report.render()


COMPILED = [m.name for m in MEMBERS if "random" not in m.state and m.name not in CPU_ERRORS]
"""Every layer that draws nothing (a model drawing dropout masks is not compared compiled)."""


@pytest.mark.breadth
@pytest.mark.parametrize("name", COMPILED)
def test_every_layer_compiled_passes_clean_and_its_summed_twin_is_caught(name, pool):
    """``compile="aot_eager"`` (Dynamo, AOTAutograd's decompositions): compile's numerics
    never fail a clean layer; the summed loss is caught at step 0 in the compiled DDP run.
    (Tried with inductor too, every layer: the same verdicts; docs/compile.md.)"""
    for summed in (False, True):
        report = check(catalogue.case(name, summed=summed), modes=("single", "ddp"), world_sizes=(2,),
                       compile="aot_eager", pool=pool)
        by = {r.name: r for r in report.runs}
        assert by["single (compiled aot_eager)"].status == "pass", report.render()
        compiled = by["ddp (compiled aot_eager, ddp_optimizer)"]
        if summed:
            assert compiled.status == "diverged" and compiled.first_divergence.step == 0, report.render()
        else:
            assert report.ok, report.render()
