"""Modes ``fsdp`` and ``hsdp`` (FSDP2's ``fully_shard``) on real gloo worlds: each rank's
local shards against the same slices of the single-device reference; the clean set-ups
pass, every sharded-training bug is caught at step 0 with its cause named, the degenerate
meshes (S = 1, S = W) included."""

from __future__ import annotations

import pytest
import torch

from ddparity import Case, check
from ddparity.fixtures import bugs, loops, models, sharded

CLEAN = [models.mlp_sgd, loops.accumulation, sharded.ignored_param_reduced, sharded.token_mean_of_the_batch]


@pytest.mark.parametrize("factory", CLEAN, ids=lambda f: f.__name__)
def test_clean_set_ups_match_the_reference_in_fsdp_and_hsdp(factory):
    report = check(factory(), modes=("fsdp", "hsdp"), world_sizes=(1, 2, 4))
    statuses = {(r.mode, r.world_size): r.status for r in report.runs}
    assert statuses == {("fsdp", 1): "pass", ("fsdp", 2): "pass", ("fsdp", 4): "pass",
                        ("hsdp", 1): "skipped", ("hsdp", 2): "pass", ("hsdp", 4): "pass"}, report.render()
    [skipped] = [r for r in report.runs if r.status == "skipped"]
    assert "divisible by the shard size 2" in skipped.reason and "--hsdp-shard" in skipped.reason
    hsdp4 = next(r for r in report.runs if (r.mode, r.world_size) == ("hsdp", 4))
    assert "hsdp mesh: 2 replica(s) x 2 shard(s)" in hsdp4.notes
    assert all(r.worst == [] for r in report.runs)  # nothing even close to the tolerance


BUGS = [
    (bugs.summed_loss, "a loss summed over the batch (reduction='sum')", "loss"),
    (bugs.batchnorm_on_shards, "BatchNorm on shards (bn (BatchNorm1d))", "loss"),
    (sharded.ignored_param, "net.4.bias, net.4.weight left out of sharding (ignored_params)", "grad"),
    (sharded.sync_left_off, "no gradient reached the optimizer (6 of 6 missing at step 0)", "grad"),
    (sharded.token_mean_per_rank, "a loss averaged over each rank's own valid entries", "loss"),
    (sharded.divided_again, "the loss the step gave backward() is scaled, not the one it returns: a loss divided by "
                            "the world size before backward", "grad"),
]


MODE_NAMED = {"summed_loss", "sync_left_off", "token_mean_per_rank"}
"""The bugs whose cause names the mode (FSDP or HSDP averaged the gradients, its sync was off)."""


