"""Judging a GPU's hardware readings (``ddparity health``): NVML's counters and states, one
device at a time, against thresholds a site can set (``--thresholds FILE``).

A reading is plain data (what :mod:`ddparity.harness.health.nvml_probe` reads, or a
recorded one): a dict per device with the fields of :data:`FIELDS`, any of them absent where
the device or driver does not report it (then that check says so and passes nothing).

Defaults, and where they come from (docs/health.md cites them):

* uncorrected ECC errors, volatile: more than 0 fails (Meta's gcm health checks,
  ``ecc_uncorrected_volatile_total``, default 0); aggregate: more than 0 warns (the device
  corrupted memory at some time in its life);
* corrected ECC errors, volatile: more than 50,000,000 fails (gcm's
  ``ecc_corrected_volatile_total`` default);
* row remapping: a failed remap fails (gcm's ``row_remap_failed``: the device needs
  replacing), a pending one warns (a GPU reset applies it), uncorrectable remaps are
  counted; retired pages (older devices): pending warns, double-bit retirements are counted;
* clock throttle reasons: anything but idle, none, application clocks or the software power
  cap warns (thermal and power brakes, hardware slowdown);
* temperature: above 85 C warns (gcm's ``gpu_temperature`` takes a site's threshold; its
  documented examples use 80 and 85);
* PCIe: a link narrower than the device's maximum fails (a lane or riser fault halves host
  transfers); a lower generation is reported only (links slow down when idle);
* NVLink: a link down that the device has fails; replay, recovery and CRC errors warn;
* other processes on the device warn (they take its memory and its time).
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

from ddparity.errors import UsageError

THRESHOLDS: dict[str, float] = {
    "ecc_uncorrected_volatile": 0,
    "ecc_corrected_volatile": 50_000_000,
    "temperature_c": 85,
    "nvlink_errors": 0,
    "other_processes": 0,
}
"""Default limits: a reading above its limit is a finding (see the module docstring)."""

FLOOR_KEYS = ("host_copy_gbps", "peer_copy_gbps")
"""Floors a site may set for the ``transfers`` check (:mod:`ddparity.checks.transfers`), for
every model; a reading below one is a finding."""

FIELDS = ("index", "name", "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "ecc_corrected_volatile",
          "remap_failed", "remap_pending", "remap_uncorrectable", "retired_pending", "retired_double_bit",
          "throttle_reasons", "temperature_c", "power_w", "power_limit_w", "pcie_gen", "pcie_gen_max",
          "pcie_width", "pcie_width_max", "nvlink_up", "nvlink_max", "nvlink_errors", "other_processes", "xid")

BENIGN_THROTTLES = {"gpu_idle", "none", "applications_clocks_setting", "sw_power_cap"}
"""Throttle reasons that say nothing about the device's health."""


