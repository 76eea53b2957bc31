#!/usr/bin/env bash
# One prepared run of the pytest plugin on a lent GPU machine: parity tests under nccl,
# the plugin benchmark on its CPUs with more xdist workers, and the suite under xdist.
# Writes its logs under $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
cat > "$WORK/test_gpu.py" <<'PY'
import pytest
import torch
from ddparity import Case
from ddparity.fixtures.models import MLP, vectors


def add_to_grads(state, bucket):
    """A comm hook that corrupts every reduced gradient (visible at world size 1)."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].add_(1e-2))


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("seed", range(3))
def test_mlp(parity, seed):
    parity(Case(model=MLP, data=vectors, optimizer="adam", lr=1e-3, steps=3, seed=seed))


@pytest.mark.world_size(1)
def test_on_cuda(world):
    assert world.run(lambda ctx: (ctx.device, torch.cuda.is_available())) == [("cuda:0", True)]


@pytest.mark.world_size(1)
def test_broken_hook(parity):
    parity(Case(model=MLP, data=vectors, optimizer="sgd", lr=0.1, steps=3, comm_hook=add_to_grads))
PY
{
  nvidia-smi -L
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())"
  nproc
  echo "== plugin under nccl (ws1 runs on cuda:0, ws2 skipped with its reason; expected: 4 passed, 3 skipped, 1 failed)"
  ( cd "$WORK" && timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --ddparity-backend nccl \
      --ddparity-report report.json --junitxml junit.xml test_gpu.py > pytest_nccl.log 2>&1; echo "exit $?"; \
    tail -45 pytest_nccl.log; cp pytest_nccl.log junit.xml report.json "$OUT/" )
  python3 -c "import json; r=json.load(open('$WORK/report.json')); print([(x['test'], x['mode'], x['world_size'], x['backend'], x['status']) for x in r['runs']])"
  echo "== ddparity profile under nccl (CUDA-event bucket timing), world size 1"
  timeout 240 python3 -m ddparity.cli profile --demo --backend nccl --world-sizes 1 --json "$OUT/profile_nccl.json"; echo "exit $?"
  echo "== ddparity health: local nccl world (one rank per GPU), then under torchrun with nccl"
  timeout 120 python3 -m ddparity.cli health --json "$OUT/health_nccl.json"; echo "exit $?"
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m ddparity.cli health --backend nccl \
      --json "$OUT/health_torchrun.json"; echo "exit $?"
  DDPARITY_HEALTH_FAULT=wrong_matmul@0 timeout 120 python3 -m ddparity.cli health --backend nccl; echo "exit $? (expected 1)"
  echo "== check and profile under torchrun with nccl (one process per GPU; reference on cuda:0)"
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m ddparity check \
      ddparity.fixtures.models:mlp_sgd --backend nccl --json "$OUT/check_torchrun_nccl.json"; echo "exit $? (expected 0)"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m ddparity check \
      ddparity.fixtures.bugs:batchnorm_on_shards --backend nccl --json "$OUT/check_torchrun_bn.json"; echo "exit $? (1 with 2+ GPUs)"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m ddparity profile \
      ddparity.fixtures.models:profile_demo --backend nccl --json "$OUT/profile_torchrun_nccl.json"; echo "exit $?"
  echo "== the torchrun fault matrix on this machine's CPUs (gloo; two agents on loopback too)"
  timeout 400 python3 benchmarks/bench_torchrun.py --repeat 3; echo "exit $?"
  echo "== ddparity profile on this machine's CPUs (gloo), 1,2,4,8"
  timeout 120 python3 -m ddparity.cli profile --demo --world-sizes 1,2,4,8 --json "$OUT/profile_gloo.json"; echo "exit $?"
  echo "== plugin benchmark on this machine's CPUs (gloo), -n 0/2/4/8"
  timeout 300 python3 benchmarks/bench_pytest_plugin.py --xdist 2,4,8; echo "exit $?"
} 2>&1 | tee "$OUT/gpu_plugin.log"
echo "== test suite on the GPU machine's torch, -n 8"
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$OUT/pytest.log" | tail -15