@pytest.mark.parametrize(("factory", "cause", "kind"), BUGS, ids=lambda x: getattr(x, "__name__", "."))
def test_every_sharded_bug_is_caught_at_step_0_with_its_cause(factory, cause, kind):
    report = check(factory(), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["diverged"] * 4, report.render()
    for run in report.runs:
        assert run.first_divergence.step == 0 and run.first_divergence.kind == kind, run.first_divergence
        causes = [n for n in run.notes if n.startswith("likely cause")]
        assert len(causes) == 1 and cause in causes[0], (run.mode, run.world_size, causes)
        if factory.__name__ in MODE_NAMED:  # the cause says which mode averaged or synced
            assert run.mode.upper() in causes[0], (run.mode, causes[0])
        margin = run.first_divergence.max_abs / run.first_divergence.tolerance if run.first_divergence.tolerance \
            else float("inf")
        assert margin > 100, (run.mode, run.world_size, margin)  # far beyond the noise, not at its edge


@pytest.mark.parametrize("shard", [1, 4])
def test_the_degenerate_hsdp_meshes_still_sync_and_still_catch(shard, no_leftover_processes):
    """S = 1 (every rank a replica: all-reduce only) and S = W (one replica: FSDP): the
    meshes on which gradients have silently stopped syncing in the field."""
    clean = check(models.mlp_sgd(), modes=("hsdp",), world_sizes=(4,), hsdp_shard=shard)
    assert [r.status for r in clean.runs] == ["pass"], clean.render()
    assert f"hsdp mesh: {4 // shard} replica(s) x {shard} shard(s)" in clean.runs[0].notes
    summed = check(bugs.summed_loss(), modes=("hsdp",), world_sizes=(4,), hsdp_shard=shard)
    assert summed.runs[0].status == "diverged" and summed.runs[0].first_divergence.step == 0
    assert f"--hsdp-shard {shard}" in summed.runs[0].repro or f"hsdp_shard={shard}" in summed.runs[0].repro


def test_simulated_world_sizes_run_fsdp2_on_the_threaded_process_group():
    """FSDP2 runs on torch's threaded process group (meshes, all-gathers, reduce-scatters):
    at a simulated 8 the clean step passes in both modes, a parameter left out of sharding
    is caught with its cause, and under HSDP (4 replicas x 2 shards) the last rank's shard
    drifting from its replicas is a desync naming it; every run is labelled simulated."""
    clean = check(sharded.plain_step(), modes=("fsdp", "hsdp"), world_sizes=(8,), backend="threaded")
    assert [(r.status, r.simulated) for r in clean.runs] == [("pass", True), ("pass", True)], clean.render()
    assert any("simulated: 8 HSDP ranks as threads" in n for n in clean.runs[1].notes)
    [ignored] = check(sharded.ignored_param(), modes=("fsdp",), world_sizes=(8,), backend="threaded").runs
    assert ignored.status == "diverged" and any("left out of sharding" in n for n in ignored.notes)
    [drift] = check(sharded.drifting_shard(7), modes=("hsdp",), world_sizes=(8,), backend="threaded").runs
    assert drift.status == "desync" and drift.desync.ranks == [7] and drift.simulated


def test_a_bad_case_fsdp_or_hsdp_shard_is_refused_before_any_work():
    from ddparity import UsageError

    with pytest.raises(UsageError, match="Case.fsdp must be a callable"):
        check(models.mlp_sgd().__class__(model=models.MLP, data=models.vectors, fsdp="no"), modes=("fsdp",))
    with pytest.raises(UsageError, match="hsdp_shard"):
        check(models.mlp_sgd(), modes=("hsdp",), hsdp_shard=0)


def test_the_cli_checks_fsdp_and_hsdp_and_writes_their_rows(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "ddparity", "check", "ddparity.fixtures.sharded:ignored_param",
                          "--modes", "fsdp,hsdp", "--world-sizes", "2", "--hsdp-shard", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "fsdp world_size=2 (gloo): DIVERGED" in run.stdout and "left out of sharding" in run.stdout
    assert ("reproduce: ddparity check ddparity.fixtures.sharded:ignored_param --modes hsdp --hsdp-shard 1 "
            "--world-sizes 2 --backend gloo --steps 3 --tolerance auto") in run.stdout
    data = json.loads(out.read_text())
    assert [(r["mode"], r["world_size"], r["status"]) for r in data["runs"]] == [
        ("fsdp", 2, "diverged"), ("hsdp", 2, "diverged")]
    bad = subprocess.run([sys.executable, "-m", "ddparity", "check", "--demo", "--hsdp-shard", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--hsdp-shard" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("policy", [sharded.bf16_policy, sharded.bf16_reduce_policy], ids=lambda f: f.__name__)
def test_a_mixed_precision_policy_is_no_divergence_and_a_summed_loss_still_is(policy):
    """bf16 parameters in compute, gradients reduced in fp32 or bf16: the policy alone moves
    gradients by ~0.1-1% and turns AdamW's near-zero gradients into whole-lr updates; the
    tolerance counts the policy's own noise (the same set-up on one rank against the
    reference) and its ulps, and a summed loss is still caught at step 0."""
    import dataclasses

    clean = check(dataclasses.replace(models.transformer_adamw(), fsdp=policy), modes=("fsdp",), world_sizes=(2, 4))
    assert [r.status for r in clean.runs] == ["pass", "pass"], clean.render()
    assert "the run's own bfloat16 policy" in clean.runs[0].tolerance
    summed = check(dataclasses.replace(bugs.summed_loss(), fsdp=policy), modes=("fsdp",), world_sizes=(2, 4))
    for run in summed.runs:
        assert run.status == "diverged" and run.first_divergence.step == 0 and run.first_divergence.kind == "loss"
        assert run.first_divergence.max_abs > 2.5 * run.first_divergence.tolerance  # the margin, read
        assert any("a loss summed over the batch" in n for n in run.notes)


def test_a_transformers_model_wrapped_block_by_block():
    """A model nobody here wrote (transformers GPT-2, tiny config, dropout on), sharded
    block by block as its users do: clean passes; a summed loss is caught at step 0, far
    beyond the tolerance (BERT and HSDP: ``benchmarks/bench_fsdp.py``)."""
    pytest.importorskip("transformers")
    clean = check(sharded.gpt2_clean(), modes=("fsdp",), world_sizes=(2,))
    assert [r.status for r in clean.runs] == ["pass"], clean.render()
    summed = check(sharded.gpt2_summed(), modes=("fsdp",), world_sizes=(2,))
    [run] = summed.runs
    assert run.status == "diverged" and run.first_divergence.step == 0, summed.render()
    assert run.first_divergence.max_abs > 1e3 * run.first_divergence.tolerance
    assert any("a loss summed over the batch" in n for n in run.notes)


def test_under_torchrun_a_bad_hsdp_shard_is_a_usage_error_before_any_work(monkeypatch):
    """Under a launch the sharded modes run (tests/e2e/test_torchrun.py); their options are
    checked as a local check's are, before the launch forms."""
    from ddparity import UsageError
    from ddparity.verbs.launched import launch_options

    monkeypatch.setenv("WORLD_SIZE", "4")
    opts = launch_options(("single", "fsdp", "hsdp"), None, "auto", 60.0, "auto", None, 2)
    assert opts.modes == ("single", "fsdp", "hsdp") and opts.world_sizes == (4,) and opts.hsdp_shard == 2
    with pytest.raises(UsageError, match="hsdp_shard"):
        launch_options(("hsdp",), None, "auto", 60.0, "auto", None, 0)



@pytest.mark.parametrize("culprit", [0, 1])
def test_fsdps_own_collectives_are_in_the_ledger_so_a_skipped_collective_is_a_desync(culprit):
    """FSDP2 gathers and reduce-scatters through ``all_gather_single`` and
    ``reduce_scatter_single`` (torch 2.13's names): recorded like any collective, so a rank
    that skips the user's all-reduce is a desync naming it (and FSDP's call it made
    instead), on rank 0 as on rank W-1, not a hang."""
    from ddparity.fixtures import faults

    report = check(faults.skipped_collective(culprit), modes=("fsdp",), world_sizes=(2,), timeout=30)
    [run] = report.runs
    assert run.status == "desync" and run.desync.ranks == [culprit], report.render()
    assert "all_gather_single" in report.render()


def test_profile_times_fsdps_collectives_beside_ddp_with_the_state_a_rank_holds(tmp_path):
    """``ddparity profile --modes ddp,fsdp,hsdp``: FSDP's all-gathers and reduce-scatters
    timed op by op, HSDP's all-reduce across replicas in its group of 2, and the state a
    rank holds (FSDP's parameters: half DDP's at 2 ranks). The user's own
    ``reshard_after_forward=False`` holds through the profile's compute-alone pass: one
    all-gather a layer a step, not two."""
    import json
    import subprocess
    import sys

    import torch

    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "ddparity", "profile", "ddparity.fixtures.sharded:mlp_kept_unsharded",
                             "--modes", "ddp,fsdp,hsdp", "--hsdp-shard", "1", "--world-sizes", "2", "--steps", "2",
                             "--warmup", "1", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert [runs[m]["status"] for m in ("ddp", "fsdp", "hsdp")] == ["ok", "ok", "ok"]
    fsdp = {c["op"]: c for c in runs["fsdp"]["collectives"]}
    layers = sum(isinstance(m, torch.nn.Linear) for m in sharded.mlp_kept_unsharded().model().modules())
    assert fsdp["all_gather"]["calls"] == layers and fsdp["reduce_scatter"]["calls"] == layers
    assert fsdp["all_gather"]["bytes"] > 0 and fsdp["all_gather"]["group_size"] == 2
    hsdp = {c["op"]: c for c in runs["hsdp"]["collectives"]}
    assert hsdp["all_reduce"]["group_size"] == 2  # 2 replicas x 1 shard: gradients all-reduced across replicas
    ddp_params, fsdp_params = runs["ddp"]["memory_per_rank"]["params"], runs["fsdp"]["memory_per_rank"]["params"]
    assert fsdp_params < 0.6 * ddp_params and runs["hsdp"]["memory_per_rank"]["params"] == ddp_params
    assert "fsdp world size 2: all_gather x" in result.stdout and "state a rank holds" in result.stdout


@pytest.mark.parametrize("culprit", [0, 3])
def test_hsdp_replicas_of_a_shard_are_compared_with_each_other(culprit):
    """2 replicas x 2 shards: one rank's shard nudged after each step is a desync naming it
    and the rank holding the same shard in the other replica (rank 0 and rank W-1); under
    fsdp (no replicas) the same bug diverges from the reference on that rank."""
    report = check(sharded.drifting_shard(culprit), modes=("fsdp", "hsdp"), world_sizes=(4,), hsdp_shard=2)
    fsdp, hsdp = report.runs
    assert fsdp.status == "diverged" and fsdp.first_divergence.rank == culprit, report.render()
    assert hsdp.status == "desync" and hsdp.desync.ranks == [culprit], report.render()
    assert hsdp.desync.agreeing_ranks == [(culprit + 2) % 4] and hsdp.desync.step == 0
    assert hsdp.desync.differs == [f"param net.0.weight [shard {culprit % 2}]"]


def test_hsdp_all_reduce_across_replicas_left_off_is_caught_and_clean_replicas_agree():
    """``set_requires_all_reduce(False)`` never turned back on: no gradient reaches the
    optimizer in any HSDP mesh, its cause named; a no-op under fsdp (it passes); the clean
    step at 2 replicas x 2 shards passes, its replicas' fingerprints agreeing every step."""
    report = check(sharded.replicas_not_reduced(), modes=("fsdp", "hsdp"), world_sizes=(4,), hsdp_shard=2)
    fsdp, hsdp = report.runs
    assert fsdp.status == "pass" and hsdp.status == "diverged", report.render()
    assert any("set_requires_all_reduce(False)" in n for n in hsdp.notes)
    clean = check(sharded.plain_step(), modes=("hsdp",), world_sizes=(4,), hsdp_shard=2)
    assert [r.status for r in clean.runs] == ["pass"], clean.render()


@pytest.mark.parametrize("culprit", [0, 1])
def test_the_optimizer_state_is_compared_shard_against_slice(culprit):
    """After each step every rank's shard of every optimizer state tensor (SGD's momentum
    here) is compared with the same slice of the reference's: one rank's state reset after
    step 0 is caught at step 0, before any parameter differs, on rank 0 as on rank W-1,
    with its cause; the clean twin (state kept) passes in every mode."""
    report = check(sharded.momentum_reset(culprit), modes=("fsdp",), world_sizes=(2,))
    [run] = report.runs
    first = run.first_divergence
    assert run.status == "diverged" and (first.step, first.kind, first.rank) == (0, "optimizer", culprit)
    assert first.name.endswith(".momentum_buffer"), report.render()
    assert any("the optimizer's state differs" in n for n in run.notes)
    clean = check(sharded.momentum_kept(), modes=("ddp", "fsdp", "hsdp"), world_sizes=(2, 4))
    assert {r.status for r in clean.runs} == {"pass"}, clean.render()


def test_cpu_offload_passes_clean_and_a_summed_loss_under_it_is_caught():
    """``CPUOffloadPolicy`` through ``Case.fsdp`` (its code paths run on a CPU run, the
    copies being no-ops): the MLP with AdamW passes in both modes; a summed loss is caught
    at step 0 with its cause."""
    clean = check(sharded.offloaded(), modes=("fsdp", "hsdp"), world_sizes=(2,))
    assert [r.status for r in clean.runs] == ["pass", "pass"], clean.render()
    [summed] = check(sharded.offloaded_summed(), modes=("fsdp",), world_sizes=(2,)).runs
    assert summed.status == "diverged" and summed.first_divergence.step == 0
    assert any("a loss summed over the batch" in n for n in summed.notes)


# -- the default wrapping on the layouts users write (no Case.fsdp) ------------------------


def test_default_wrapping_takes_the_blocks_inside_containers_and_leaves_shared_parameters_to_the_root():
    from ddparity.fixtures import layouts
    from ddparity.harness.ranks.modes.fsdp import wrapping_units

    def wrapped(net):
        units = wrapping_units(net)
        return [name for name, module in net.named_modules() if any(module is u for u in units)]

    assert wrapped(layouts.ListNet()) == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
    # nanoGPT: the ModuleDict looked into, the tied embedding (wte is lm_head's weight) left to the root
    assert wrapped(layouts.TiedDictNet()) == ["transformer.wpe", "transformer.h.0", "transformer.h.1",
                                              "transformer.ln_f"]
    assert wrapped(layouts.NestedNet()) == ["stages.low.0", "stages.low.1", "stages.high.0", "stages.high.1.0",
                                            "stages.high.1.1"]
    # T5: one embedding reached from three places; the stacks looked into, never wrapped whole
    assert wrapped(layouts.SharedEmbeddingNet()) == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0",
                                                     "decoder.layers.1", "head"]


def test_default_wrapping_takes_a_transformers_models_declared_blocks():
    """A transformers model names its blocks (``_no_split_modules``): those are wrapped, as
    accelerate does, the embeddings, final norm and head left to the root. (Mixtral's inner
    model wrapped whole lost its router logits: the real-models tier.)"""
    pytest.importorskip("transformers")
    from ddparity.fixtures import real_models
    from ddparity.harness.ranks.modes.fsdp import wrapping_units

    for build, blocks in ((real_models.mixtral, ["model.layers.0", "model.layers.1"]),
                          (real_models.gpt2, ["transformer.h.0", "transformer.h.1"]),
                          (real_models.bert, ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"])):
        net = build()
        units = wrapping_units(net)
        assert [name for name, m in net.named_modules() if any(m is u for u in units)] == blocks, build


@pytest.mark.parametrize("layout", ["module_list", "tied_module_dict", "nested_containers", "shared_embedding"])
def test_user_layouts_pass_clean_and_catch_a_summed_loss_under_the_default_wrapping(layout):
    """Before the default wrapping looked into containers, every one of these was a CRASH
    ("fully_shard does not support containers that do not implement forward", or a
    parameter "shared with a parameter already managed by another FSDP group") blamed on
    the user's model."""
    from ddparity.fixtures.layouts import layout_case

    clean = check(layout_case(layout), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in clean.runs] == ["pass"] * 4, clean.render()
    summed = check(layout_case(layout, summed=True), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in summed.runs] == ["diverged"] * 4, summed.render()
    for run in summed.runs:
        first = run.first_divergence
        assert first.step == 0 and first.kind == "loss" and first.max_abs / first.tolerance > 100, (run.mode, first)


@pytest.mark.parametrize("shard", [1, 4])
def test_a_module_list_model_on_the_degenerate_hsdp_meshes(shard):
    from ddparity.fixtures.layouts import layout_case

    [clean] = check(layout_case("module_list"), modes=("hsdp",), world_sizes=(4,), hsdp_shard=shard).runs
    assert clean.status == "pass" and f"hsdp mesh: {4 // shard} replica(s) x {shard} shard(s)" in clean.notes
    [summed] = check(layout_case("module_list", summed=True), modes=("hsdp",), world_sizes=(4,),
                     hsdp_shard=shard).runs
    assert summed.status == "diverged" and summed.first_divergence.step == 0


def test_module_list_accumulation_and_simulated_8_under_the_default_wrapping():
    from ddparity.fixtures.layouts import layout_case, module_list_accumulation

    accumulated = check(module_list_accumulation(), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in accumulated.runs] == ["pass"] * 4, accumulated.render()
    for summed, expected in ((False, "pass"), (True, "diverged")):
        report = check(layout_case("tied_module_dict", summed), modes=("fsdp", "hsdp"), world_sizes=(8,),
                       backend="threaded")
        assert [(r.status, r.simulated) for r in report.runs] == [(expected, True)] * 2, report.render()


MESHES = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
"""(world size, shard size): every HSDP mesh at 2 and 4 ranks (2x1, 1x2, 4x1, 2x2, 1x4)."""


@pytest.mark.breadth
@pytest.mark.parametrize("layout", ["module_list", "tied_module_dict", "nested_containers", "shared_embedding"])
def test_every_layout_on_every_hsdp_mesh_at_2_and_4(layout):
    from ddparity.fixtures.layouts import layout_case

    for ws, shard in MESHES:
        for summed in (False, True):
            [run] = check(layout_case(layout, summed), modes=("hsdp",), world_sizes=(ws,), hsdp_shard=shard).runs
            assert f"hsdp mesh: {ws // shard} replica(s) x {shard} shard(s)" in run.notes
            if not summed:
                assert run.status == "pass", (layout, ws, shard, run)
            else:
                d = run.first_divergence
                assert run.status == "diverged" and d.step == 0 and d.max_abs > 100 * d.tolerance, (ws, shard, d)


def test_a_skipped_run_says_why_in_the_text_report():
    """``hsdp 1 gloo skipped 0.00``: the reason was only in the JSON."""
    report = check(models.mlp_sgd(), modes=("hsdp",), world_sizes=(1, 2))
    text = report.render()
    assert "hsdp world_size=1: skipped: " in text and "divisible by the shard size 2" in text, text


@pytest.mark.parametrize("culprit", [0, 3])
def test_a_drifting_shard_on_rank_0_or_the_last_is_named_under_the_default_wrapping(culprit):
    from ddparity.fixtures.layouts import drifting_layout

    for layout in ("module_list", "tied_module_dict"):
        [run] = check(drifting_layout(layout, culprit), modes=("hsdp",), world_sizes=(4,)).runs
        assert run.status == "desync" and run.desync.ranks == [culprit], (layout, run)


def test_a_ddp_comm_hook_is_said_to_have_no_part_in_a_sharded_run():
    """A Case whose comm hook corrupts rank 0's gradient: a desync under DDP; FSDP2 has no
    comm hook, so its row passes, and says it trained without the hook (it said nothing)."""
    report = check(bugs.corrupted_grad_on_one_rank(0), modes=("ddp", "fsdp"), world_sizes=(2,))
    by = {r.mode: r for r in report.runs}
    assert by["ddp"].status == "desync" and by["fsdp"].status == "pass", report.render()
    assert "Case.comm_hook is DDP's: this fsdp run trained without it" in " ".join(by["fsdp"].notes)
    assert not any("DDP's:" in n for n in by["ddp"].notes)


def test_a_penalty_over_the_parameters_outside_the_forward_is_a_crash_with_its_cause():
    """Under FSDP2 the parameters are DTensor shards between forwards: an L2 penalty summed
    over ``model.parameters()`` in the step makes torch refuse to mix them with the loss. The
    crash says why and what to do; DDP and DataParallel, whose parameters are whole, pass."""
    report = check(loops.penalty_outside_forward(), modes=("single", "dp", "ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "pass", "crash"], report.render()
    sharded = report.runs[3]
    assert "got mixed torch.Tensor and DTensor" in sharded.crash.error
    assert any(n.startswith("likely cause: the step computed with the model's parameters outside its forward")
               and "weight_decay" in n for n in sharded.notes), sharded.notes
    assert not any(n.startswith("likely cause") for r in report.runs[:3] for n in r.notes)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9),
                    reason="measured on torch 2.13, whose DTensor refuses Rprop's masked write")
def test_an_optimizer_dtensor_cannot_run_is_a_crash_naming_the_optimizer_and_the_op():
    """torch's Rprop writes its step sizes through a boolean mask (``index_put_``), which
    DTensor refuses on FSDP2's shards (Adafactor's row norms likewise): the crash names the
    optimizer's file and the op, and what to use; DDP passes."""
    case = Case(model=models.MLP, data=models.vectors, optimizer=lambda ps: torch.optim.Rprop(ps, lr=0.01), steps=2)
    report = check(case, modes=("single", "ddp", "fsdp"), world_sizes=(2,))
    assert [r.status for r in report.runs] == ["pass", "pass", "crash"], report.render()
    assert any(n.startswith("likely cause: torch.optim's rprop.py runs aten.index_put_") and "SGD, Adam" in n
               for n in report.runs[2].notes), report.runs[2].notes
