"""Judging ``ddparity health``: every rank's measurements -> checks that pass or fail.

Checks, in order:

* ``versions``: every rank runs the same torch, CUDA and Python (a mixed image is the
  classic source of silent numerical differences and NCCL mismatches);
* ``hardware``: each GPU as NVML reports it (ECC, row remapping, clocks, temperature, PCIe,
  NVLink, other processes, XIDs) against a site's thresholds (:mod:`ddparity.checks.hardware`);
  ``skip`` with the reason where there is no GPU or no NVML;
* ``transfers``: copy bandwidth host to device, device to host and between local devices
  against floors per device model (:mod:`ddparity.checks.transfers`); ``skip`` without a GPU;
* ``collectives``: all_reduce, broadcast and all_gather of exactly representable values
  give the exact expected result on every rank;
* ``compute``: a float32 matmul agrees with float64 on the CPU within
  :data:`MATMUL_REL_TOL` on every rank (a device that computes wrong), and ranks with the
  same device model agree bit for bit in it and in a bfloat16 one (silent data corruption:
  ``fail`` naming the rank and device; ``warn`` for CPUs on several hosts);
* ``speed``: no rank's matmul throughput is below :data:`SLOW_FRACTION` of the other
  ranks' median (a throttled or misconfigured device stalls every step of every rank);
* ``bandwidth``: all-reduce bus bandwidth per message size (slowest rank), against
  ``--min-busbw`` at the largest size when given;
* ``latency``: a one-element all-reduce (reported);
* ``stress`` (``--long``): every rank's repeats of one seeded matmul equal the first bit for
  bit, and every all-reduce run beside them exact, for the pass's seconds;
* ``pairwise`` (``--pairwise``): all-reduce bus bandwidth pair by pair of nodes (of ranks
  on one node); a node whose pairs run below :data:`SLOW_FRACTION` of the others', or a
  pair below that of the median pair's, fails, named (:func:`judge_pairs`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from ddparity.checks.comm import bus_factor
from ddparity.checks.hardware import judge_hardware
from ddparity.checks.transfers import judge_transfers
from ddparity.measurements import PairTiming, RankHealth

MATMUL_REL_TOL = 5e-3
"""float32 (or TF32) against float64: ~1e-6 (~1e-3 with TF32); a wrong device is far off."""

SLOW_FRACTION = 0.5


@dataclass(slots=True)
class Check:
    name: str
    status: str  # pass | warn | fail | skip (nothing to measure, or not run: its detail says why)
    detail: str
    ranks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Bandwidth:
    bytes: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float | None


@dataclass(slots=True)
class PairBandwidth:
    a: int
    b: int
    bytes: int
    seconds: float
    busbw_gbps: float
    unit: str  # rank | node (each node by its lowest rank)
    network_only: bool


def judge_pairs(timings: list[PairTiming], name: str = "pairwise") -> tuple[Check, list[PairBandwidth]]:
    """Which link is slow: each pair's all-reduce bus bandwidth (its slower end's time; with
    two ranks bus and algorithm bandwidth are equal). A node (rank) whose pairs' median is
    below :data:`SLOW_FRACTION` of the median of the pairs without it is named; then a pair
    below that fraction of the median of the pairs left. Medians, not the fastest pair: one
    pair's lucky run must not make the others slow (on 4 CPU ranks here pairs spread
    0.70-1.57x their median at 2 MiB, 0.78-1.21x at 32 MiB)."""
    slowest: dict[tuple[int, int], PairTiming] = {}
    for t in timings:
        key = (t.a, t.b)
        if key not in slowest or t.seconds > slowest[key].seconds:
            slowest[key] = t
    rows = [PairBandwidth(t.a, t.b, t.nbytes, t.seconds, t.nbytes / t.seconds / 1e9 if t.seconds > 0 else 0.0,
                          t.unit, t.network_only) for _, t in sorted(slowest.items())]
    if not rows:
        return Check(name, "skip", "one rank: no pair to measure"), rows
    unit = rows[0].unit
    how = " (network only: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)" if rows[0].network_only else ""
    size = f"{rows[0].bytes / 2**20:g} MiB"
    if len(rows) == 1:
        r = rows[0]
        return Check(name, "skip", f"one pair ({unit}s {r.a}-{r.b}: {r.busbw_gbps:.3g} GB/s at {size}){how}: "
                                   f"no other pair to compare with"), rows
    spread = (f"{min(r.busbw_gbps for r in rows):.3g}-{max(r.busbw_gbps for r in rows):.3g} GB/s at {size} "
              f"over {len(rows)} pairs of {unit}s{how}")
    ends = sorted({u for r in rows for u in (r.a, r.b)})
    slow_ends = [u for u in ends if len(ends) > 2 and statistics.median(r.busbw_gbps for r in rows if u in (r.a, r.b))
                 < SLOW_FRACTION * statistics.median(r.busbw_gbps for r in rows if u not in (r.a, r.b))]
    left = [r for r in rows if r.a not in slow_ends and r.b not in slow_ends]
    floor = SLOW_FRACTION * statistics.median(o.busbw_gbps for o in left) if len(left) > 1 else 0.0
    slow = [r for r in left if r.busbw_gbps < floor]
    if not slow_ends and not slow:
        return Check(name, "pass", f"all-reduce bus bandwidth {spread}"), rows
    said = []
    for u in slow_ends:
        theirs = [r for r in rows if u in (r.a, r.b)]
        said.append(f"{unit} {u}'s link" + (" (its NIC, cable or switch port)" if unit == "node" else "")
                    + " is slow: its pairs' median below half that of the pairs without it ("
                    + ", ".join(f"{r.a}-{r.b} {r.busbw_gbps:.3g} GB/s" for r in theirs) + ")")
    if slow:
        said.append("slow link(s) between " + unit + "s " + ", ".join(f"{r.a}-{r.b} ({r.busbw_gbps:.3g} GB/s)"
                                                                      for r in slow) + ", below half the median pair's")
    named = sorted(set(slow_ends) | {u for r in slow for u in (r.a, r.b)})
    return Check(name, "fail", "; ".join(said) + f"; {spread}", named), rows


def judge(ranks: list[RankHealth], min_busbw: float | None = None,
          limits: dict[str, float] | None = None) -> tuple[list[Check], list[Bandwidth]]:
    """Every check (see the module docstring); ``limits``: the hardware readings' thresholds
    (:func:`ddparity.checks.hardware.load_thresholds`, the defaults where None)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    n = len(ranks)
    checks = [_versions(ranks), Check("hardware", *judge_hardware({r.rank: r.hardware for r in ranks}, limits)),
              Check("transfers", *judge_transfers({r.rank: r.transfers for r in ranks}, limits)),
              _collectives(ranks), _compute(ranks), _speed(ranks)]
    bandwidth = []
    for i, (nbytes, _) in enumerate(ranks[0].allreduce):
        seconds = max(r.allreduce[i][1] for r in ranks)
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        bandwidth.append(Bandwidth(nbytes, seconds, algbw, algbw * bus_factor(n) if n > 1 else None))
    checks.append(_bandwidth(bandwidth, n, min_busbw))
    if any(r.stress is not None for r in ranks):
        checks.append(_stress(ranks))
    latency = max(r.latency_s for r in ranks)
    checks.append(Check("latency", "pass", f"one-element all_reduce: {latency * 1e6:.0f} us (slowest rank, median)"))
    return checks, bandwidth


