"""How soon ``ddparity check --demo`` shows something on a terminal, against how long the
first thing it needs (``import torch``) takes alone, in one run.

Each command runs under a pseudo-terminal (as a user's shell runs it); the time is from
the start of the process to the first byte it writes, and to its exit. Every run must exit
with its expected code and its first bytes must be ddparity's starting line, else this
exits 1.

    python benchmarks/bench_first_output.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import statistics
import sys
import time

STARTING = b"ddparity check: starting"


def through_a_terminal(argv: list[str], limit: float = 300.0) -> tuple[float | None, float, int, bytes]:
    """(seconds to the first byte, seconds to the exit, exit code, every byte written)."""
    started = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, with the terminal as stdin, stdout and stderr
        os.execv(argv[0], argv)
    first, out = None, b""
    while time.perf_counter() - started < limit:
        ready, _, _ = select.select([fd], [], [], 0.02)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal: it exited
            break
        if not chunk:
            break
        if first is None:
            first = time.perf_counter() - started
        out += chunk
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return first, time.perf_counter() - started, os.waitstatus_to_exitcode(status), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    failed = False
    firsts, totals, torch_s = [], [], []
    for _ in range(args.runs):
        first, total, code, out = through_a_terminal([sys.executable, "-m", "ddparity", "check", "--demo"])
        if code != 0 or first is None or STARTING not in out[:200] or b"3 of 3 cases equivalent" not in out:
            print(f"FAILED run: exit {code}, first bytes {out[:120]!r}", file=sys.stderr)
            failed = True
            continue
        firsts.append(first)
        totals.append(total)
        _, alone, code, _ = through_a_terminal([sys.executable, "-c", "import torch"])
        if code != 0:
            print("FAILED: import torch", file=sys.stderr)
            failed = True
            continue
        torch_s.append(alone)
    if firsts and torch_s:
        first, total, imp = statistics.median(firsts), statistics.median(totals), statistics.median(torch_s)
        print(f"ddparity check --demo on a terminal, {args.runs} runs (median):")
        print(f"  first output      {first:6.2f} s")
        print(f"  import torch alone{imp:6.2f} s   (first output / import torch: {first / imp:.2f}x)")
        print(f"  whole demo        {total:6.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
