"""What the non-finite count adds to a step's fingerprint (check's DDP ranks and ``watch``
fingerprint every step), side by side in one run with the fingerprint without it and with
the training step it follows.

The model: an MLP of 2.6 M parameters (width 2048), Adam, batch
64, one intra-op thread as a rank has). Alternating round by round, the same process times:

* step: ``zero_grad``, forward, MSE, backward, ``optimizer.step()`` (what a fingerprint follows);
* fingerprint: :func:`ddparity.harness.recording.fingerprint.fingerprint` (parameters, buffers,
  optimizer state, the part of each large tensor a step samples), as ranks call it;
* without the count: the same with ``nonfinite_count`` replaced by a constant zero.

Each figure is a median over ``--calls`` calls a round, medians over rounds reported; every
fingerprint is checked to hold every parameter's key and a count of 0 (the model is finite).

    python benchmarks/bench_fingerprint.py [--rounds 5] [--calls 30] [--width 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ddparity.harness.recording import fingerprint as fp
from ddparity.records import NONFINITE


def _timed(fn, calls: int) -> float:  # noqa: ANN001
    times = []
    for i in range(calls):
        started = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(256, w), nn.ReLU(), nn.Linear(w, w // 2), nn.ReLU(), nn.Linear(w // 2, 16))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 256), torch.randn(64, 16)

    def step(_: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    step(0)  # the optimizer's state exists from here on, as after a rank's first step
    original = fp.nonfinite_count
    names = {n for n, _ in model.named_parameters()}

    def with_count(i: int) -> None:
        out = fp.fingerprint(model, optimizer, part=i)
        assert out[NONFINITE] == 0 and all(any(n in k for k in out) for n in names), sorted(out)[:5]

    def without_count(i: int) -> None:
        fp.nonfinite_count = lambda *a, **k: 0  # type: ignore[assignment]
        try:
            out = fp.fingerprint(model, optimizer, part=i)
        finally:
            fp.nonfinite_count = original  # type: ignore[assignment]
        assert out[NONFINITE] == 0

    rows: dict[str, list[float]] = {"step": [], "fingerprint": [], "without the count": []}
    for _ in range(args.rounds):
        rows["step"].append(_timed(step, args.calls))
        rows["fingerprint"].append(_timed(with_count, args.calls))
        rows["without the count"].append(_timed(without_count, args.calls))
    med = {k: statistics.median(v) for k, v in rows.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"MLP {params / 1e6:.2f} M parameters, Adam, batch 64, 1 thread; {args.rounds} rounds x {args.calls} calls")
    for name, seconds in med.items():
        spread = f"{min(rows[name]) * 1e3:.3f}-{max(rows[name]) * 1e3:.3f}"
        print(f"  {name:<18} {seconds * 1e3:8.3f} ms  (rounds' medians {spread} ms)")
    added = med["fingerprint"] - med["without the count"]
    print(f"the count adds {added * 1e3:+.3f} ms to a fingerprint ({med['fingerprint'] / med['without the count']:.2f}x),"
          f" {added / med['step'] * 100:+.2f}% of the step")


if __name__ == "__main__":
    main()
