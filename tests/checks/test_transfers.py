"""Judging copy bandwidths (``ddparity.checks.transfers``) on recorded readings: what
``transfer_probe`` returns on a GPU node, shaped like nvbandwidth's figures on an 8-GPU H200
node (host copies ~55 GB/s, NVLink peer copies ~370 GB/s)."""

from __future__ import annotations

import json

import pytest

from ddparity.checks.hardware import load_thresholds
from ddparity.checks.transfers import FLOORS, floor_for, judge_transfers
from ddparity.errors import UsageError


def node(gpus: int = 8, name: str = "NVIDIA H200", first_rank: int = 0, **slow) -> dict[int, dict]:
    """One node's ranks: each rank's host copies, the first rank's peer pairs. ``slow``:
    ``h2d_3=20.0`` (rank 3's host-to-device), ``peer_2_5=90.0`` (devices 2 -> 5),
    ``noaccess_1_4=True``."""
    by_rank = {}
    for i in range(gpus):
        reading = {"name": name, "index": i, "h2d_gbps": slow.get(f"h2d_{i}", 55.3 + i / 10),
                   "d2h_gbps": slow.get(f"d2h_{i}", 55.7)}
        if i == 0:
            reading["peers"] = [{"src": a, "dst": b, "access": not slow.get(f"noaccess_{a}_{b}", False),
                                 "gbps": slow.get(f"peer_{a}_{b}", 371.0)}
                                for a in range(gpus) for b in range(gpus) if a != b]
            for p in reading["peers"]:
                if not p["access"]:
                    del p["gbps"]
        by_rank[first_rank + i] = reading
    return by_rank


def test_a_healthy_h200_node_passes_with_its_slowest_figures():
    verdict = judge_transfers(node())
    assert verdict.status == "pass", verdict.detail
    assert verdict.detail == "host copies >= 55.3 GB/s; peer copies >= 371 GB/s over 56 pair(s)"


@pytest.mark.parametrize("rank", [0, 7])
def test_a_slow_host_link_fails_naming_rank_and_direction(rank):
    verdict = judge_transfers(node(**{f"h2d_{rank}": 26.0}))  # an x16 link trained at x8
    assert (verdict.status, verdict.ranks) == ("fail", [rank])
    assert f"rank {rank} NVIDIA H200 host to device 26 GB/s, below its floor 48 GB/s" in verdict.detail


def test_a_degraded_nvlink_pair_and_a_pair_without_peer_access_fail_naming_the_pair():
    verdict = judge_transfers(node(peer_2_5=90.0, noaccess_6_7=True))
    assert (verdict.status, verdict.ranks) == ("fail", [0])
    assert "rank 0's host, devices 2 -> 5 90 GB/s, below its floor 335 GB/s" in verdict.detail
    assert "devices 6 -> 7: no peer access" in verdict.detail


def test_no_peer_access_on_a_model_without_a_peer_floor_only_warns():
    verdict = judge_transfers(node(gpus=2, name="NVIDIA A100-SXM4-80GB", noaccess_0_1=True))
    assert (verdict.status, verdict.ranks) == ("warn", [0])


def test_two_nodes_each_first_rank_judges_its_own_pairs():
    verdict = judge_transfers({**node(), **node(first_rank=8, peer_0_1=100.0)})
    assert (verdict.status, verdict.ranks) == ("fail", [8]) and "rank 8's host, devices 0 -> 1" in verdict.detail


def test_a_model_without_a_floor_is_measured_not_judged_until_a_site_sets_one(tmp_path):
    slow_l4 = node(gpus=1, name="NVIDIA L4", h2d_0=11.0)
    verdict = judge_transfers(slow_l4)
    assert verdict.status == "pass" and "no floor for NVIDIA L4: measured, not judged" in verdict.detail
    assert "no peer pairs (one device a host)" in verdict.detail
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"host_copy_gbps": 20}))
    verdict = judge_transfers(slow_l4, load_thresholds(str(limits)))
    assert verdict.status == "fail" and "below its floor 20 GB/s" in verdict.detail


@pytest.mark.parametrize(("name", "floor"), [
    ("NVIDIA H200", FLOORS["H200"]), ("NVIDIA H100 80GB HBM3", FLOORS["H100"]),
    ("NVIDIA A100-SXM4-80GB", FLOORS["A100"]), ("NVIDIA H100 NVL", None), ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA H100 PCIe", None), ("Tesla V100-SXM2-32GB", None)])
def test_floors_follow_the_sxm_model_in_the_devices_name(name, floor):
    assert floor_for(name) == floor


def test_cpu_ranks_skip_with_the_reason_and_bad_floors_are_usage_errors(tmp_path):
    verdict = judge_transfers({0: "no CUDA device (the ranks run on cpu)", 1: "no CUDA device (the ranks run on cpu)"})
    assert (verdict.status, verdict.detail) == ("skip", "no CUDA device (the ranks run on cpu)")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"peer_copy_gbps": -1}))
    with pytest.raises(UsageError, match="peer_copy_gbps must be a number >= 0"):
        load_thresholds(str(bad))
