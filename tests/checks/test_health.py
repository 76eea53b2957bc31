"""Judging health measurements (``ddparity.checks.health``) on hand-made ranks."""

from __future__ import annotations

import dataclasses

import pytest

from ddparity.checks.health import MATMUL_REL_TOL, judge, judge_pairs
from ddparity.errors import UsageError
from ddparity.harness.health.probe import parse_fault
from ddparity.measurements import PairTiming, RankHealth
from ddparity.render import render_health as render


def rank(r: int, **changes) -> RankHealth:
    base = RankHealth(rank=r, world_size=4, host=f"node{r // 2}", device=f"cuda:{r % 2}", device_name="H200",
                      torch_version="2.13.0", cuda_version="13.0", python_version="3.11.7", gflops=100.0,
                      matmul_max_rel_error=1e-7, matmul_bits=42, latency_s=1e-4,
                      allreduce=[(1 << 20, 1e-3), (8 << 20, 4e-3)], hardware=[device(r % 2)],
                      transfers=copies(r % 2))
    return dataclasses.replace(base, **changes)


def copies(index: int, **changes) -> dict:
    """A healthy H200's copy bandwidths (GB/s), with its node's two peer pairs on the node's
    first rank (index 0)."""
    peers = [{"src": 0, "dst": 1, "access": True, "gbps": 371.8}, {"src": 1, "dst": 0, "access": True, "gbps": 369.4}]
    return {"name": "NVIDIA H200", "index": index, "h2d_gbps": 55.3, "d2h_gbps": 55.7,
            **({"peers": peers} if index == 0 else {}), **changes}


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
    assert [c.status for c in checks] == ["pass"] * 8
    assert [b.seconds for b in bandwidth] == [2e-3, 8e-3]
    assert bandwidth[1].algbw_gbps == pytest.approx((8 << 20) / 8e-3 / 1e9)
    assert bandwidth[1].busbw_gbps == pytest.approx(bandwidth[1].algbw_gbps * 1.5)  # 2(n-1)/n, n = 4
    assert "HEALTHY: 8 checks passed" in render(checks, bandwidth, ranks, "hdr")


def test_one_rank_skips_what_it_cannot_measure_rather_than_passing_it():
    """One rank printed "matmul 156.5-156.5 GFLOP/s across ranks" and bandwidth PASS with
    nothing measured."""
    only = rank(0, world_size=1, allreduce=[(1 << 20, 1e-3)])
    checks = by_name(judge([only])[0])
    assert checks["speed"].status == "skip" and "no other to compare with" in checks["speed"].detail
    assert checks["bandwidth"].status == "skip" and "no links" in checks["bandwidth"].detail
    text = render(list(checks.values()), [], [only], "hdr")
    assert "HEALTHY: 6 checks passed; speed, bandwidth skipped (each row says why)" in text


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
    assert parse_fault("hang@3") == ("hang", 3, None)
    assert parse_fault("slow_link@0-3") == ("slow_link", 0, 3)
    for bad in ("hang", "hang@x", "melt@1", "hang@1-2", "slow_link@1", "slow_link@2-2", "slow_link@1-x"):
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


def pairs(units: int, slow: dict[tuple[int, int], float] | None = None, unit: str = "rank",
          network_only: bool = False) -> list[PairTiming]:
    """Every pair's timing as both of its ends report it (8 MiB in 1 ms: 8.4 GB/s; the
    second end a little slower), a pair in ``slow`` that many times slower."""
    out = []
    for a in range(units):
        for b in range(a + 1, units):
            seconds = 1e-3 * (slow or {}).get((a, b), 1.0)
            out += [PairTiming(a, b, 8 << 20, seconds, unit, network_only),
                    PairTiming(a, b, 8 << 20, seconds * 1.01, unit, network_only)]
    return out


def test_pairwise_passes_when_every_pair_is_near_the_fastest_and_takes_each_pairs_slower_end():
    check, rows = judge_pairs(pairs(4, {(1, 2): 1.9}))  # 1.9x slower: within half the fastest's bandwidth
    assert check.status == "pass" and "over 6 pairs of ranks" in check.detail
    assert [(r.a, r.b) for r in rows] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert rows[0].seconds == pytest.approx(1.01e-3)
    assert rows[0].busbw_gbps == pytest.approx((8 << 20) / 1.01e-3 / 1e9)


@pytest.mark.parametrize("link", [(0, 3), (1, 2), (2, 3)])
def test_a_slow_link_is_named_as_its_pair(link):
    check, _ = judge_pairs(pairs(4, {link: 4.0}))
    assert (check.status, check.ranks) == ("fail", list(link))
    assert check.detail.startswith(f"slow link(s) between ranks {link[0]}-{link[1]} (")


