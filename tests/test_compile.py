"""``check(..., compile=...)``: every mode eager and ``torch.compile``'d on real gloo worlds.
Compile's own numerics never fail a clean model; a gradient never all-reduced, a summed loss
and BatchNorm on shards are caught at step 0 in the compiled rows; a model that computes
differently when traced fails its compiled single-device row; what cannot be compared
compiled (dropout masks, simulated ranks) says so instead of passing. aot_eager throughout
(Dynamo and AOTAutograd without C++ builds); inductor runs in the real-model sweep."""

from __future__ import annotations

import inspect

import pytest

from ddparity import check
from ddparity.compile_spec import CompileSpec, CompileSummary, validate_compile
from ddparity.errors import UsageError
from ddparity.fixtures import bugs, compiled, dropout
from ddparity.fixtures.layouts import ListNet, layout_case
from ddparity.harness.ranks.compiling import graph_break
from ddparity.verbs.compiled import summary_notes

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def rows(report):
    return {r.name: r for r in report.runs}


def test_a_clean_model_with_a_graph_break_passes_eager_and_compiled_and_names_the_break():
    report = check(compiled.graph_break(), modes=("single", "ddp", "fsdp"), world_sizes=(2,), compile="aot_eager")
    by = rows(report)
    assert {n: r.status for n, r in by.items()} == {
        "single": "pass", "single (compiled aot_eager)": "pass", "ddp": "pass",
        "ddp (compiled aot_eager, ddp_optimizer)": "pass", "fsdp": "pass", "fsdp (compiled aot_eager)": "pass",
    }, report.render()
    for name in ("single (compiled aot_eager)", "ddp (compiled aot_eager, ddp_optimizer)", "fsdp (compiled aot_eager)"):
        run = by[name]
        breaks = [n for n in run.notes if "graph break(s) in your code" in n]
        assert len(breaks) == 1 and "fixtures/compiled.py:" in breaks[0] and "item()" in breaks[0], run.notes
        assert any(n.startswith("compiled with aot_eager") and " s compiling" in n for n in run.notes), run.notes
        assert run.worst == [], (name, run.worst)  # compiling's rounding nowhere near the tolerance
    compiled_ddp = by["ddp (compiled aot_eager, ddp_optimizer)"].to_json()["compile"]
    assert {k: compiled_ddp[k] for k in ("backend", "ddp")} == {"backend": "aot_eager", "ddp": "ddp_optimizer"}
    assert compiled_ddp["seconds"] > 0 and compiled_ddp["ops"] > 0 and len(compiled_ddp["graph_breaks"]) == 1
    assert by["fsdp (compiled aot_eager)"].to_json()["compile"]["ddp"] is None
    assert by["ddp"].to_json()["compile"] is None
    assert any("DDPOptimizer split" in n for n in by["ddp (compiled aot_eager, ddp_optimizer)"].notes)
    repro = by["ddp (compiled aot_eager, ddp_optimizer)"].repro
    assert "compile='aot_eager', compile_ddp='ddp_optimizer'" in repro


BUGS = [
    (bugs.summed_loss, "ddp_optimizer", "diverged", "a loss summed over the batch"),
    (bugs.summed_loss, "python_reducer", "diverged", "a loss summed over the batch"),
    pytest.param(bugs.batchnorm_on_shards, "ddp_optimizer", "diverged", "BatchNorm on shards",
                 marks=pytest.mark.breadth),
    (compiled.inner_module_compiled, "ddp_optimizer", "desync", "no gradient was all-reduced at step 0"),
]


@pytest.mark.parametrize(("factory", "path", "status", "cause"), BUGS,
                         ids=["summed", "summed-python_reducer", "batchnorm", "inner-module-compiled"])
