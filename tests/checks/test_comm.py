"""Communication figures from hand-made step timings (``ddparity.checks.comm``)."""

from __future__ import annotations

import pytest

from ddparity.checks.comm import WorldProfile, add_scaling, bus_factor, busy_seconds, summarize
from ddparity.measurements import BucketTiming, RankProfile, StepTiming
from ddparity.render import render_profile as render


def b(start: float, end: float, nbytes: int = 1000, ops: tuple[str, ...] = ("all_reduce",)) -> BucketTiming:
    return BucketTiming(index=0, nbytes=nbytes, start=start, end=end, ops=ops)


def test_busy_time_counts_buckets_in_flight_together_once():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([b(0.0, 1.0), b(2.0, 3.0)]) == pytest.approx(2.0)  # disjoint
    assert busy_seconds([b(0.0, 2.0), b(1.0, 3.0)]) == pytest.approx(3.0)  # overlapping
    assert busy_seconds([b(0.0, 4.0), b(1.0, 2.0)]) == pytest.approx(4.0)  # nested
    assert busy_seconds([b(2.0, 3.0), b(0.0, 1.0), b(0.5, 2.5)]) == pytest.approx(3.0)  # unsorted


def test_bus_factor_is_nccl_tests_all_reduce_factor():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def rank(r: int, steps: list[StepTiming], samples: int = 8) -> RankProfile:
    return RankProfile(rank=r, world_size=2, device="cpu", samples=samples, steps=steps)


def test_the_slowest_rank_sets_each_step_and_medians_summarise():
    buckets = [b(0.001, 0.004, 4000), b(0.003, 0.006, 2000)]  # busy 5 ms, 6000 bytes
    fast = [StepTiming(sync=0.010, no_sync=0.008, optimizer=0.001, buckets=buckets) for _ in range(3)]
    slow = [StepTiming(sync=0.012, no_sync=0.008, optimizer=0.002, buckets=buckets) for _ in range(3)]
    out = summarize([rank(0, fast), rank(1, slow)], "gloo")
    assert out.steps == 3 and out.world_size == 2 and out.samples_per_step == 16
    assert out.step_s == pytest.approx(0.014)  # slowest sync 12 ms + slowest optimizer 2 ms
    assert out.compute_s == pytest.approx(0.010)
    assert out.exposed_comm_s == pytest.approx(0.004)
    assert out.comm_s == pytest.approx(0.005)
    assert out.overlap == pytest.approx(0.2)  # 1 - 4/5
    assert out.bytes_per_step == 6000 and out.buckets == 2
    assert out.algbw_gbps == pytest.approx(6000 / 0.005 / 1e9)
    assert out.busbw_gbps == pytest.approx(out.algbw_gbps * 1.0)
    assert out.samples_per_s == pytest.approx(16 / 0.014)


def test_bus_bandwidth_of_small_messages_is_said_to_mean_little():
    def profile(nbytes):
        steps = [StepTiming(sync=0.010, no_sync=0.008, optimizer=0.0, buckets=[b(0.0, 0.004, nbytes)])]
        return summarize([rank(0, steps), rank(1, steps)], "gloo")

    small, large = profile(6000), profile(4 * 2**20)
    assert small.busbw_gbps is not None and large.busbw_gbps is not None
    assert [n for n in small.notes if "latency" in n] == [
        "messages of 6 kB on average: at this size latency, not the link, decides a collective's time, so bus "
        "bandwidth says little about the interconnect (it means something from about 1 MiB a message up)"]
    assert not [n for n in large.notes if "latency" in n]
    assert "world size 2: messages of 6 kB" in render("case", [small])


def test_the_profile_picture_carries_the_tables_notes(tmp_path):
    pytest.importorskip("matplotlib")
    from ddparity.plot import figure, notes_of
    from ddparity.report import ProfileReport

    runs = [WorldProfile(world_size=2, backend="gloo", step_s=0.02, compute_s=0.01, exposed_comm_s=0.01,
                         notes=["oversubscribed: 2 ranks on 1 CPUs; communication waits for descheduled ranks"])]
    fig = figure(ProfileReport("case", runs, cpus=1))
    drawn = [t.get_text() for t in fig.texts]
    assert notes_of(runs) == ["ddp world size 2: oversubscribed: 2 ranks on 1 CPUs; communication waits for "
                              "descheduled ranks"]
    assert notes_of(runs)[0] in drawn, drawn


