# Sourced by the asserting GPU scripts (benchmarks/gpu_*.sh): $OUT, `step`, `failed`, `machine`
# and `verdict NAME` (exit 1 naming every failed assertion, else ALL ASSERTED OK).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rm -f "$OUT/failed"
step() { echo "== $*"; }
failed() { echo "$1" >> "$OUT/failed"; }
machine() {
  nvidia-smi -L
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())"
}
verdict() {
  if [ -s "$OUT/failed" ]; then echo "$1: FAILED: $(tr '\n' ' ' < "$OUT/failed")"; exit 1; fi
  echo "$1: ALL ASSERTED OK"
}