def test_data_parallel_bugs_are_caught_at_step_0_in_the_compiled_rows(factory, path, status, cause):
    report = check(factory(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager", compile_ddp=path)
    by = rows(report)
    assert by["single (compiled aot_eager)"].status == "pass", report.render()  # one device: no DP bug
    run = by[f"ddp (compiled aot_eager, {path})"]
    assert run.status == status, report.render()
    assert run.first_divergence.step == 0, run.first_divergence
    assert run.first_divergence.max_abs > 100 * run.first_divergence.tolerance  # far beyond compile's noise
    assert any(cause in n for n in run.notes if n.startswith("likely cause")), run.notes
    # where: every block compiled alone agrees with eager on each rank's input; the eager twin's place, said as such
    eager = by["ddp"].first_divergence.module
    assert run.first_divergence.module == eager and eager.found, run.first_divergence.module
    [where] = [n for n in run.notes if n.startswith("first differing module: ")]
    assert where == ("first differing module: as in the eager ddp run at world size 2, which differs too (every "
                     "block, compiled alone, agrees with eager on each rank's input of step 0): a data-parallel "
                     "difference, not compile's"), where


def test_the_clean_twin_compiling_the_ddp_module_in_its_step_passes():
    report = check(compiled.wrapper_compiled(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager")
    assert [r.status for r in report.runs] == ["pass"] * 4, report.render()


def test_a_step_that_compiles_optimizer_step_is_recorded_eagerly_clean_passes_and_a_summed_loss_is_caught():
    """torch.compile(optimizer.step) traced ddparity's own recording on the optimizer's hooks:
    the clean step diverged, its gradients recorded with other shapes than the reference's."""
    report = check(compiled.optimizer_step_compiled(), modes=("single", "ddp", "fsdp"), world_sizes=(2,))
    assert report.ok, report.render()
    summed = check(compiled.optimizer_step_compiled("sum"), modes=("single", "ddp"), world_sizes=(2,))
    [run] = [r for r in summed.runs if r.mode == "ddp"]
    assert run.status == "diverged" and run.first_divergence.step == 0, summed.render()
    assert any(n.startswith("likely cause: a loss summed over the batch") for n in run.notes), run.notes


def test_a_dropout_model_the_step_compiles_gets_aligned_masks():
    """Dynamo took ddparity's aligned dropout for torch's own and ran it on fake tensors: a
    crash shown in the user's step. Now it runs eagerly at a graph break, each sample's mask
    the same in every mode: clean passes (a summed loss caught: the breadth tier)."""
    report = check(compiled.dropout_compiled_in_step(), modes=("single", "ddp"), world_sizes=(2,))
    assert report.ok, report.render()


@pytest.mark.breadth
def test_a_dropout_the_compiled_graph_keeps_is_an_error_that_says_why_a_summed_loss_is_caught():
    """A dropout Dynamo traces into the graph all the same (inside F.multi_head_attention_forward)
    is an error naming the compiled graph and what to do, never Dynamo's fake-tensor error."""
    report = check(compiled.dropout_compiled_in_step(), modes=("single", "fsdp"), world_sizes=(2,))
    assert report.ok, report.render()
    summed = check(compiled.dropout_compiled_in_step("sum"), modes=("single", "ddp"), world_sizes=(2,))
    assert [r.status for r in summed.runs] == ["pass", "diverged"], summed.render()
    traced = check(compiled.dropout_compiled_in_step(attention=True), modes=("single",), world_sizes=(1,))
    assert traced.exit_code == 2 and {r.status for r in traced.runs} == {"error"}, traced.render()
    reason = traced.runs[0].reason  # (the draw seen as it is traced, or as the compiled graph makes it)
    assert "inside a graph" in reason and "compiled" in reason and "check the model eager" in reason, reason
    assert "FakeTensor" not in traced.render()


def test_a_model_that_computes_differently_when_compiled_fails_on_one_device_first():
    report = check(compiled.differs_when_compiled(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager")
    by = rows(report)
    assert by["single"].status == by["ddp"].status == "pass", report.render()
    single = by["single (compiled aot_eager)"]
    assert single.status == "diverged" and single.first_divergence.step == 0, report.render()
    assert any("compiling changes the training on one device" in n for n in single.notes)
    # its distance is no noise floor: the compiled DDP run is judged against eager's noise, and fails
    compiled_ddp = by["ddp (compiled aot_eager, ddp_optimizer)"]
    assert compiled_ddp.status == "diverged"
    # its ranks' own block search: the model's forward, compiled, differs from eager on rank 0's shard
    block = compiled_ddp.first_divergence.module
    assert (block.phase, block.module, block.type, block.rank) == ("compiled", "", "TracedDifferently", 0), block
    assert block.error > block.tolerance
    assert not any(n.startswith("first differing module") for n in compiled_ddp.notes), compiled_ddp.notes


def test_what_cannot_be_compared_compiled_is_never_a_pass():
    drawn = check(dropout.every_dropout(), modes=("single", "ddp"), world_sizes=(2,), compile="aot_eager")
    by = rows(drawn)
    assert by["single"].status == by["ddp"].status == "pass", drawn.render()
    for name in ("single (compiled aot_eager)", "ddp (compiled aot_eager, ddp_optimizer)"):
        assert by[name].status == "error" and "draws random numbers per sample" in by[name].reason, by[name]
        assert "p=0" in by[name].reason
    simulated = check(compiled.wide(), modes=("ddp", "dp"), world_sizes=(2,), backend="threaded", compile="aot_eager")
    by = rows(simulated)
    assert by["ddp"].status == "pass", simulated.render()
    assert by["ddp (compiled aot_eager, ddp_optimizer)"].status == "skipped"
    assert "real rank processes" in by["ddp (compiled aot_eager, ddp_optimizer)"].reason
    assert by["dp (compiled aot_eager)"].status == "skipped" and "DataParallel" in by["dp (compiled aot_eager)"].reason


def test_bad_compile_options_are_usage_errors_before_any_work(monkeypatch):
    with pytest.raises(UsageError, match="unknown torch.compile backend 'inductr'.*inductor"):
        validate_compile("inductr", None, "check()")
    with pytest.raises(UsageError, match="compile_ddp='python_reducer' given without compile"):
        validate_compile(None, "python_reducer", "check()")
    with pytest.raises(UsageError, match="compile_ddp must be one of ddp_optimizer, python_reducer"):
        validate_compile("aot_eager", "fast", "check()")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(UsageError, match="C\\+\\+ compiler.*--compile aot_eager"):
        validate_compile("inductor", None, "--compile")
    with pytest.raises(UsageError, match="unknown torch.compile backend"):
        check(compiled.wide(), world_sizes=(2,), compile="nope")


def test_a_compiled_run_that_compiled_nothing_is_skipped_with_the_reason_never_a_pass():
    """A bare nn.Sequential: Dynamo traces nothing of torch's own forward under DDP/FSDP, so
    the compiled rows compared eager code. They were ``pass`` and counted in "OK: 4 of 4"."""
    report = check(compiled.bare_sequential(), modes=("single", "fsdp", "ddp"), world_sizes=(2,), compile="aot_eager")
    rows = {(r.name, r.status) for r in report.runs}
    assert ("fsdp (compiled aot_eager)", "skipped") in rows and ("ddp (compiled aot_eager, ddp_optimizer)",
                                                                  "skipped") in rows, report.render()
    skipped = [r for r in report.runs if r.status == "skipped"]
    assert all(r.compile["ops"] == 0 and "captured nothing of the model" in r.reason and "nn.Sequential" in r.reason
               for r in skipped)
    by_mode = {r.mode: r.reason for r in skipped}  # under FSDP2 the sharded modules' hooks break the graph too
    assert "breaks the graph at FSDP's hooks" in by_mode["fsdp"] and "FSDP's hooks" not in by_mode["ddp"], by_mode
    text = report.render()
    assert f"OK: {len(report.runs) - len(skipped)} of {len(report.runs)} runs equivalent to the reference, " \
           f"{len(skipped)} skipped" in text
    assert "fsdp (compiled aot_eager) world_size=2: skipped: not compared compiled: torch.compile captured nothing" \
        in text  # the reason in the text, not only the JSON
    # a compiled run that captured nothing and diverged stays diverged (the bug is real), with the note
    [summed] = [r for r in check(compiled.bare_sequential(summed=True), modes=("ddp",), world_sizes=(2,),
                                 compile="aot_eager").runs if r.compile]
    assert summed.status == "diverged" and any("captured nothing" in n for n in summed.notes)


def test_the_notes_say_what_compiling_did():
    nothing = CompileSummary("aot_eager", "ddp_optimizer", "ddp", seconds=0.4, graphs=1, ops=0, torch_breaks=2)
    notes = summary_notes([nothing])
    assert any("2 in DDP's forward" in n and "runs eagerly by design" in n for n in notes)
    split = CompileSummary("inductor", "ddp_optimizer", "ddp", graphs=2, ops=40, ddp_split=[[2**20, 3 * 2**20], [512]],
                           ddp_cap=25 * 2**20, graph_breaks=["m.py:3: Unsupported Tensor.item() call"])
    notes = summary_notes([split])
    assert "1 graph break(s) in your code: m.py:3: Unsupported Tensor.item() call" in notes
    assert any("split 2 graph(s)" in n and "into 2, 1 piece(s)" in n and "1.00 MB, 3.00 MB" in n for n in notes)
    assert CompileSpec("inductor", "python_reducer").flags() == " --compile inductor --compile-ddp python_reducer"


def test_a_model_torch_compile_captures_nothing_of_is_skipped_in_every_compiled_row():
    """A stacked LSTM: nothing of it is compiled. Its compiled DDP row was ``pass``: the one
    op captured was ddparity's own (the ledger's counter, traced through ddparity's hook on
    the DDP module); FSDP's compiled Linear layers came of ddparity's hooks on them."""
    report = check(compiled.stacked_lstm(), modes=("single", "ddp", "fsdp"), world_sizes=(2,), compile="aot_eager")
    compiled_rows = [r for r in report.runs if r.compile is not None]
    assert len(compiled_rows) == 3 and all(r.status == "skipped" and r.compile["ops"] == 0 for r in compiled_rows), \
        report.render()
    assert all(r.status == "pass" for r in report.runs if r.compile is None), report.render()


TORCH = "/venv/site-packages/torch"
OWN = "/src/ddparity/harness"
IN_A_LOOP = (  # Dynamo's graph-break log (torch 2.13) for FSDP-sharded blocks called in a for loop
    f"Graph break in user code at {TORCH}/distributed/fsdp/_fully_shard/_fsdp_common.py:30\nGraph Break Reason: "
    "Failed to handle graph break gracefully. Skipping the function and falling back to eager. Graph break "
    "encountered:\n\nAttempted to call function marked as skipped\n  Explanation: Dynamo developers have "
    "intentionally marked that the function `disable` ... should not be traced.\n\n*** While handling this graph "
    "break, another graph break occurred: ***\n\ngraph break in loop\n  Explanation: torch.compile detected a "
    "graph break in a for/while loop. Skipping the frame and falling back to eager, as graph breaks in loops are "
    "not supported.\n\n  Developer debug context: frame skipped: {frame} (/home/me/model.py line 87)\n")


def test_a_graph_break_is_placed_in_the_users_code_torchs_or_ddparitys():
    """A break inside a loop runs the loop's frame eagerly: the user's frame is named (FSDP's
    hooks called in a ``for`` loop over blocks used to be counted as torch's alone, and the
    run said "no graph break in your code" while the model's forward ran uncompiled)."""
    where, text = graph_break(IN_A_LOOP.format(frame="forward"), TORCH, OWN)
    assert where == "user" and text.startswith("/home/me/model.py:87: forward ran eagerly: a graph break inside "
                                               "its loop (FSDP's hooks, which Dynamo does not trace, at "), text
    _, resumed = graph_break(IN_A_LOOP.format(frame="torch_dynamo_resume_in_forward_at_80"), TORCH, OWN)
    assert resumed.startswith("/home/me/model.py:87: forward from line 80 on ran eagerly"), resumed
    item = "Graph break in user code at /home/me/model.py:12\nGraph Break Reason: Unsupported Tensor.item() call\n"
    assert graph_break(item, TORCH, OWN) == ("user", "/home/me/model.py:12: Unsupported Tensor.item() call")
    assert graph_break(f"Graph break in user code at {TORCH}/nn/parallel/distributed.py:9\nGraph Break Reason: "
                       f"x\n", TORCH, OWN)[0] == "torch"
    assert graph_break(f"Graph break in user code at {OWN}/ranks/stepping.py:9\nGraph Break Reason: x\n", TORCH,
                       OWN)[0] == "ddparity"
    assert graph_break("torchdynamo start compiling forward", TORCH, OWN) == ("", "")


def test_blocks_called_in_a_loop_under_compiled_fsdp_say_the_forward_ran_eagerly_and_how_much_compiled():
    report = check(layout_case("module_list"), modes=("single", "ddp", "fsdp"), world_sizes=(2,), compile="aot_eager")
    by = rows(report)
    assert {r.status for r in report.runs} == {"pass"}, report.render()
    # ddparity's hooks stay out of the graphs: compiled DDP captures what one device does, no more
    assert by["ddp (compiled aot_eager, ddp_optimizer)"].compile["ops"] == by["single (compiled aot_eager)"].compile[
        "ops"], report.render()
    notes, whole = by["fsdp (compiled aot_eager)"].notes, by["single (compiled aot_eager)"].compile["ops"]
    _, first = inspect.getsourcelines(ListNet.forward)
    at = first + 1  # x = self.inp(x): the break at its FSDP-sharded call, then the loop
    assert any(f"fixtures/layouts.py:{at}: forward from line {at} on ran eagerly" in n for n in notes), (at, notes)
    ops = by["fsdp (compiled aot_eager)"].compile["ops"]
    assert 0 < ops < whole and f"{ops} op(s) captured, of the {whole} the single-device compile" in "".join(notes)
    assert not any("no graph break in your code" in n for n in notes), notes


@pytest.mark.parametrize(("ws", "culprit"), [(2, 0), pytest.param(4, 3, marks=pytest.mark.breadth)])
def test_a_rank_that_drifts_is_named_in_the_compiled_run_rank_0_and_the_last(ws, culprit):
    report = check(bugs.corrupted_grad_on_one_rank(culprit), modes=("single", "ddp"), world_sizes=(ws,),
                   compile="aot_eager")
    ddp_runs = report.runs[2:]  # ddp, eager then compiled
    assert [r.name for r in ddp_runs] == ["ddp", "ddp (compiled aot_eager, ddp_optimizer)"], report.render()
    for run in ddp_runs:
        assert run.status == "desync" and run.desync.ranks == [culprit], report.render()
        assert any(f"rank {culprit} alone drifts" in n for n in run.notes), run.notes


def test_compiled_numerics_are_judged_against_the_references_own_float64_error():
    """GPT-2 compiled with inductor on an AVX512 CPU: a bias 1.1e-3 of its size from eager,
    over the fixed 0.1 % floor (x1.07, a false alarm, twice); the reference's own error
    against float64 there is 2.5e-4 of it (measured 1.3e-4 here), and the compiled run within
    16x that is as accurate as eager by the minifier's rule. A wrong decomposition (0.3 of the
    value) stays far beyond."""
    import torch

    from ddparity.checks.tolerance import auto_tolerance, compiled_tolerance
    from ddparity.distances import Entry, Reference

    reference = Reference(steps=[{("loss", "loss"): Entry(3.0, True, noise=1e-7, scale=3.0),
                                  ("grad", "c_proj.bias"): Entry(1.0, True, noise=1e-6, scale=1.0)}])
    eager = auto_tolerance(reference, 1, torch.float32)
    fixed = compiled_tolerance(eager, reference, torch.float32)
    assert fixed(0, "grad", "c_proj.bias") < 1.1e-3  # the old rule: a false alarm
    measured = compiled_tolerance(eager, reference, torch.float32,
                                  exact=[{("loss", "loss"): 0.0, ("grad", "c_proj.bias"): 2.5e-4}])
    assert 1.1e-3 < measured(0, "grad", "c_proj.bias") == pytest.approx(16 * 2.5e-4)
    assert measured(0, "grad", "c_proj.bias") < 0.3 / 50
    assert measured(0, "loss", "loss") == eager(0, "loss", "loss")  # no float64 error: the eager tolerance
    assert "float64" in measured.description and "no float64 run" in fixed.description
