"""The files a check's route passes through, from the CLI to the verdict, read from a real run.

Runs ``python -m ddparity check --demo --world-sizes 2`` (the controller and every rank
process) with a profile hook installed through ``sitecustomize`` and counts, among
ddparity's own files:

- **route**: the files with a function on the call stack whenever a hand-off is entered
  (the world's ``submit``, a rank's task, the numbers sent back in ``distances.py``, a
  judge in ``checks/``, the text in ``render.py``): the chain of calls from ``cli.main``
  to each verdict, in the controller and in the ranks;
- **ran**: every file with a function that ran (code run at import time not counted);
- **longest chain**: the most files on one call stack at a hand-off (one process's chain of
  calls, where the route is the union of all of them).

Issue 39 asks for the route (goal <= 15 files). To measure another tree (an older commit):
``git worktree add /tmp/old REV`` and ``--tree /tmp/old``. Exits 1 unless the check exits 0
and every process wrote its record.

    python benchmarks/route_of_a_check.py [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = '''
import os, sys, threading
_out, _root = os.environ["ROUTE_OUT"], os.environ["ROUTE_ROOT"]
_seen = set()
_HAND_OFFS = tuple(os.path.join(_root, p) for p in (
    "checks" + os.sep, "distances.py", "render.py",
    os.path.join("harness", "world", "world.py"), os.path.join("harness", "ranks", "tasks.py")))

def _note(kind, rel):
    if (kind, rel) not in _seen:
        _seen.add((kind, rel))
        with open(os.path.join(_out, f"{os.getpid()}.txt"), "a") as fh:
            fh.write(f"{kind} {rel}\\n")

def _profile(frame, event, arg):
    code = frame.f_code
    if event != "call" or not code.co_flags & 1 or not code.co_filename.startswith(_root):
        return  # only functions (CO_OPTIMIZED): not a module's or a class's body
    _note("ran", code.co_filename[len(_root):])
    if code.co_filename.startswith(_HAND_OFFS):
        caller, chain = frame, []
        while caller is not None:
            name = caller.f_code.co_filename
            if name.startswith(_root) and caller.f_code.co_flags & 1:
                _note("route", name[len(_root):])
                if name[len(_root):] not in chain:
                    chain.append(name[len(_root):])
            caller = caller.f_back
        _note("chain", "<".join(chain))

sys.setprofile(_profile)
threading.setprofile(_profile)
'''


def measure(tree: Path) -> dict[str, set[str]]:
    with tempfile.TemporaryDirectory() as hook_dir, tempfile.TemporaryDirectory() as out:
        Path(hook_dir, "sitecustomize.py").write_text(HOOK)
        env = dict(os.environ, ROUTE_OUT=out, ROUTE_ROOT=str(tree / "ddparity") + os.sep,
                   PYTHONPATH=os.pathsep.join([str(tree), hook_dir]))
        run = subprocess.run([sys.executable, "-m", "ddparity", "check", "--demo", "--world-sizes", "2"],
                             env=env, cwd=tree, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            sys.exit(f"the check exited {run.returncode}:\n{run.stdout}\n{run.stderr}")
        found: dict[str, set[str]] = {"route": set(), "ran": set(), "chain": set()}
        records = list(Path(out).glob("*.txt"))
        for record in records:
            for line in record.read_text().splitlines():
                kind, rel = line.split(" ", 1)
                found[kind].add(rel)
        if len(records) < 3:  # the controller, the reference's world and the DDP world's ranks
            sys.exit(f"only {len(records)} processes wrote a record: the hook did not reach the ranks")
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    found = measure(args.tree.resolve())
    for kind in ("route", "ran"):
        files = sorted(found[kind])
        folders = sorted({os.path.dirname(f) or "." for f in files})
        print(f"{kind}: {len(files)} files in {len(folders)} folders ({', '.join(folders)})")
        for f in files:
            print(f"  {f}")
    longest = max(found["chain"], key=lambda c: len(c.split("<")))
    print(f"longest chain: {len(longest.split('<'))} files on one call stack at a hand-off, innermost first")
    print("  " + " < ".join(longest.split("<")))


if __name__ == "__main__":
    main()
