"""Judging a GPU node's copy bandwidth (``ddparity health``'s ``transfers`` check): host to
device and device to host (pinned memory, each device in turn) and device to device between
every local pair, against floors per device model.

A reading is plain data (what :mod:`ddparity.harness.health.transfer_probe` measures, or a
recorded one): per rank ``{"name": "NVIDIA H200", "h2d_gbps": 55.1, "d2h_gbps": 55.4,
"peers": [{"src": 0, "dst": 1, "access": true, "gbps": 371.0}, ...]}`` (``peers`` on each
host's first rank only), or a string saying why nothing was measured.

Floors (GB/s, 1e9 bytes) from Azure's node health checks (azurehpc-health-checks, its
``conf/*.conf`` lines ``check_gpu_bw H2D_D2H P2P`` / ``check_cuda_bw H2D_D2H``, measured with
NVIDIA's nvbandwidth, copy engines): H200 (``nd96isr_h200_v5``) 48 and 335, H100
(``nd96isr_h100_v5``) 52, A100 (``nd96asr_v4``) 24. ddparity's copies are torch ``copy_``
calls of 256 MiB, best of 5: the same engines, not the same program. A site sets its own
with ``--thresholds`` (``host_copy_gbps``, ``peer_copy_gbps``, every model).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from ddparity.checks.hardware import FLOOR_KEYS, Verdict


class Floor(NamedTuple):
    host_gbps: float
    peer_gbps: float | None  # None: no published floor (NVLink-less parts, or none published)


FLOORS: dict[str, Floor] = {"H200": Floor(48.0, 335.0), "H100": Floor(52.0, None), "A100": Floor(24.0, None)}
"""Per SXM device model, matched as a word of its name (see the module docstring for
sources); PCIe and NVL boards (other links, other figures) get no floor from here."""


def floor_for(name: str, limits: dict[str, float] | None = None) -> Floor | None:
    """The floors for a device called ``name`` (a site's from ``limits`` first), or None."""
    limits = limits or {}
    words = set(re.split(r"[\s\-_]+", name.upper()))
    model = None if words & {"PCIE", "NVL"} else next((f for m, f in FLOORS.items() if m in words), None)
    host = limits.get("host_copy_gbps", model.host_gbps if model else None)
    peer = limits.get("peer_copy_gbps", model.peer_gbps if model else None)
    return None if host is None and peer is None else Floor(host if host is not None else 0.0, peer)


def judge_transfers(by_rank: dict[int, dict[str, Any] | str], limits: dict[str, float] | None = None) -> Verdict:
    """The ``transfers`` check: ``skip`` with the reason where no rank measured any; ``fail``
    for a copy below its model's floor (naming the rank and device, or the pair), or no peer
    access between two devices of a model whose floor expects it (NVLink parts); ``warn`` for
    no peer access elsewhere; else ``pass`` with the slowest figures (and the models that have
    no floor: measured, not judged)."""
    readings = {rank: got for rank, got in by_rank.items() if not isinstance(got, str)}
    if not readings:
        reasons = sorted({got for got in by_rank.values() if isinstance(got, str)})
        return Verdict("skip", "; ".join(reasons) or "nothing measured", [])
    fails: list[tuple[int, str]] = []
    warns: list[tuple[int, str]] = []
    unjudged: set[str] = set()
    for rank, r in sorted(readings.items()):
        name = r.get("name", "GPU")
        floor = floor_for(name, limits)
        if floor is None:
            unjudged.add(name)
        for key, what in (("h2d_gbps", "host to device"), ("d2h_gbps", "device to host")):
            got = r.get(key)
            if floor is not None and got is not None and got < floor.host_gbps:
                fails.append((rank, f"rank {rank} {name} {what} {got:.3g} GB/s, below its floor "
                                    f"{floor.host_gbps:g} GB/s (a narrow or slow PCIe link, or a busy host)"))
        for p in r.get("peers") or ():
            pair = f"rank {rank}'s host, devices {p['src']} -> {p['dst']}"
            if not p.get("access"):
                (fails if floor is not None and floor.peer_gbps else warns).append(
                    (rank, f"{pair}: no peer access (copies go through the host)"))
            elif floor is not None and floor.peer_gbps and p.get("gbps") is not None and p["gbps"] < floor.peer_gbps:
                fails.append((rank, f"{pair} {p['gbps']:.3g} GB/s, below its floor {floor.peer_gbps:g} GB/s "
                                    f"(an NVLink down or degraded)"))
    if fails or warns:
        status = "fail" if fails else "warn"
        shown = fails + warns
        return Verdict(status, "; ".join(text for _, text in shown), sorted({rank for rank, _ in (fails or warns)}))
    host = [min(r[k] for k in ("h2d_gbps", "d2h_gbps") if r.get(k) is not None) for r in readings.values()
            if r.get("h2d_gbps") is not None or r.get("d2h_gbps") is not None]
    peers = [p["gbps"] for r in readings.values() for p in r.get("peers") or () if p.get("gbps") is not None]
    said = [f"host copies >= {min(host):.3g} GB/s" if host else "no host copy measured"]
    said.append(f"peer copies >= {min(peers):.3g} GB/s over {len(peers)} pair(s)" if peers else
                "no peer pairs (one device a host)")
    if unjudged:
        said.append(f"no floor for {', '.join(sorted(unjudged))}: measured, not judged (--thresholds "
                    f"host_copy_gbps, peer_copy_gbps)")
    return Verdict("pass", "; ".join(said), [])


__all__ = ["FLOORS", "FLOOR_KEYS", "Floor", "floor_for", "judge_transfers"]
