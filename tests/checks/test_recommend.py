"""The profile's answer: the fastest arm at the largest world size any ran, with its spread
and scaling, the arms that hold less set against it, and no winner where the spreads meet."""

from __future__ import annotations

import pytest

from ddparity.checks.comm import WorldProfile, add_scaling, cross_checked, ddp_logged, percentile
from ddparity.checks.recommend import recommend
from ddparity.report import ProfileReport


def row(mode: str, ws: int, p50_ms: float, p95_ms: float, state: int = 1000) -> WorldProfile:
    return WorldProfile(ws, "gloo", mode=mode, step_s=p50_ms / 1e3, step_p95_s=p95_ms / 1e3,
                        memory_per_rank={"params": state // 4, "grads": state // 4, "optimizer": state // 2})


def test_percentile_is_linear_between_the_nearest():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 11))), 0.95) == pytest.approx(9.55)
    assert percentile([4.0], 0.95) == 4.0


def test_the_fastest_at_the_largest_world_is_named_with_what_the_lighter_arm_costs():
    runs = [row("ddp", 1, 20, 21), row("ddp", 2, 12, 13), row("fsdp", 1, 30, 31, 1000), row("fsdp", 2, 18, 19, 520)]
    add_scaling(runs)
    assert recommend(runs) == ("fastest at 2 rank(s): ddp: 12.0 ms/step p50 (p95 13.0), 83% scaling against 1 rank(s); "
                               "fsdp holds 0.52x the state a rank at 1.50x the time")


def test_spreads_that_meet_name_no_winner_and_still_say_what_the_lighter_arm_costs():
    runs = [row("ddp", 2, 12, 19), row("fsdp", 2, 18, 19, 500), row("ddp bucket 1 MB", 2, 13, 14)]
    line = recommend(runs)
    assert line == ("too close to rank at 2 rank(s): ddp 12.0 ms/step p50 (p95 19.0), ddp bucket 1 MB 13.0 ms/step p50 "
                    "(p95 14.0): the faster's p95 reaches the other's median; more --steps narrow the spread; fsdp holds "
                    "0.50x the state a rank at 1.50x the time")
    assert "fastest" not in line


def test_one_arm_and_none():
    assert recommend([row("ddp", 4, 10, 11)]) == "only ddp ran at 4 rank(s): 10.0 ms/step p50 (p95 11.0)"
    failed = WorldProfile(2, "gloo", status="hang", reason="stuck")
    assert recommend([failed]) is None
    report = ProfileReport("case", [failed])
    assert report.to_json()["recommendation"] is None and "recommendation:" not in report.render()


def test_the_report_ends_with_it_and_the_json_holds_it():
    report = ProfileReport("case", [row("ddp", 2, 12, 13), row("hsdp", 2, 30, 31, 500)])
    assert report.render().rstrip().splitlines()[-1] == (
        "recommendation: fastest at 2 rank(s): ddp: 12.0 ms/step p50 (p95 13.0); hsdp holds 0.50x the state a rank "
        "at 2.50x the time")
    assert report.to_json()["recommendation"].startswith("fastest at 2 rank(s): ddp")
    assert "p95 ms" in report.render().splitlines()[1]


def test_ddps_own_logging_is_read_and_a_disagreement_is_a_note():
    data = {"avg_forward_compute_time": 5_000_000, "avg_backward_compute_time": 27_000_000,
            "avg_backward_comm_time": 25_800_000, "avg_backward_compute_comm_overlap_time": 0,
            "bucket_sizes": "10563648", "rebuilt_bucket_sizes": "3179560, 4198400, 1052672", "has_rebuilt_buckets": 1}
    logged = ddp_logged(data)
    assert logged == {"forward_ms": 5.0, "backward_compute_ms": 27.0, "backward_comm_ms": 25.8, "overlap_ms": None,
                      "buckets": 3, "bucket_bytes": [3179560, 4198400, 1052672], "rebuilt": True}
    agreeing = WorldProfile(2, "gloo", buckets=3, comm_s=0.0247)
    assert cross_checked(agreeing, logged) == []
    off = WorldProfile(2, "gloo", buckets=1, comm_s=0.005)
    notes = cross_checked(off, logged)
    assert notes[0] == "DDP's own logging reports 3 bucket(s) (rebuilt); the profile timed 1 a step"
    assert "more than 2x apart" in notes[1]
    assert ddp_logged({}) is None and cross_checked(off, None) == []

