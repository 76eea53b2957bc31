"""The README's "Your own model and training loop" example runs as written: as a script
and through the CLI, passing with its dropout compared."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_newer_torch

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    return text[start: text.index("\n## ", start + 1)]


def test_your_own_training_loop_example_runs_as_written(tmp_path):
    section = _section("Your own model and training loop")
    [script] = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.startswith("# my_training.py")]
    (tmp_path / "my_training.py").write_text(script)
    run = subprocess.run([sys.executable, "my_training.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: 4 of 4 runs equivalent to the reference" in run.stdout
    assert "random draws compared on" in run.stdout
    cli = subprocess.run([sys.executable, "-m", "ddparity.cli", "check", "my_training.py:case", "--world-sizes", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout + cli.stderr


@needs_newer_torch
def test_the_cluster_sections_torchrun_line_runs_as_written(tmp_path):
    section = _section("On a cluster (`torchrun`, `srun`)")
    [line] = [ln for ln in section.splitlines() if ln.startswith("$ torchrun --standalone")]
    args = shlex.split(line[2:])
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # torchrun leaves its log folders in $TMPDIR
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stdout + run.stderr  # the bug it shows is found
    shown = section.split(line, 1)[1].split("```", 1)[0]
    for kept in [ln for ln in shown.splitlines() if ln.strip() and "..." not in ln and "seconds" not in ln
                 and "tolerance 0" not in ln
                 and not re.search(r"\d+\.\d\d\s*$", ln)]:
        assert kept.strip() in run.stdout, kept
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["pass", "diverged"]


def test_the_readme_fits_in_300_lines():
    """What it is, the two set-up commands, your model and step, pytest, CLI, torchrun and
    the API; the rest is in docs/."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
