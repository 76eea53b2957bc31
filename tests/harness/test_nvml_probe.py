"""This rank's GPU as NVML reports it, read through a stand-in for ``pynvml`` (no GPU here):
every field of the judge's reading filled from NVML's calls, a call the device does not
support left None, NVML absent or failing to start a reason, XID events collected."""

from __future__ import annotations

import os
import sys
import types

import pytest

from ddparity.checks.hardware import FIELDS, judge_device
from ddparity.harness.health import nvml_probe


class NotSupported(Exception):
    pass


def fake_nvml(links_up: int = 18, width: int = 16, xids: tuple[int, ...] = (), remap=(0, 0, False, False)):
    nv = types.SimpleNamespace(
        NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_TEMPERATURE_GPU=0, NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1, NVML_NVLINK_ERROR_DL_CRC_FLIT=2,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1, nvmlEventTypeXidCriticalError=8)
    pending_xids = list(xids)

    def unsupported(*_):
        raise NotSupported("Not Supported")

    def wait(events, timeout):
        if not pending_xids:
            raise NotSupported("Timeout")
        return types.SimpleNamespace(eventData=pending_xids.pop(0))

    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: uuid if uuid.startswith("GPU-") else unsupported()
    nv.nvmlDeviceGetIndex = lambda h: 3
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: 0
    nv.nvmlDeviceGetRemappedRows = lambda h: remap
    nv.nvmlDeviceGetRetiredPages = unsupported  # (retirement is the older devices')
    nv.nvmlDeviceGetRetiredPagesPendingStatus = unsupported
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x1 | 0x4
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 33
    nv.nvmlDeviceGetPowerUsage = lambda h: 69_600
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nv.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 1
    nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: width
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    nv.nvmlDeviceGetNvLinkState = lambda h, link: (1 if link < links_up else 0) if link < 18 else unsupported()
    nv.nvmlDeviceGetNvLinkErrorCounter = lambda h, link, kind: 0
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=os.getpid())]
    nv.nvmlEventSetCreate = lambda: object()
    nv.nvmlDeviceRegisterEvents = lambda h, kinds, events: None
    nv.nvmlEventSetWait = wait
    nv.nvmlEventSetFree = lambda events: None
    return nv


def test_a_healthy_device_fills_every_field_it_reports_and_passes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    [got] = nvml_probe.read_devices(["GPU-5e1f"])
    assert set(got) == set(FIELDS)
    assert got["name"] == "NVIDIA H100 80GB HBM3" and got["index"] == 3
    assert got["throttle_reasons"] == ["gpu_idle", "sw_power_cap"] and got["power_w"] == pytest.approx(69.6)
    assert (got["nvlink_up"], got["nvlink_max"], got["nvlink_errors"]) == (18, 18, 0)
    assert got["other_processes"] == 0  # this process is not an other
    assert got["retired_pending"] is None and got["retired_double_bit"] is None  # not supported: not judged
    assert judge_device(got) == []


def test_a_degraded_device_reads_as_the_judge_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(links_up=16, width=8, remap=(0, 1, True, False)))
    [got] = nvml_probe.read_devices(["GPU-5e1f"])
    found = {check: status for check, status, _ in judge_device(got)}
    assert found == {"nvlink": "fail", "pcie": "fail", "row remapping": "warn"}


def test_no_nvml_no_device_or_an_unknown_one_is_a_reason(monkeypatch):
    assert nvml_probe.read_devices([]) == "no CUDA device"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert nvml_probe.read_devices(["GPU-1"]) == "NVML not installed (pip install nvidia-ml-py)"
    broken = fake_nvml()
    broken.nvmlInit = lambda: (_ for _ in ()).throw(NotSupported("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert nvml_probe.read_devices(["GPU-1"]) == "NVML did not start: NVML Shared Library Not Found"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    assert nvml_probe.read_devices(["MIG-1"]) == "NVML does not know device MIG-1"


def test_xid_events_raised_while_the_check_ran_are_collected_once():
    nv = fake_nvml(xids=(79, 48))
    watch = nvml_probe.XidWatch(nv, ["GPU-1"])
    assert watch.collect() == [79, 48] and watch.collect() == []
    nv.nvmlEventSetCreate = lambda: (_ for _ in ()).throw(NotSupported("Not Supported"))
    unwatched = nvml_probe.XidWatch(nv, ["GPU-1"])
    assert unwatched.why.startswith("XID events not watched") and unwatched.collect() == []


def test_a_health_rank_reads_its_own_gpu_by_uuid_and_watches_its_xids(monkeypatch):
    """The rank side of the health check: torch's UUID of the rank's device (without NVML's
    ``GPU-`` prefix) finds NVML's device; the XIDs raised meanwhile join its reading."""
    import torch

    from ddparity.harness.health import probe as health_probe

    nv = fake_nvml(xids=(94,))
    asked = []
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or uuid
    nv.nvmlDeviceGetHandleByIndex = lambda index: f"handle {index}"
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="5e1f-77"))
    readings, watch = health_probe._hardware("cuda:0")
    assert asked == ["GPU-5e1f-77"] and readings[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert watch.collect() == [94]
    assert health_probe._hardware("cpu") == ("no CUDA device (the ranks run on cpu)", None)