@pytest.mark.parametrize(("nodes", "node"), [(3, 0), (3, 2), (4, 0), (4, 3), (8, 5)])
def test_a_node_slow_with_every_peer_is_named_as_the_node_not_its_pairs(nodes, node):
    slow = {(a, b): 3.0 for a in range(nodes) for b in range(a + 1, nodes) if node in (a, b)}
    check, _ = judge_pairs(pairs(nodes, slow, unit="node"))
    assert (check.status, check.ranks) == ("fail", [node])
    assert check.detail.startswith(f"node {node}'s link (its NIC, cable or switch port) is slow: its pairs' median below half")
    assert "slow link(s)" not in check.detail and "pairs of nodes" in check.detail


def test_a_slow_link_and_a_slow_node_are_both_named():
    slow = {(a, b): 3.0 for a in range(5) for b in range(a + 1, 5) if 4 in (a, b)} | {(0, 1): 4.0}
    check, _ = judge_pairs(pairs(5, slow))
    assert (check.status, check.ranks) == ("fail", [0, 1, 4])
    assert "rank 4's link is slow" in check.detail and "slow link(s) between ranks 0-1" in check.detail


def test_pairs_as_spread_as_measured_on_loaded_cpu_ranks_pass():
    """Six pairs of 4 CPU ranks at 2 MiB (2026-12-04): 0.72-1.57x their median, the fastest
    over twice the slowest; no pair is slow (the fastest is no reference)."""
    for spread in ((0.94, 0.72, 1.18, 0.90, 1.48, 1.06), (0.97, 1.25, 0.96, 1.03, 1.57, 0.96)):
        timings = [PairTiming(a, b, 2 << 20, 1e-3 / f) for (a, b), f in
                   zip([(a, b) for a in range(4) for b in range(a + 1, 4)], spread)]
        assert judge_pairs(timings)[0].status == "pass"


def test_pairwise_with_one_pair_or_none_is_skipped_and_says_why():
    check, rows = judge_pairs(pairs(2))
    assert check.status == "skip" and "one pair (ranks 0-1: " in check.detail and "no other pair" in check.detail
    assert len(rows) == 1
    assert judge_pairs([])[0].status == "skip"


def test_a_network_only_pass_says_so_in_its_row_and_table():
    check, rows = judge_pairs(pairs(3, network_only=True), "pairwise (network only)")
    assert check.name == "pairwise (network only)"
    assert "(network only: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)" in check.detail
    text = render([check], [], [rank(0)], "ddparity health", rows)
    assert "ranks 0-2" in text and "network only" in text.split("ranks 0-2")[1].splitlines()[0]


def test_stress_passes_with_its_figures_and_fails_naming_each_unstable_rank():
    calm = {"seconds": 60.2, "matrix": 4096, "repeats": 900, "reduce_bytes": 64 << 20, "matmul_mismatches": 0,
            "first_mismatches": [], "allreduce_errors": 0, "first_allreduce_errors": []}
    checks, _ = judge([rank(r, stress=calm) for r in range(4)])
    assert by_name(checks)["stress"].status == "pass"
    assert by_name(checks)["stress"].detail.startswith("60 s under load: 900 repeats of a 4096-square float32 matmul")
    hot = {**calm, "matmul_mismatches": 2, "first_mismatches": [411, 777]}
    lossy = {**calm, "allreduce_errors": 1, "first_allreduce_errors": [12]}
    checks, _ = judge([rank(0, stress=hot), rank(1, stress=calm), rank(2, stress=calm), rank(3, stress=lossy)])
    stress = by_name(checks)["stress"]
    assert (stress.status, stress.ranks) == ("fail", [0, 3])
    assert "rank 0 cuda:0 (H200): 2 of 900 repeats" in stress.detail and "first at repeat 411" in stress.detail
    assert "rank 3: 1 of 900 all-reduces under load were not exact (first at repeat 12)" in stress.detail
    assert "stress" not in by_name(judge([rank(0), rank(1)])[0])  # no --long: no row


def test_the_launched_trainings_row_names_a_child_that_never_finished_or_says_why_there_was_no_report():
    from ddparity.verbs.health import launched_training

    command = "ddparity check ddparity.verbs.health:gate_case --modes single,ddp --backend nccl --timeout 60 -q"
    done = {"exit": 0, "command": command, "output": "",
            "runs": [{"mode": "single", "status": "pass"}, {"mode": "ddp", "status": "pass"}]}
    assert launched_training([rank(0, training=done), rank(1, training={"exit": 0})]).detail.startswith(
        "a small MLP trains the same under ddp at 2 rank(s) in the launch as on one device")
    late = {"exit": None, "output": "did not finish within 120 s", "command": command}
    check = launched_training([rank(0, training=done), rank(1, training=late), rank(2, training={"exit": 0})])
    assert (check.status, check.ranks) == ("fail", [1])
    assert "did not finish on rank(s) [1] (did not finish within 120 s): python -m ddparity check" in check.detail
    broken = {"exit": 2, "output": "ddparity: error: --backend nccl: no CUDA device\n", "command": command}
    check = launched_training([rank(0, training=broken), rank(1, training={"exit": 2})])
    assert check.status == "fail" and "gave no report (exit 2): ddparity: error: --backend nccl: no CUDA" in check.detail