def test_hidden_communication_is_not_negative_and_non_all_reduce_hooks_get_no_busbw():
    steps = [StepTiming(sync=0.010, no_sync=0.011, optimizer=0.0,
                        buckets=[b(0.0, 0.004, 100, ("all_gather", "all_reduce"))])]
    out = summarize([rank(0, steps), rank(1, steps)], "gloo")
    assert out.exposed_comm_s == 0.0 and out.overlap == 1.0
    assert out.algbw_gbps is not None and out.busbw_gbps is None
    assert any("all_gather, all_reduce" in note for note in out.notes)


def test_scaling_efficiency_against_the_smallest_world_that_ran():
    runs = [WorldProfile(world_size=1, backend="gloo", step_s=0.040),
            WorldProfile(world_size=2, backend="gloo", step_s=0.020),  # perfect
            WorldProfile(world_size=4, backend="gloo", step_s=0.020),  # half
            WorldProfile(world_size=8, backend="gloo", status="skipped", reason="too many")]
    add_scaling(runs)
    assert [r.scaling_efficiency for r in runs] == [1.0, 1.0, 0.5, None]
    later = [WorldProfile(world_size=2, backend="gloo", step_s=0.02), WorldProfile(world_size=4, backend="gloo", step_s=0.01)]
    add_scaling(later)
    assert later[1].scaling_efficiency == 1.0
    assert later[1].notes == ["scaling efficiency relative to world size 2"]
    text = render("case", runs)
    assert "world size 8 SKIPPED: too many" in text and "100%" in text and "50%" in text


def test_each_op_is_summed_in_its_own_group_with_its_own_bus_factor():
    """FSDP's all-gathers and reduce-scatters and HSDP's all-reduce across replicas: each
    op's calls, bytes and busy time a step, and its bus bandwidth in the group it ran in
    ((g-1)/g for gathers and scatters, 2(g-1)/g for all-reduce)."""
    assert [bus_factor(n, "all_gather") for n in (2, 4)] == [0.5, 0.75]
    timings = [b(0.000, 0.002, 4000, ("all_gather",)), b(0.001, 0.003, 4000, ("all_gather",)),
               b(0.004, 0.005, 2000, ("reduce_scatter",)), b(0.005, 0.006, 1000, ("all_reduce",))]
    timings[3].group_size = 2  # across 2 replicas of a 4-rank world
    steps = [StepTiming(sync=0.010, no_sync=0.004, optimizer=0.001, buckets=timings) for _ in range(3)]
    profiles = [RankProfile(r, 4, "cpu", 8, steps, {"params": 100 * (r + 1), "grads": 100, "optimizer": 200})
                for r in range(4)]
    out = summarize(profiles, "gloo", "hsdp")
    ops = {c["op"]: c for c in out.collectives}
    assert ops["all_gather"]["calls"] == 2 and ops["all_gather"]["bytes"] == 8000
    assert ops["all_gather"]["seconds"] == pytest.approx(0.003)  # in flight together: counted once
    assert ops["all_gather"]["busbw_gbps"] == pytest.approx(8000 / 0.003 / 1e9 * 0.75)
    assert ops["all_reduce"]["group_size"] == 2
    assert ops["all_reduce"]["busbw_gbps"] == pytest.approx(1000 / 0.001 / 1e9 * 1.0)
    assert out.busbw_gbps is None  # no one figure for a mix of ops
    assert out.memory_per_rank == {"params": 400, "grads": 100, "optimizer": 200}  # the largest rank's
    text = render("c", [out])
    assert "hsdp world size 4: all_gather x2 a step, 8.0 kB" in text and "state a rank holds" in text


def test_one_op_in_groups_of_two_sizes_is_two_rows_and_a_1_rank_group_sends_nothing():
    """HSDP all-reduces its gradients in the replica groups and the user's token count across
    the world; with one replica (a 1 x 2 mesh) its replica groups hold one rank, as FSDP2 runs
    them. Measured on Llama tiny: "all_reduce x3 ... in groups of 2" before, three 1-rank
    gradient all-reduces counted in the bus bandwidth and the bytes sent."""
    for replicas in (1, 2):
        grads = [b(0.001 * i, 0.001 * i + 0.0005, 5000) for i in range(2)]
        for t in grads:
            t.group_size = replicas
        count = b(0.004, 0.005, 8)  # the whole world's (group_size 0)
        steps = [StepTiming(sync=0.010, no_sync=0.004, optimizer=0.001, buckets=[*grads, count]) for _ in range(3)]
        out = summarize([RankProfile(r, 4, "cpu", 8, steps) for r in range(4)], "gloo", "hsdp")
        rows = [(c["op"], c["group_size"], c["calls"], c["bytes"]) for c in out.collectives]
        assert rows == [("all_reduce", replicas, 2, 10000), ("all_reduce", 4, 1, 8)], rows
        assert out.collectives[1]["busbw_gbps"] == pytest.approx(8 / 0.001 / 1e9 * 1.5)
        if replicas == 1:
            assert out.collectives[0]["busbw_gbps"] is None and out.bytes_per_step == 8
            assert "all_reduce x2 a step, 10.0 kB in 1.00 ms, in groups of 1 (nothing crosses a link)" in render("c", [out])
        else:
            assert out.collectives[0]["busbw_gbps"] == pytest.approx(10000 / 0.001 / 1e9) and out.bytes_per_step == 10008
    assert "all_reduce x1 a step, 8 B in" in render("c", [out])


