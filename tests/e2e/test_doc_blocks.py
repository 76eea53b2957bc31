"""Every code block of the README and of docs/ runs as written: a Python block pasted into a
file, run as a script, or (a block that defines tests) under pytest with the plugin, whose
summary must be the one the text shows next; a ``$ ddparity ...`` transcript run beside the
README's my_cases.py, with the exit code and the lines it shows. A block that is
deliberately not run says so and why in a ``<!-- block: ... -->`` line just above it (the
set-up's shell lines are .ci/run's; multi-node launches need the nodes). The README's blocks
run in the default suite; those of docs/ with ``--docs`` (.ci/run runs them)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- block: (?P<note>[^>]*?) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)
SUMMARY = re.compile(r"^(?:=+ )?((?:\d+ (?:failed|passed|skipped)(?:, )?)+) in [\d.]+s", re.M)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _blocks() -> list:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            name = f"{doc.relative_to(ROOT)}:{line}"
            note = m.group("note")
            marks = [pytest.mark.skip(reason=f"deliberately not run here: {note}")] if note else []
            if m.group("lang") == "bash" and not note:
                marks = [pytest.mark.skip(reason="a shell block without a note")]  # fails the next test
            found.append(pytest.param(m.group("code"), text[m.end():], id=name, marks=[*marks, *_sweep(doc)]))
    return found


def _sweep(doc: Path) -> list:
    """docs/ pages' blocks run with --docs (.ci/run does); the README's always."""
    return [] if doc == ROOT / "README.md" else [pytest.mark.docs]


@pytest.mark.parametrize("code, after", _blocks())
def test_the_block_runs_as_written(code, after, tmp_path):
    if "def test_" in code:  # a test module: pytest with the plugin, as a user runs it
        (tmp_path / "test_block.py").write_text(code)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_block.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        shown = SUMMARY.search(after.split("```python")[0])  # the outcome the text shows next, if any
        got = SUMMARY.search(run.stdout)
        assert got is not None, run.stdout + run.stderr
        if shown is not None:
            assert got.group(1) == shown.group(1), run.stdout + run.stderr
        else:
            assert run.returncode == 0, run.stdout + run.stderr
    else:
        (tmp_path / "block.py").write_text(code)
        run = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_every_shell_block_is_run_elsewhere_and_says_where():
    for doc in DOCS:
        for m in FENCE.finditer(doc.read_text()):
            if m.group("lang") == "bash":
                assert m.group("note"), f"{doc.name}: a bash block without a <!-- block: ... --> note"


TRANSCRIPT = re.compile(r"```\n\$ (?P<command>ddparity [^\n\\]*?)(?:\s+#[^\n]*)?\n(?P<shown>.*?)```", re.S)


def _transcripts() -> list:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in TRANSCRIPT.finditer(text):
            line = text.count("\n", 0, m.start())
            found.append(pytest.param(m.group("command"), m.group("shown"), id=f"{doc.relative_to(ROOT)}:{line}",
                                      marks=_sweep(doc)))
    return found


def _my_cases() -> str:
    [code] = [m.group("code") for m in FENCE.finditer(README.read_text()) if m.group("code").startswith("# my_cases.py")]
    return code


README = ROOT / "README.md"


MEASURED = [
    (re.compile(r"0x[0-9a-f]+"), "#"),  # addresses
    (re.compile(r"(\.py:|line |Thread |pid )\d+"), r"\1#"),  # source lines, thread and process ids
    (re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?(?= ?(%|s\b|ms\b|us\b|GB/s|MB\b|GFLOP/s))"), "#"),  # timings, rates
    (re.compile(r"(?<![\w.])\d*\.\d+(e[-+]?\d+)?|\d+e[-+]?\d+"), "#"),  # errors, tolerances, figures
    (re.compile(r"((?:error|abs|x)\s?)\d+\b"), r"\1#"),  # an error that happens to be whole
    (re.compile(r"#(?:[-.]#)+"), "#"),  # a range (164.6-166.8) or a version tail
    (re.compile(r"-{2,}"), "-"),  # a table's rule, as wide as its widest figure
    (re.compile(r"\s+"), " "),  # a table's padding, likewise
]


NATIVE_FRAME = re.compile(r"\(lib[^()]*\.so[^()]*\)\s*$|^\s*0x[0-9a-f]+ \(")
"""A native frame of py-spy's stack (``pthread_cond_wait (libc.so.6)``): py-spy samples
them when it can, and on a loaded machine falls back to the Python frames alone."""

SHOWN_HOST = "vm"
"""The name of the machine the transcripts were taken on (health's rank table shows it)."""


def normalised(text: str) -> str:
    """``text`` with what a run measures (timings, errors, rates, ids, addresses) as ``#``
    and its spacing collapsed; what it decides (ranks, steps, world sizes, verdicts,
    shapes, counts) kept as shown."""
    for pattern, into in MEASURED:
        text = pattern.sub(into, text)
    return text.strip()


def test_normalised_keeps_decisions_and_drops_measurements():
    shown = "    grad   2.weight  step 0  rank 1  abs 3.42  x6.41e+04"
    assert normalised(shown) == normalised("grad 2.weight step 0 rank 1  abs 91  x7e+04") == \
        "grad 2.weight step 0 rank 1 abs # x#"
    assert normalised(shown) != normalised(shown.replace("rank 1", "rank 0"))
    assert normalised("  speed  PASS  matmul 164.6-166.8 GFLOP/s (median 165.7)") == \
        "speed PASS matmul # GFLOP/s (median #)"
    assert normalised("all_reduce(tensor=float32[1732]) at ddparity/harness/modes/ddp.py:63 in step") == \
        "all_reduce(tensor=float32[1732]) at ddparity/harness/modes/ddp.py:# in step"
    assert normalised("ddp     64     threaded (simulated)  pass    5.56") == "ddp 64 threaded (simulated) pass #"


@pytest.mark.parametrize("command, shown", _transcripts())
def test_each_shown_command_runs_and_prints_what_is_shown(command, shown, tmp_path):
    """A ``$ ddparity ...`` transcript: the command runs as written (beside the README's
    my_cases.py) with the exit code of the verdict it shows, and every line shown is in its
    output once both are :func:`normalised` (timings, errors, ids vary from run to run);
    a ``...`` line stands for lines left out."""
    import shlex

    (tmp_path / "my_cases.py").write_text(_my_cases())
    run = subprocess.run([sys.executable, "-m", "ddparity", *shlex.split(command)[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    failed = re.search(r"^(FAILED|UNHEALTHY):", shown, re.M)
    expected = (3 if "HANG" in shown or "CRASH" in shown else 1) if failed else 0
    assert run.returncode == expected, out
    out = re.sub(rf"\b{re.escape(socket.gethostname())}\b", SHOWN_HOST, out)
    got = {normalised(line) for line in out.splitlines()}
    shown = shown.split("\n$ ", 1)[0]  # a second command in the block (a multi-node launch) is not run here
    missing = [line for line in shown.splitlines() if line.strip() and line.strip() != "..."
               and not NATIVE_FRAME.search(line) and normalised(line) not in got]
    assert not missing, "\n".join(["shown but not printed (normalised):", *missing, "printed:", out])
