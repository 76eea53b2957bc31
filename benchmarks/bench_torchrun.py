"""``ddparity check`` under torchrun: its cost next to the same training launched plainly,
and the verdict, rank named, wall time and leftover processes of every fault.

* ``plain``: ``torchrun --standalone --nproc-per-node 2 train.py``, a script as a user
  writes it: the case's model under DDP on gloo, its optimizer, the same steps and batch;
* ``ddparity``: ``torchrun --standalone --nproc-per-node 2 -m ddparity check <case>``;
* every fault of ``ddparity.fixtures`` under the same launch (one node), then under two
  torchrun agents meeting on loopback (two "nodes": the second is served the reference
  over the network and its death is found by its silence). ``extra s`` is the wall time
  beyond the clean check's (and, for a hang, beyond ``--timeout``): what finding and
  reporting the fault cost.

    python benchmarks/bench_torchrun.py [--repeat 3] [--timeout 5] [--no-two-nodes]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

CASES = [  # target, expected status, expected rank named
    ("models:mlp_sgd", "pass", None),
    ("bugs:summed_loss", "diverged", None),
    ("bugs:batchnorm_on_shards", "diverged", None),
    ("faults:stuck_rank", "hang", [1]),
    ("faults:raising_rank", "crash", 1),
    ("faults:exiting_rank", "crash", 1),
    ("faults:segfault", "crash", 1),
    ("faults:skipped_collective", "desync", [1]),
    ("faults:mismatched_shape", "desync", [1]),
    ("faults:rank_local_param", "desync", [0, 1]),
]

PLAIN = '''
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddparity.fixtures.models import mlp_sgd
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
case = mlp_sgd()
torch.manual_seed(case.seed)
model = DDP(case.model())
opt = torch.optim.SGD(model.parameters(), lr=case.lr)
gen = torch.Generator().manual_seed(case.seed)
for step in range(case.steps):
    x, y = case.data(step, gen)
    n = x.shape[0] // ws
    loss = torch.nn.functional.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
    opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


def _left(folder: str) -> int:
    time.sleep(1.0)
    n = 0
    for p in psutil.process_iter(["cwd"]):
        try:
            n += p.info["cwd"] == folder and p.pid != os.getpid()
        except psutil.Error:
            pass
    return n


def _agents(args: list[str], nodes: int) -> list[list[str]]:
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        return [[*run, "--standalone", "--nproc-per-node", "2", *args]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [[*run, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "bench", *args] for _ in range(nodes)]


def launch(args: list[str], nodes: int = 1, expect: int | None = None) -> tuple[float, dict | None, int]:
    """Wall seconds, the JSON report (if any) and processes left behind; with ``expect``,
    exits the benchmark unless every agent exited with it (a timed launch that failed
    times nothing)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "r.json")
        started = time.perf_counter()
        procs = [subprocess.Popen(cmd + (["--json", out] if "ddparity" in cmd else []), cwd=folder, env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for cmd in _agents(args, nodes)]
        for p in procs:
            p.wait(timeout=600)
        seconds = time.perf_counter() - started
        if expect is not None and any(p.returncode != expect for p in procs):
            raise SystemExit(f"{' '.join(args)}: agents exited {[p.returncode for p in procs]}, not {expect}")
        data = json.load(open(out)) if os.path.exists(out) else None
        return seconds, data, _left(folder)


def named(run: dict) -> object:
    for key, field in (("hang", "suspect_ranks"), ("crash", "rank"), ("desync", "ranks")):
        if run.get(key):
            return run[key][field]
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--no-two-nodes", action="store_true")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PLAIN)
    plain = [launch([f.name], expect=0)[0] for _ in range(args.repeat)]
    ours = [launch(["-m", "ddparity", "check", "ddparity.fixtures.models:mlp_sgd"], expect=0)[0]
            for _ in range(args.repeat)]
    os.unlink(f.name)
    base = statistics.median(ours)
    print(f"plain DDP under torchrun: median {statistics.median(plain):.2f} s; ddparity check under torchrun: "
          f"median {base:.2f} s ({base / statistics.median(plain):.2f}x), {args.repeat} launches each")
    print(f"\n{'nodes':>5}  {'case':28} {'verdict':9} {'as expected':11} {'rank named':10} {'wall s':>7} "
          f"{'extra s':>7}  left")
    wrong = 0
    for nodes in (1,) if args.no_two_nodes else (1, 2):
        for target, status, rank in CASES:
            seconds, data, left = launch(["-m", "ddparity", "check", f"ddparity.fixtures.{target}", "--timeout",
                                          str(args.timeout)], nodes)
            run = [r for r in data["runs"] if r["mode"] == "ddp"][0] if data else {"status": "no report"}
            ok = run["status"] == status and (rank is None or named(run) == rank) and not left
            wrong += not ok
            extra = seconds - base - (args.timeout if status == "hang" else 0)
            print(f"{nodes:>5}  {target:28} {run['status']:9} {'yes' if ok else 'NO':11} {named(run)!s:10} "
                  f"{seconds:7.2f} {extra:7.2f}  {left}")
    print(f"\n{'OK' if not wrong else 'FAILED'}: {wrong} verdict(s) not as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
