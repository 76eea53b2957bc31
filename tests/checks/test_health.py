"""Judging health measurements (``ddparity.checks.health``) on hand-made ranks."""

from __future__ import annotations

import dataclasses

import pytest

from ddparity.checks.health import MATMUL_REL_TOL, judge
from ddparity.errors import UsageError
from ddparity.harness.ranks.health_probe import parse_fault
from ddparity.measurements import RankHealth
from ddparity.render import render_health as render


def rank(r: int, **changes) -> RankHealth:
    base = RankHealth(rank=r, world_size=4, host=f"node{r // 2}", device=f"cuda:{r % 2}", device_name="H200",
                      torch_version="2.13.0", cuda_version="13.0", python_version="3.11.7", gflops=100.0,
                      matmul_max_rel_error=1e-7, matmul_bits=42, latency_s=1e-4,
                      allreduce=[(1 << 20, 1e-3), (8 << 20, 4e-3)], hardware=[device(r % 2)])
    return dataclasses.replace(base, **changes)


def device(index: int, **changes) -> dict:
    """A healthy H200 as NVML reads it (the fields it reports here)."""
    return {"index": index, "name": "NVIDIA H200", "ecc_uncorrected_volatile": 0, "ecc_corrected_volatile": 0,
            "remap_failed": False, "remap_pending": False, "throttle_reasons": ["gpu_idle"], "temperature_c": 30,
            "pcie_width": 16, "pcie_width_max": 16, "nvlink_up": 18, "nvlink_max": 18, "other_processes": 0,
            "xid": [], **changes}


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_world_passes_and_bandwidth_uses_the_slowest_rank():
    ranks = [rank(r) for r in range(3)] + [rank(3, allreduce=[(1 << 20, 2e-3), (8 << 20, 8e-3)])]
    checks, bandwidth = judge(ranks)
    assert [c.status for c in checks] == ["pass"] * 7
    assert [b.seconds for b in bandwidth] == [2e-3, 8e-3]
    assert bandwidth[1].algbw_gbps == pytest.approx((8 << 20) / 8e-3 / 1e9)
    assert bandwidth[1].busbw_gbps == pytest.approx(bandwidth[1].algbw_gbps * 1.5)  # 2(n-1)/n, n = 4
    assert "HEALTHY: 7 checks passed" in render(checks, bandwidth, ranks, "hdr")


def test_one_rank_skips_what_it_cannot_measure_rather_than_passing_it():
    """One rank printed "matmul 156.5-156.5 GFLOP/s across ranks" and bandwidth PASS with
    nothing measured."""
    only = rank(0, world_size=1, allreduce=[(1 << 20, 1e-3)])
    checks = by_name(judge([only])[0])
    assert checks["speed"].status == "skip" and "no other to compare with" in checks["speed"].detail
    assert checks["bandwidth"].status == "skip" and "no links" in checks["bandwidth"].detail
    text = render(list(checks.values()), [], [only], "hdr")
    assert "HEALTHY: 5 checks passed; speed, bandwidth skipped (each row says why)" in text


def test_each_bad_node_fails_its_own_check_naming_the_rank():
    cases = {
        "versions": rank(2, torch_version="2.12.1"),
        "collectives": rank(2, collective_errors=["all_reduce(sum) of 1 float32: 1 wrong element(s)"]),
        "compute": rank(2, matmul_max_rel_error=10 * MATMUL_REL_TOL),
        "speed": rank(2, gflops=30.0),
        "hardware": rank(2, hardware=[device(0, pcie_width=8)]),
    }
    for name, bad in cases.items():
        ranks = [rank(r) for r in range(4)]
        ranks[2] = bad
        check = by_name(judge(ranks)[0])[name]
        assert (check.status, check.ranks) == ("fail", [2]), name
        others = [c.status for c in judge(ranks)[0] if c.name != name]
        assert set(others) == {"pass"}, name


def test_with_two_ranks_a_rank_at_less_than_half_the_others_speed_is_caught():
    check = by_name(judge([rank(0, world_size=2), rank(1, world_size=2, gflops=45.0)])[0])["speed"]
    assert (check.status, check.ranks) == ("fail", [1])
    check = by_name(judge([rank(0, world_size=2), rank(1, world_size=2, gflops=60.0)])[0])["speed"]
    assert check.status == "pass"


def test_a_device_whose_bits_differ_from_its_models_is_silent_data_corruption_named():
    """GPUs of one model (or one machine's CPUs) run the same seeded matmul bit for bit: the
    odd one out fails, named with its device, in float32 or in bfloat16; without a majority
    every one is named and the text says none is known to be the wrong one; CPUs on several
    hosts only warn (their name says no model); min-busbw is a failure of its own."""
    ranks = [rank(r) for r in range(4)]
    ranks[1] = rank(1, matmul_bits=43)
    checks = by_name(judge(ranks, min_busbw=1000.0)[0])
    assert (checks["compute"].status, checks["compute"].ranks) == ("fail", [1])
    assert checks["compute"].detail == ("rank 1 cuda:1 (H200) compute other bits than the 3 other H200 device(s) in "
                                        "the same seeded float32 matmul: silent data corruption")
    assert checks["bandwidth"].status == "fail" and "below --min-busbw 1000 GB/s" in checks["bandwidth"].detail
    low = [rank(r) for r in range(3)] + [rank(3, matmul_bits_bf16=9)]
    assert by_name(judge(low)[0])["compute"].ranks == [3] and "bfloat16" in by_name(judge(low)[0])["compute"].detail
    two = by_name(judge([rank(0, world_size=2), rank(1, world_size=2, matmul_bits=43)])[0])["compute"]
    assert (two.status, two.ranks) == ("fail", [0, 1]) and "no majority says which is right" in two.detail
    cpus = [rank(r, device="cpu", host=f"node{r}") for r in range(3)]
    cpus[2] = rank(2, device="cpu", host="node2", matmul_bits=43)
    spread = by_name(judge(cpus)[0])["compute"]
    assert (spread.status, spread.ranks) == ("warn", [2]) and "other CPUs on other hosts" in spread.detail
    mixed = [rank(0), rank(1, device_name="A100", matmul_bits=7)]  # other hardware may round differently
    assert by_name(judge(mixed)[0])["compute"].status == "pass"


def test_fault_drill_syntax():
    assert parse_fault(None) is None and parse_fault("") is None
    assert parse_fault("hang@3") == ("hang", 3)
    for bad in ("hang", "hang@x", "melt@1"):
        with pytest.raises(UsageError, match="KIND@RANK"):
            parse_fault(bad)


def test_ranks_without_a_readable_gpu_skip_the_hardware_check_with_the_reason():
    ranks = [rank(r, hardware="no CUDA device (the ranks run on cpu)") for r in range(2)]
    check = by_name(judge(ranks)[0])["hardware"]
    assert (check.status, check.detail) == ("skip", "no CUDA device (the ranks run on cpu)")
    warm = by_name(judge([rank(0), rank(1, hardware=[device(1, temperature_c=90)])],
                         limits={**__import__("ddparity.checks.hardware", fromlist=["x"]).THRESHOLDS,
                                 "temperature_c": 95})[0])["hardware"]
    assert warm.status == "pass"  # a site's limit in place of the default
