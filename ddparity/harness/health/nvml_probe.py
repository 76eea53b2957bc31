"""Rank side of the ``hardware`` health check: this rank's GPU as NVML reports it, rootless
(``nvidia-ml-py``, an optional extra: ``pip install nvidia-ml-py``, or ``".[nvml]"`` in a clone).

:func:`read_devices` returns one reading per device (the fields of
:data:`ddparity.checks.hardware.FIELDS`; a field the device or driver does not report is
None), or a sentence saying why there is none (no CUDA device, no NVML). :class:`XidWatch`
collects the XID events NVML raises while the check runs. Judging is
:mod:`ddparity.checks.hardware`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
"""NVML's clock throttle (event) reason bits, by the names the judge uses."""
NVLINK_MAX_LINKS = 18


def nvml() -> Any | str:
    """NVML, initialised, or why not."""
    try:
        import pynvml
    except ImportError:
        return "NVML not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return f"NVML did not start: {exc}"
    return pynvml


def _or_none(fn: Callable[..., Any], *args: Any) -> Any:
    """What ``fn(*args)`` reads, None where the device does not report it (NVML's NotSupported and the like)."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def reading(nv: Any, index: int, handle: Any) -> dict[str, Any]:
    """One device's reading (see the module docstring)."""
    volatile, aggregate = nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
    uncorrected, corrected = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
    remapped = _or_none(lambda: nv.nvmlDeviceGetRemappedRows(handle))  # (corrected, uncorrected, pending, failed)
    reasons = _or_none(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    links = [_or_none(nv.nvmlDeviceGetNvLinkState, handle, link) for link in range(NVLINK_MAX_LINKS)]
    present = [link for link, state in enumerate(links) if state is not None]
    errors = [_or_none(nv.nvmlDeviceGetNvLinkErrorCounter, handle, link, kind)
              for link in present for kind in (nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                                               nv.NVML_NVLINK_ERROR_DL_CRC_FLIT)]
    processes = _or_none(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle))
    power = _or_none(lambda: nv.nvmlDeviceGetPowerUsage(handle))
    limit = _or_none(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle))
    double_bit = _or_none(lambda: nv.nvmlDeviceGetRetiredPages(
        handle, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
    pending = _or_none(lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    return {
        "index": index, "name": _text(_or_none(lambda: nv.nvmlDeviceGetName(handle)) or "GPU"),
        "ecc_uncorrected_volatile": _or_none(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, uncorrected, volatile)),
        "ecc_uncorrected_aggregate": _or_none(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, uncorrected, aggregate)),
        "ecc_corrected_volatile": _or_none(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, corrected, volatile)),
        "remap_uncorrectable": remapped[1] if remapped else None,
        "remap_pending": bool(remapped[2]) if remapped else None,
        "remap_failed": bool(remapped[3]) if remapped else None,
        "retired_pending": bool(pending) if pending is not None else None,
        "retired_double_bit": len(double_bit) if double_bit is not None else None,
        "throttle_reasons": ([name for bit, name in THROTTLE_BITS.items() if reasons & bit] or ["none"])
        if reasons is not None else None,
        "temperature_c": _or_none(lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
        "power_w": power / 1000 if power is not None else None,
        "power_limit_w": limit / 1000 if limit is not None else None,
        "pcie_gen": _or_none(lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
        "pcie_gen_max": _or_none(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        "pcie_width": _or_none(lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        "pcie_width_max": _or_none(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        "nvlink_up": sum(1 for link in present if links[link] == nv.NVML_FEATURE_ENABLED) if present else None,
        "nvlink_max": len(present) or None,
        "nvlink_errors": sum(e for e in errors if e is not None) if present else None,
        "other_processes": sum(1 for p in processes if p.pid != os.getpid()) if processes is not None else None,
        "xid": [],
    }


def read_devices(uuids: list[str]) -> list[dict[str, Any]] | str:
    """The readings of the devices with these UUIDs (a rank's own, as torch names them), or
    why there are none."""
    found = _opened(uuids)
    return found if isinstance(found, str) else [reading(nv, index, handle) for nv, index, handle in found]


def watched(torch_uuid: str) -> tuple[list[dict[str, Any]] | str, XidWatch | None]:
    """The reading of the device torch calls ``torch_uuid`` (NVML's ``GPU-`` prefix added
    where torch leaves it out) and a watch of its XID events from now on; or why there is
    no reading, and no watch."""
    uuid = torch_uuid if torch_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{torch_uuid}"
    found = _opened([uuid])
    if isinstance(found, str):
        return found, None
    return ([reading(nv, index, handle) for nv, index, handle in found],
            XidWatch(found[0][0], [handle for _, _, handle in found]))


def _opened(uuids: list[str]) -> list[tuple[Any, int, Any]] | str:
    """NVML (started once) with each device's index and handle, or why not."""
    if not uuids:
        return "no CUDA device"
    nv = nvml()
    if isinstance(nv, str):
        return nv
    out = []
    for uuid in uuids:
        handle = _or_none(nv.nvmlDeviceGetHandleByUUID, uuid)
        if handle is None:
            return f"NVML does not know device {uuid}"
        out.append((nv, _or_none(nv.nvmlDeviceGetIndex, handle) or 0, handle))
    return out


class XidWatch:
    """The XID events of the devices with ``handles`` from start to :meth:`collect` (NVML's
    event set; where it cannot be made, nothing is collected and :attr:`why` says so)."""

    def __init__(self, nv: Any, handles: list[Any]) -> None:
        self.nv, self.why, self.events = nv, "", None
        try:
            self.events = nv.nvmlEventSetCreate()
            for handle in handles:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self.events)
        except Exception as exc:
            self.why = f"XID events not watched: {exc}"

    def collect(self) -> list[int]:
        """The XIDs raised since the watch began (waits for none)."""
        if self.events is None:
            return []
        xids = []
        while True:
            try:
                event = self.nv.nvmlEventSetWait(self.events, 0)
            except Exception:  # NVMLError_Timeout: none left
                break
            xids.append(int(event.eventData))
        _or_none(lambda: self.nv.nvmlEventSetFree(self.events))
        self.events = None
        return xids


__all__ = ["THROTTLE_BITS", "XidWatch", "nvml", "read_devices", "reading", "watched"]
