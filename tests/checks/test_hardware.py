"""A GPU's hardware readings judged (pure functions, on readings shaped as ``nvidia-smi -q``
reports them): a healthy H100 passes; each fault a gate must catch is named with its rank
and device; a site's thresholds file replaces the defaults and bad files are usage errors;
no readable device is ``skip`` with the reason."""

from __future__ import annotations

import json

import pytest

from ddparity.checks.hardware import THRESHOLDS, judge_device, judge_hardware, load_thresholds
from ddparity.errors import UsageError

H100 = {  # nvidia-smi -q of an idle, healthy H100 SXM (ECC, remapping, clocks, PCIe, NVLink sections)
    "index": 0, "name": "NVIDIA H100 80GB HBM3", "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
    "ecc_corrected_volatile": 0, "remap_failed": False, "remap_pending": False, "remap_uncorrectable": 0,
    "retired_pending": None, "retired_double_bit": None, "throttle_reasons": ["gpu_idle"], "temperature_c": 31,
    "power_w": 69.6, "power_limit_w": 700.0, "pcie_gen": 1, "pcie_gen_max": 5, "pcie_width": 16,
    "pcie_width_max": 16, "nvlink_up": 18, "nvlink_max": 18, "nvlink_errors": 0, "other_processes": 0, "xid": [],
}


def test_a_healthy_idle_device_passes_a_low_pcie_generation_at_idle_included():
    assert judge_device(H100) == []
    check = judge_hardware({0: [H100], 1: [{**H100, "index": 1}]})
    assert (check.status, check.ranks) == ("pass", []) and check.detail.startswith("2 device(s) read")


@pytest.mark.parametrize("fault, check, status, words", [
    ({"ecc_uncorrected_volatile": 2}, "ecc", "fail", "2 uncorrected ECC error(s) since the driver loaded"),
    ({"ecc_uncorrected_aggregate": 1}, "ecc", "warn", "1 uncorrected ECC error(s) in the device's life"),
    ({"ecc_corrected_volatile": 60_000_000}, "ecc", "fail", "corrected ECC errors since the driver loaded"),
    ({"remap_failed": True}, "row remapping", "fail", "replace it"),
    ({"remap_pending": True, "remap_uncorrectable": 1}, "row remapping", "warn", "reset the GPU to apply it"),
    ({"retired_pending": True, "retired_double_bit": 3}, "retired pages", "warn", "3 double-bit retirement(s)"),
    ({"throttle_reasons": ["hw_thermal_slowdown", "sw_power_cap"]}, "clocks", "warn",
     "clocks held down: hw_thermal_slowdown"),
    ({"temperature_c": 91}, "temperature", "warn", "91 C (limit 85 C)"),
    ({"pcie_width": 8}, "pcie", "fail", "link x8 of the device's x16: host transfers run at 50%"),
    ({"nvlink_up": 16}, "nvlink", "fail", "2 of 18 NVLink link(s) down"),
    ({"nvlink_errors": 12}, "nvlink", "warn", "12 NVLink replay, recovery or CRC error(s)"),
    ({"other_processes": 1}, "processes", "warn", "1 other process(es) on the device"),
    ({"xid": [79]}, "xid", "fail", "XID 79 while the check ran"),
])
def test_each_fault_is_named_with_its_rank_and_device(fault, check, status, words):
    [(got, level, detail)] = judge_device({**H100, **fault})
    assert (got, level) == (check, status) and words in detail, detail
    judged = judge_hardware({0: [H100], 3: [{**H100, "index": 1, **fault}]})
    assert judged.status == status and judged.ranks == [3], judged
    assert f"rank 3 NVIDIA H100 80GB HBM3 #1 {check}: " in judged.detail


def test_what_a_device_does_not_report_is_not_judged():
    assert judge_device({"index": 0, "name": "NVIDIA T4"}) == []  # no NVLink, no remapping: nothing to say


def test_a_fail_is_listed_before_a_warn():
    judged = judge_hardware({0: [{**H100, "temperature_c": 90}], 1: [{**H100, "pcie_width": 4}]})
    assert judged.status == "fail" and judged.ranks == [1]
    assert judged.detail.index("pcie") < judged.detail.index("temperature")


def test_no_readable_device_is_skip_with_the_reason():
    judged = judge_hardware({0: "no CUDA device", 1: "no CUDA device"})
    assert (judged.status, judged.detail) == ("skip", "no CUDA device")


def test_a_sites_thresholds_replace_the_defaults(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"temperature_c": 95, "other_processes": 2}))
    limits = load_thresholds(str(path))
    assert limits == {**THRESHOLDS, "temperature_c": 95, "other_processes": 2}
    assert judge_device({**H100, "temperature_c": 91, "other_processes": 2}, limits) == []
    assert load_thresholds(None) == THRESHOLDS


@pytest.mark.parametrize("text, words", [
    ("{", "not JSON"),
    ("[80]", "give an object of limits"),
    ('{"temp": 80}', "'temp' is not a limit; the limits are ecc_uncorrected_volatile"),
    ('{"temperature_c": -1}', "temperature_c must be a number >= 0, got -1"),
    ('{"temperature_c": true}', "temperature_c must be a number >= 0, got True"),
])
def test_a_bad_thresholds_file_is_a_usage_error_naming_the_fix(tmp_path, text, words):
    path = tmp_path / "limits.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        load_thresholds(str(path))
    with pytest.raises(UsageError, match="cannot read it"):
        load_thresholds(str(tmp_path / "missing.json"))