def test_gradients_all_reduced_more_than_once_a_step_are_a_traffic_note():
    from ddparity.checks.comm import extra_traffic

    note = extra_traffic("ddp", ["all_reduce"], 4 * 6963, 6963)
    assert note.startswith("traffic: DDP all-reduced 4.0x the model's gradient bytes a step (27.2 kB against 6.8 kB")
    assert note.endswith("would send 20.4 kB less a step per rank")
    assert extra_traffic("ddp", ["all_reduce"], 6963, 6963) is None  # once a step: what DDP needs
    assert extra_traffic("ddp", ["all_reduce"], 3482, 6963) is None  # an fp16 compress hook: half
    assert extra_traffic("fsdp", ["all_gather", "reduce_scatter"], 4 * 6963, 6963) is None


@pytest.mark.parametrize("fixture, said", [("accumulation_without_no_sync", True), ("accumulation", False)])
def test_profile_of_accumulation_says_what_no_sync_would_save(fixture, said):
    from ddparity import profile
    from ddparity.fixtures import loops

    report = profile(getattr(loops, fixture)(), world_sizes=(2,), steps=2, warmup=1)
    [run] = [r for r in report.runs if r.world_size == 2]
    traffic = [n for n in run.notes if n.startswith("traffic:")]
    assert bool(traffic) == said, run.notes


def test_the_steps_own_collectives_are_communication_not_compute_and_apart_from_the_buckets():
    """A contrastive step's all-gathers ran in both passes: they were compute (the no_sync pass)
    and missing from comm and sent/step, or (FSDP) merged into FSDP's all-gather row."""
    own = BucketTiming(index=0, nbytes=1024, start=0.001, end=0.002, ops=("all_gather",), own=True)
    steps = [StepTiming(sync=0.010, no_sync=0.008, optimizer=0.001, buckets=[b(0.005, 0.008, 4000), own],
                        own_no_sync=[BucketTiming(0, 1024, 0.001, 0.0025, ("all_gather",), own=True)])
             for _ in range(3)]
    out = summarize([rank(0, steps), rank(1, steps)], "gloo")
    assert out.compute_s == pytest.approx(0.008 - 0.0015 + 0.001)  # the no_sync pass less its all-gather
    assert out.exposed_comm_s == pytest.approx(0.010 - 0.0065)
    assert out.comm_s == pytest.approx(0.004) and out.bytes_per_step == 5024 and out.buckets == 1
    assert out.busbw_gbps is None  # an all-gather among the bytes: no all-reduce bus bandwidth for the world
    rows = {(c["op"], c["step"]): c for c in out.collectives}
    assert rows["all_gather", True]["bytes"] == 1024 and rows["all_reduce", False]["bytes"] == 4000
    assert [n for n in out.notes if n.startswith("the training step's own collectives (all_gather: 1 a step, 1.0 kB)")]
    assert "world size 2: all_gather (the step's own) x1 a step, 1.0 kB in 1.00 ms" in render("case", [out])


def test_a_profile_counts_the_steps_own_all_gathers_in_ddp_and_fsdp():
    from ddparity import profile
    from ddparity.fixtures import contrastive

    report = profile(contrastive.clip(gather_with_grad=True), world_sizes=(2,), modes=("ddp", "fsdp"), steps=2,
                     warmup=1)
    for run in report.runs:
        assert run.status == "ok", report.render()
        own = [c for c in run.collectives if c["step"]]
        # gather_with_grad: two all-gathers of 8 rows x 8 floats from each of 2 ranks, and in backward the
        # gradients torch.distributed.nn sends back for the step (gloo: scatters; nccl: a reduce-scatter)
        assert ("all_gather", 2, 1024) in [(c["op"], c["calls"], c["bytes"]) for c in own], run.collectives
        assert {c["op"] for c in own} <= {"all_gather", "scatter", "all_to_all", "reduce_scatter"}, run.collectives
        assert not [n for n in run.notes if n.startswith("traffic")], run.notes
    fsdp = next(r for r in report.runs if r.mode == "fsdp")
    assert all(c["op"] in ("all_gather", "reduce_scatter") for c in fsdp.collectives if not c["step"])
