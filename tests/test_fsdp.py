"""Modes ``fsdp`` and ``hsdp`` (FSDP2's ``fully_shard``) on real gloo worlds: each rank's
local shards against the same slices of the single-device reference; the clean set-ups
pass, every sharded-training bug is caught at step 0 with its cause named, the degenerate
meshes (S = 1, S = W) included."""

from __future__ import annotations

import pytest

from ddparity import check
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
    (sharded.divided_again, "gradients are scaled by the same factor", "grad"),
]


@pytest.mark.parametrize(("factory", "cause", "kind"), BUGS, ids=lambda x: getattr(x, "__name__", "."))
def test_every_sharded_bug_is_caught_at_step_0_with_its_cause(factory, cause, kind):
    report = check(factory(), modes=("fsdp", "hsdp"), world_sizes=(2, 4))
    assert [r.status for r in report.runs] == ["diverged"] * 4, report.render()
    for run in report.runs:
        assert run.first_divergence.step == 0 and run.first_divergence.kind == kind, run.first_divergence
        causes = [n for n in run.notes if n.startswith("likely cause")]
        assert len(causes) == 1 and cause in causes[0], (run.mode, run.world_size, causes)
        assert run.mode.upper() in causes[0] or "BatchNorm" in cause or "left out" in cause or "scaled" in cause
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


def test_fsdp_is_refused_on_simulated_ranks_with_the_way_out():
    report = check(models.mlp_sgd(), modes=("fsdp",), world_sizes=(2,), backend="threaded")
    [run] = report.runs
    assert run.status == "skipped" and run.simulated and "use --backend gloo" in run.reason


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
    assert ("reproduce: ddparity check ddparity.fixtures.sharded:ignored_param --modes hsdp --world-sizes 2 "
            "--backend gloo --steps 3 --tolerance auto --hsdp-shard 1") in run.stdout
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


def test_under_torchrun_fsdp_is_refused_not_silently_checked_as_ddp():
    """Under a launch only ddp is checked so far: asking for fsdp there must not print a
    ddp verdict as if FSDP had been checked."""
    from ddparity import UsageError
    from ddparity.verbs.launched import launch_options

    with pytest.raises(UsageError, match="mode fsdp, hsdp is not checked under torchrun yet.*--modes fsdp,hsdp"):
        launch_options(("single", "fsdp", "hsdp"), None, "auto", 60.0, "auto", None)
