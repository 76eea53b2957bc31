#!/usr/bin/env bash
# One prepared run of the CUDA/nccl paths on a lent GPU machine (see benchmarks/README.md).
# Writes its logs and figures under $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())"
  echo "== demo on nccl (world size = GPUs)"
  timeout 180 python3 -m ddparity.cli check --demo --backend nccl --world-sizes 1 --json "$OUT/demo_nccl.json"; echo "exit $?"
  echo "== nccl asked for more ranks than GPUs: that run is skipped"
  timeout 120 python3 -m ddparity.cli check ddparity.fixtures.bugs:batchnorm_on_shards --backend nccl --world-sizes 1,2; echo "exit $?"
  echo "== auto on a CUDA build of torch with 1 GPU: gloo for world sizes 1,2,4"
  timeout 180 python3 -m ddparity.cli check ddparity.fixtures.bugs:summed_loss --world-sizes 1,2,4; echo "exit $?"
  echo "== probe"
  timeout 240 python3 benchmarks/gpu_probe.py > "$OUT/gpu_probe.json"; echo "exit $?"; cat "$OUT/gpu_probe.json"
} 2>&1 | tee "$OUT/gpu_check.log"
echo "== test suite on the GPU machine's torch"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -40