def _versions(ranks: list[RankHealth]) -> Check:
    for what in ("torch_version", "cuda_version", "python_version"):
        values = Counter(getattr(r, what) for r in ranks)
        if len(values) > 1:
            common = values.most_common(1)[0][0]
            odd = [r.rank for r in ranks if getattr(r, what) != common]
            seen = ", ".join(f"{v} on {c} rank(s)" for v, c in values.items())
            return Check("versions", "fail", f"{what.replace('_', ' ')} differs across ranks: {seen}", odd)
    r = ranks[0]
    return Check("versions", "pass", f"torch {r.torch_version}, CUDA {r.cuda_version or '-'}, Python {r.python_version} "
                                     f"on every rank")


def _collectives(ranks: list[RankHealth]) -> Check:
    bad = [r for r in ranks if r.collective_errors]
    if bad:
        first = bad[0]
        return Check("collectives", "fail", f"wrong results on rank(s) {[r.rank for r in bad]}; rank {first.rank}: "
                                            f"{first.collective_errors[0]}", [r.rank for r in bad])
    return Check("collectives", "pass", "all_reduce, broadcast and all_gather exact on every rank")


def _compute(ranks: list[RankHealth]) -> Check:
    bad = [r for r in ranks if not r.matmul_max_rel_error <= MATMUL_REL_TOL]
    if bad:
        worst = max(bad, key=lambda r: r.matmul_max_rel_error)
        return Check("compute", "fail", f"matmul off by {worst.matmul_max_rel_error:.2g} (relative, vs float64; "
                                        f"limit {MATMUL_REL_TOL:g}) on rank(s) {[r.rank for r in bad]}",
                     [r.rank for r in bad])
    disagreeing = [found for name in sorted({r.device_name for r in ranks})
                   for found in [_disagreeing([r for r in ranks if r.device_name == name])] if found]
    if disagreeing:
        status = "fail" if any(level == "fail" for level, _, _ in disagreeing) else "warn"
        named = sorted({rank for _, _, suspects in disagreeing for rank in suspects})
        return Check("compute", status, "; ".join(text for _, text, _ in disagreeing), named)
    largest = max(r.matmul_max_rel_error for r in ranks)
    return Check("compute", "pass", f"matmul matches float64 on every rank (max relative error {largest:.1e}), "
                                    f"identical bits per device model")


