#!/usr/bin/env bash
# One prepared run of the CUDA/nccl paths on a lent GPU machine (see tests/README.md).
# Writes its logs and figures under $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())"
  python3 -c "import shutil; print('py-spy:', shutil.which('py-spy'))"
  echo "== demo on nccl (world size = GPUs), detection on: CUDA fingerprints, CUDA RNG, bucket layout"
  timeout 180 python3 -m ddparity.cli check --demo --backend nccl --world-sizes 1 --json "$OUT/demo_nccl.json"; echo "exit $?"
  echo "== detection on CUDA tensors in a 1-rank nccl world"
  timeout 120 python3 benchmarks/gpu_detection.py; echo "exit $?"
  echo "== fault injections (gloo ranks on a CUDA build of torch)"
  timeout 150 python3 -m ddparity.cli check --demo-faults --world-sizes 2,4 > "$OUT/demo_faults.log" 2>&1; echo "exit $?"
  tail -22 "$OUT/demo_faults.log"
  echo "== detection latency (gloo), timeout 5 s"
  timeout 120 python3 benchmarks/bench_detection_latency.py --world-sizes 2,8; echo "exit $?"
} 2>&1 | tee "$OUT/gpu_check.log"
echo "== test suite on the GPU machine's torch"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -n 4 tests 2>&1 | tee "$OUT/pytest.log" | tail -15 \
  || timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tail -15
