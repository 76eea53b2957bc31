#!/usr/bin/env bash
# One prepared run, on a lent GPU machine, of `ddparity health` on CUDA (issue 42):
#  - the default gate on nccl (one rank a GPU): NVML's readings (hardware), copy bandwidths
#    against the H200/H100/A100 floors (transfers), compute, training; its wall time (< 60 s);
#  - --long 20 (the stress pass on a 4096-square matmul) and --pairwise (one rank: skipped);
#  - drills on the GPU: flaky_bits (stress), wrong_matmul (compute); a thresholds file whose
#    temperature limit every GPU exceeds (hardware warns, naming rank 0: real readings judged).
# NVML comes from nvidia-ml-py: carry its wheel (the device machine reaches no index):
#   pip download nvidia-ml-py --no-deps -d build/gpu-wheels   # here, then run with carry=["build/gpu-wheels"]
# Every result it records is asserted (exit 1 on the first that fails). Logs under $OUT.
source "$(dirname "$0")/gpu_lib.sh"
{
  machine
  python3 -c "import pynvml" 2>/dev/null || \
    python3 -m pip install -q --no-index --find-links build/gpu-wheels nvidia-ml-py || failed nvml-install
  python3 -c "import pynvml; pynvml.nvmlInit(); print('NVML driver', pynvml.nvmlSystemGetDriverVersion())" \
    || failed nvml

  step "the default gate on nccl, timed"
  start=$(date +%s.%N)
  timeout 120 python3 -m ddparity health --backend nccl --json "$OUT/health.json"; echo "exit $?"
  echo "wall $(echo "$(date +%s.%N) - $start" | bc) s" | tee "$OUT/health_wall.txt"
  python3 - "$OUT/health.json" "$OUT/health_wall.txt" <<'PY' || failed gate
import json, sys
data = json.load(open(sys.argv[1]))
wall = float(open(sys.argv[2]).read().split()[1])
checks = {c["name"]: c for c in data["checks"]}
print({n: (c["status"], c["detail"][:100]) for n, c in checks.items()})
assert data["backend"] == "nccl" and data["healthy"], data["checks"]
assert wall < 60, f"the default gate took {wall:.1f} s (goal: under a minute)"
[rank] = data["ranks"]
[reading] = rank["hardware"]
assert checks["hardware"]["status"] in ("pass", "warn"), checks["hardware"]
for key in ("ecc_uncorrected_volatile", "temperature_c", "pcie_width_max", "other_processes", "xid"):
    assert key in reading, (key, reading)
assert isinstance(reading["ecc_uncorrected_volatile"], int) and reading["temperature_c"] > 0
copies = rank["transfers"]
assert checks["transfers"]["status"] == "pass", checks["transfers"]
assert copies["h2d_gbps"] > 10 and copies["d2h_gbps"] > 10, copies
if "H200" in copies["name"]:
    assert min(copies["h2d_gbps"], copies["d2h_gbps"]) >= 48, copies  # Azure's floor, judged: pass means >= it
assert all(p["gbps"] >= 335 for p in copies.get("peers", []) if "H200" in copies["name"] and p["access"]), copies
for name in ("versions", "collectives", "compute", "training"):
    assert checks[name]["status"] == "pass", checks[name]
print(f"gate on CUDA: OK in {wall:.1f} s", {k: copies[k] for k in ("name", "h2d_gbps", "d2h_gbps")},
      {k: reading.get(k) for k in ("name", "temperature_c", "pcie_gen", "pcie_width", "throttle_reasons")})
PY

  step "--long 20 --pairwise on nccl"
  timeout 180 python3 -m ddparity health --backend nccl --long 20 --pairwise --json "$OUT/long.json"; echo "exit $?"
  python3 - "$OUT/long.json" <<'PY' || failed long
import json, sys
data = json.load(open(sys.argv[1]))
checks = {c["name"]: c for c in data["checks"]}
stress = data["ranks"][0]["stress"]
assert checks["stress"]["status"] == "pass" and stress["matrix"] == 4096 and stress["repeats"] >= 20, stress
assert stress["seconds"] >= 20 and stress["matmul_mismatches"] == 0 and stress["allreduce_errors"] == 0, stress
assert [b["bytes"] for b in data["bandwidth"]][-1] == 256 << 20, data["bandwidth"]
assert checks["pairwise"]["status"] == "skip", checks["pairwise"]  # one rank: no pair
print("long on CUDA: OK", stress)
PY

  step "drills on the GPU: flaky_bits (stress), wrong_matmul (compute)"
  DDPARITY_HEALTH_FAULT=flaky_bits@0 timeout 120 python3 -m ddparity health --backend nccl --long 5 \
      --json "$OUT/flaky.json"; echo "exit $?"
  DDPARITY_HEALTH_FAULT=wrong_matmul@0 timeout 120 python3 -m ddparity health --backend nccl \
      --json "$OUT/wrong.json"; echo "exit $?"
  python3 - "$OUT/flaky.json" "$OUT/wrong.json" <<'PY' || failed drills
import json, sys
flaky, wrong = (json.load(open(p)) for p in sys.argv[1:3])
checks = {c["name"]: c for c in flaky["checks"]}
assert (checks["stress"]["status"], checks["stress"]["ranks"]) == ("fail", [0]), checks["stress"]
assert flaky["ranks"][0]["stress"]["first_mismatches"] == [3]
checks = {c["name"]: c for c in wrong["checks"]}
assert (checks["compute"]["status"], checks["compute"]["ranks"]) == ("fail", [0]), checks["compute"]
print("drills on CUDA: OK")
PY

  step "a site's thresholds on real readings: a 1 C temperature limit"
  echo '{"temperature_c": 1}' > "$OUT/limits.json"
  timeout 120 python3 -m ddparity health --backend nccl --thresholds "$OUT/limits.json" --json "$OUT/limits_run.json"
  echo "exit $?"
  python3 - "$OUT/limits_run.json" <<'PY' || failed thresholds
import json, sys
checks = {c["name"]: c for c in json.load(open(sys.argv[1]))["checks"]}
hw = checks["hardware"]
assert hw["status"] in ("warn", "fail") and 0 in hw["ranks"] and "temperature" in hw["detail"], hw
print("thresholds on CUDA: OK", hw["detail"][:160])
PY
} 2>&1 | tee "$OUT/gpu_health.log"
verdict gpu_health