def _disagreeing(group: list[RankHealth]) -> tuple[str, str, list[int]] | None:
    """Ranks of one device model whose matmul (float32, then bfloat16) gives other bits than
    the rest: silent data corruption, a ``fail`` naming them where the group is GPUs of one
    model or one machine's CPUs (the same seeded product must be bit for bit the same),
    ``warn`` for CPUs on several hosts (their name says no model). Without a majority every
    rank of the group is named, and the text says none is known to be the wrong one."""
    for digest, precision in (("matmul_bits", "float32"), ("matmul_bits_bf16", "bfloat16")):
        counts = Counter(getattr(r, digest) for r in group).most_common()
        if len(counts) < 2:
            continue
        name = group[0].device_name
        same = all(r.device.startswith("cuda") for r in group) or len({r.host for r in group}) == 1
        level = "fail" if same else "warn"
        if counts[0][1] == counts[1][1]:  # no majority
            ranks = sorted(r.rank for r in group)
            return level, (f"rank(s) {ranks} ({name}) disagree bit for bit in the same seeded {precision} matmul, "
                           f"and no majority says which is right: silent data corruption on one of them (add a "
                           f"device of the model, or swap one out)"), ranks
        odd = sorted(r.rank for r in group if getattr(r, digest) != counts[0][0])
        where = ", ".join(f"rank {r.rank} {r.device}" for r in group if r.rank in odd)
        return level, (f"{where} ({name}) compute other bits than the {counts[0][1]} other {name} device(s) in the "
                       f"same seeded {precision} matmul: silent data corruption"
                       + ("" if same else " (or other CPUs on other hosts: their name says no model)")), odd
    return None


def _speed(ranks: list[RankHealth]) -> Check:
    """A rank is slow below :data:`SLOW_FRACTION` of the median of the *other* ranks (with
    two ranks, each is compared with the other: a rank half as fast is caught)."""
    if len(ranks) == 1:
        return Check("speed", "skip", f"one rank: no other to compare with (matmul {ranks[0].gflops:.1f} GFLOP/s)")
    slow = []
    for r in ranks:
        others = [o.gflops for o in ranks if o is not r]
        if others and r.gflops < SLOW_FRACTION * statistics.median(others):
            slow.append(r)
    median = statistics.median(r.gflops for r in ranks)
    if slow:
        return Check("speed", "fail", "matmul throughput below half that of the other ranks on rank(s) "
                                      + ", ".join(f"{r.rank} ({r.gflops:.1f} GFLOP/s)" for r in slow)
                                      + f"; median {median:.1f} GFLOP/s", [r.rank for r in slow])
    low, high = min(r.gflops for r in ranks), max(r.gflops for r in ranks)
    return Check("speed", "pass", f"matmul {low:.1f}-{high:.1f} GFLOP/s across ranks (median {median:.1f})")


def _stress(ranks: list[RankHealth]) -> Check:
    """``--long``: a rank whose repeated product changed bits, or whose all-reduces under load
    were not exact, fails, named (the first repeats that were wrong are in the JSON)."""
    said, bad = [], []
    for r in ranks:
        s = r.stress or {}
        if s.get("matmul_mismatches"):
            said.append(f"rank {r.rank} {r.device} ({r.device_name}): {s['matmul_mismatches']} of {s['repeats']} "
                        f"repeats of the same seeded float32 matmul gave other bits than the first (first at repeat "
                        f"{s['first_mismatches'][0]}): unstable under load")
        if s.get("allreduce_errors"):
            said.append(f"rank {r.rank}: {s['allreduce_errors']} of {s['repeats']} all-reduces under load were not "
                        f"exact (first at repeat {s['first_allreduce_errors'][0]})")
        if s.get("matmul_mismatches") or s.get("allreduce_errors"):
            bad.append(r.rank)
    if bad:
        return Check("stress", "fail", "; ".join(said), bad)
    fewest = min(ranks, key=lambda r: (r.stress or {}).get("repeats", 0))
    s = fewest.stress or {}
    return Check("stress", "pass", f"{s.get('seconds', 0):.0f} s under load: {s.get('repeats', 0)} repeats of a "
                                   f"{s.get('matrix')}-square float32 matmul identical bit for bit and as many "
                                   f"{s.get('reduce_bytes', 0) / 2**20:g} MiB all-reduces exact, on every rank")


def _bandwidth(rows: list[Bandwidth], n: int, min_busbw: float | None) -> Check:
    if not rows:
        return Check("bandwidth", "skip", "no sizes measured")
    top = rows[-1]
    if n == 1 or top.busbw_gbps is None:
        return Check("bandwidth", "skip", "one rank: no links to measure")
    text = f"all_reduce bus bandwidth {top.busbw_gbps:.3g} GB/s at {top.bytes / 2**20:.0f} MiB"
    if min_busbw is not None and top.busbw_gbps < min_busbw:
        return Check("bandwidth", "fail", f"{text}, below --min-busbw {min_busbw:g} GB/s")
    return Check("bandwidth", "pass", text + (f" (>= --min-busbw {min_busbw:g})" if min_busbw is not None else ""))


