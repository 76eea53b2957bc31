#!/usr/bin/env bash
# One prepared run, on a lent GPU machine, of what issues 40 and 41 added on CUDA:
#  - the profile on a 1-rank nccl world: p95, DDP's own logging, a step's memory as CUDA's
#    peak allocated beside the activations saved for backward, the recommendation line;
#  - a DataParallel row where the machine has fewer CUDA devices than asked (the reason);
#  - localisation on CUDA tensors: DataParallel's replicas (emulated on the one GPU) and the
#    summed-loss probe, each asserted; the non-finite count of CUDA fingerprints.
# Every result it records is asserted (exit 1 on the first that fails). Logs under $OUT.
source "$(dirname "$0")/gpu_lib.sh"
{
  machine

  step "profile --demo on nccl, world size 1 (and dp at 2: its reason)"
  timeout 240 python3 -m ddparity profile --demo --modes dp,ddp --backend nccl --world-sizes 1,2 --steps 5 \
      --json "$OUT/profile.json"; echo "exit $?"
  python3 - "$OUT/profile.json" <<'PY' || failed profile
import json, sys
data = json.load(open(sys.argv[1]))
rows = {(r["mode"], r["world_size"]): r for r in data["runs"]}
one = rows["ddp", 1]
assert one["status"] == "ok" and one["device"].startswith("cuda"), one
assert one["step_p95_s"] >= one["step_s"] > 0, one
memory = one["memory_per_rank"]
assert memory["peak_allocated"] > 0 and memory["activations"] > 0, memory
assert one["step_memory"] == memory["peak_allocated"], one  # on a GPU: the peak, measured by CUDA
assert memory["peak_allocated"] >= memory["params"] + memory["grads"], memory
logged = one["ddp_logging"]
assert logged and logged["buckets"] == one["buckets"], (logged, one["buckets"])
dp = rows["dp", 2]
import torch
if torch.cuda.device_count() < 2:
    assert dp["status"] == "skipped" and "this machine has 1" in dp["reason"], dp
else:
    assert dp["status"] == "ok" and dp["step_s"] > 0, dp
assert data["recommendation"], data
print("profile on CUDA: OK", {k: one[k] for k in ("step_s", "step_p95_s", "step_memory")}, memory, logged)
PY

  step "localisation on CUDA: DataParallel's replicas (emulated on one GPU), BatchNorm on shards"
  timeout 240 python3 -m ddparity check ddparity.fixtures.bugs:batchnorm_on_shards --modes single,dp \
      --backend nccl --world-sizes 2 --json "$OUT/dp_bn.json"; echo "exit $?"
  python3 - "$OUT/dp_bn.json" <<'PY' || failed dp_bn
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
[dp] = [r for r in runs if r["mode"] == "dp"]
module = dp["first_divergence"]["module"]
assert dp["status"] == "diverged" and (module["phase"], module["module"]) == ("forward", "bn"), dp
print("dp localisation on CUDA: OK", module)
PY

  step "the summed-loss probe and the loss's first difference on one CUDA device (dp, 2 replicas)"
  timeout 240 python3 -m ddparity check ddparity.fixtures.bugs:summed_loss --modes single,dp --backend nccl \
      --world-sizes 2 --json "$OUT/dp_summed.json"; echo "exit $?"
  python3 - "$OUT/dp_summed.json" <<'PY' || failed dp_summed
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
[dp] = [r for r in runs if r["mode"] == "dp"]
assert dp["status"] == "pass", dp  # DataParallel's gathered loss is the whole batch's: a sum is the reference's sum
print("dp summed on CUDA: OK (pass)")
PY

  step "DDP's settings swept on CUDA (1 rank): bucket caps, bf16 and PowerSGD hooks"
  timeout 240 python3 -m ddparity profile --demo --backend nccl --world-sizes 1 --bucket-cap-mb 1,100 \
      --comm-hook bf16,powersgd --steps 5 --json "$OUT/sweep.json"; echo "exit $?"
  python3 - "$OUT/sweep.json" <<'PY' || failed sweep
import json, sys
data = json.load(open(sys.argv[1]))
rows = {r["arm"]: r for r in data["runs"]}
assert all(r["status"] == "ok" for r in rows.values()), [(a, r["status"], r["reason"]) for a, r in rows.items()]
small, large = rows["ddp bucket 1 MB"], rows["ddp bucket 100 MB"]
assert small["buckets"] == 3 and large["buckets"] == 1, (small["buckets"], large["buckets"])
assert small["ddp_logging"]["buckets"] == 3 and large["ddp_logging"]["buckets"] == 1
assert 2 * rows["ddp bf16 hook"]["bytes_per_step"] == small["bytes_per_step"]
assert rows["ddp powersgd hook"]["bytes_per_step"] < small["bytes_per_step"] / 10  # rank-1 factors, after 2 iterations
print("sweep on CUDA: OK", data["recommendation"])
PY

  step "the non-finite count of a CUDA fingerprint"
  python3 - <<'PY' || failed nonfinite
import torch
from ddparity.harness.recording.fingerprint import nonfinite_count
t = [torch.zeros(1 << 17, device="cuda"), torch.ones(4, 4, device="cuda", dtype=torch.bfloat16)]
assert int(nonfinite_count(t, part=3)) == 0
t[0][3 * ((1 << 17) // 16) + 1] = float("nan")
t[1][0, 0] = float("inf")
assert [int(nonfinite_count(t, part=p)) for p in (2, 3)] == [1, 2]
print("CUDA non-finite count: OK")
PY
} 2>&1 | tee "$OUT/gpu_localise_profile.log"
verdict gpu_localise_profile