def load_thresholds(path: str | None) -> dict[str, float]:
    """The defaults, with a site's own limits from a JSON file (``{"temperature_c": 80}``);
    a file that cannot be read, or a key or value that is not a limit, is a usage error."""
    limits = dict(THRESHOLDS)
    if path is None:
        return limits
    try:
        with open(path) as f:
            given = json.load(f)
    except OSError as exc:
        raise UsageError(f"--thresholds {path!r}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--thresholds {path!r}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(given, dict):
        raise UsageError(f"--thresholds {path!r}: give an object of limits, e.g. {{\"temperature_c\": 80}}")
    for key, value in given.items():
        if key not in THRESHOLDS and key not in FLOOR_KEYS:
            raise UsageError(f"--thresholds {path!r}: {key!r} is not a limit; the limits are "
                             f"{', '.join([*THRESHOLDS, *FLOOR_KEYS])}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UsageError(f"--thresholds {path!r}: {key} must be a number >= 0, got {value!r}")
        limits[key] = value
    return limits


def _over(reading: dict[str, Any], key: str, limits: dict[str, float]) -> bool:
    value = reading.get(key)
    return value is not None and value > limits[key]


def judge_device(reading: dict[str, Any], limits: dict[str, float] | None = None) -> list[tuple[str, str, str]]:
    """Every finding on one device: ``(check, status, detail)`` with status ``fail`` or
    ``warn``; an empty list is a healthy device (as far as it reports)."""
    limits = limits or THRESHOLDS
    out: list[tuple[str, str, str]] = []
    r = reading
    if _over(r, "ecc_uncorrected_volatile", limits):
        out.append(("ecc", "fail", f"{r['ecc_uncorrected_volatile']} uncorrected ECC error(s) since the driver "
                                   f"loaded (limit {limits['ecc_uncorrected_volatile']:g})"))
    if (r.get("ecc_uncorrected_aggregate") or 0) > 0 and not _over(r, "ecc_uncorrected_volatile", limits):
        out.append(("ecc", "warn", f"{r['ecc_uncorrected_aggregate']} uncorrected ECC error(s) in the device's "
                                   f"life"))
    if _over(r, "ecc_corrected_volatile", limits):
        out.append(("ecc", "fail", f"{r['ecc_corrected_volatile']} corrected ECC errors since the driver loaded "
                                   f"(limit {limits['ecc_corrected_volatile']:g}): memory wearing out"))
    if r.get("remap_failed"):
        out.append(("row remapping", "fail", "a row remap failed: the device has no spare rows left for its memory "
                                              "faults; replace it"))
    if r.get("remap_pending"):
        out.append(("row remapping", "warn", f"a row remap is pending ({r.get('remap_uncorrectable') or 0} "
                                              f"uncorrectable remap(s)): reset the GPU to apply it"))
    if r.get("retired_pending"):
        out.append(("retired pages", "warn", f"a page retirement is pending ({r.get('retired_double_bit') or 0} "
                                              f"double-bit retirement(s)): reset the GPU to apply it"))
    brakes = sorted(set(r.get("throttle_reasons") or ()) - BENIGN_THROTTLES)
    if brakes:
        out.append(("clocks", "warn", f"clocks held down: {', '.join(brakes)}"))
    if _over(r, "temperature_c", limits):
        out.append(("temperature", "warn", f"{r['temperature_c']:g} C (limit {limits['temperature_c']:g} C)"))
    width, widest = r.get("pcie_width"), r.get("pcie_width_max")
    if width is not None and widest and width < widest:
        out.append(("pcie", "fail", f"link x{width} of the device's x{widest}: host transfers run at "
                                    f"{width / widest:.0%} of their speed (a lane, slot or riser fault)"))
    up, links = r.get("nvlink_up"), r.get("nvlink_max")
    if up is not None and links and up < links:
        out.append(("nvlink", "fail", f"{links - up} of {links} NVLink link(s) down"))
    if _over(r, "nvlink_errors", limits):
        out.append(("nvlink", "warn", f"{r['nvlink_errors']} NVLink replay, recovery or CRC error(s)"))
    if _over(r, "other_processes", limits):
        out.append(("processes", "warn", f"{r['other_processes']} other process(es) on the device"))
    for xid in r.get("xid") or ():
        out.append(("xid", "fail", f"XID {xid} while the check ran (see NVIDIA's XID catalogue)"))
    return out


class Verdict(NamedTuple):
    """The ``hardware`` check's status (pass | warn | fail | skip), its detail, the ranks it names."""

    status: str
    detail: str
    ranks: list[int]


def judge_hardware(by_rank: dict[int, list[dict[str, Any]] | str],
                   limits: dict[str, float] | None = None) -> Verdict:
    """The ``hardware`` check over every rank's devices: ``skip`` with the reason where no
    rank could read any (no GPU, no NVML), else the worst finding's status with each
    finding named by rank and device."""
    readings = {rank: got for rank, got in by_rank.items() if not isinstance(got, str)}
    if not readings:
        reasons = sorted({got for got in by_rank.values() if isinstance(got, str)})
        return Verdict("skip", "; ".join(reasons) or "nothing read", [])
    findings: list[tuple[str, str]] = []
    failing: set[int] = set()
    flagged: set[int] = set()
    for rank, devices in sorted(readings.items()):
        for device in devices:
            for check, status, detail in judge_device(device, limits):
                findings.append((status, f"rank {rank} {device.get('name', 'GPU')} #{device.get('index', '?')} "
                                         f"{check}: {detail}"))
                (failing if status == "fail" else flagged).add(rank)
    if not findings:
        count = sum(len(d) for d in readings.values())
        return Verdict("pass", f"{count} device(s) read: ECC, row remapping, clocks, temperature, PCIe, NVLink, "
                               f"processes within their limits", [])
    status = "fail" if failing else "warn"
    ranks = sorted(failing) if failing else sorted(flagged)
    return Verdict(status, "; ".join(text for _, text in sorted(findings, key=lambda f: f[0] != "fail")), ranks)


__all__ = ["FIELDS", "FLOOR_KEYS", "THRESHOLDS", "Verdict", "judge_device", "judge_hardware", "load_thresholds"]
