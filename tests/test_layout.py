"""The rooms of the package, as ARCHITECTURE.md draws them, read from the source: what
judges imports nothing that runs, the rank side imports nothing that judges or reports,
the value types are leaves, no folder imports a folder that imports it back, no private
helper is imported across modules, and no module grows past ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddparity"
MAX_LINES = 400
LEAVES = ("ddparity.errors", "ddparity.settings", "ddparity.case", "ddparity.trace", "ddparity.records", "ddparity.frames",
          "ddparity.measurements", "ddparity.verdicts")
"""Value types: they import nothing from ddparity but each other."""
JUDGING_OR_REPORTING = ("ddparity.checks", "ddparity.verbs", "ddparity.report", "ddparity.render",
                        "ddparity.cli", "ddparity.pytest_plugin", "ddparity.plot")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def ddparity_imports(path: Path) -> set[str]:
    out = set()
    for module, names in imports(path):
        if not module.startswith("ddparity"):
            continue
        out.add(module)
        out.update(f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES)  # from pkg import submodule
    return out


def within(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("ddparity.checks")])
def test_checks_import_nothing_from_the_harness(name):
    bad = sorted(m for m in ddparity_imports(MODULES[name]) if within(m, ("ddparity.harness",)))
    assert not bad, f"{name} judges; it must not import what runs: {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("ddparity.harness")])
def test_the_harness_imports_nothing_that_judges_or_reports(name):
    bad = sorted(m for m in ddparity_imports(MODULES[name]) if within(m, JUDGING_OR_REPORTING))
    assert not bad, f"{name} runs (much of it inside ranks); it must not import {bad}"


@pytest.mark.parametrize("name", [m for m in LEAVES if m in MODULES])
def test_value_types_are_leaves(name):
    bad = sorted(m for m in ddparity_imports(MODULES[name]) if not within(m, LEAVES))
    assert not bad, f"{name} is a value type; it may import only other value types, not {bad}"


def test_no_folder_imports_a_folder_that_imports_it_back():
    def folder(module: str) -> str:
        parts = module.split(".")
        if len(parts) > 2 or (len(parts) == 2 and MODULES.get(module, PACKAGE).name == "__init__.py"):
            return parts[1]
        return "top"

    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        here = folder(name)
        for target in ddparity_imports(path):
            there = folder(target)
            if here != "top" and there != "top" and here != there:
                edges.setdefault(here, set()).add(there)
    cycles = sorted((a, b) for a, targets in edges.items() for b in targets if a in edges.get(b, set()))
    assert not cycles, f"folders that import each other: {cycles} (edges {edges})"


@pytest.mark.parametrize("name", list(MODULES))
def test_no_private_helper_is_imported_across_modules(name):
    bad = [f"{module}.{n}" for module, names in imports(MODULES[name]) if module.startswith("ddparity")
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, f"{name} imports private names of other modules: {bad}; make them public or move them"


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_stay_readable_in_one_sitting(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept (limit ~{MAX_LINES})"


def test_the_layout_is_what_it_claims():
    assert "ddparity.checks.ledger" not in MODULES  # split into records, harness.recorder, checks.collectives
    assert {"ddparity.verbs.check", "ddparity.verbs.profile", "ddparity.verbs.health",
            "ddparity.verbs.plan", "ddparity.settings", "ddparity.records"} <= set(MODULES)


def test_every_phase_a_rank_sets_is_ordered():
    """``records.PHASES`` orders the phases to tell who is behind in a hang: a phase set
    in code but missing there ranked as behind everything (a comparing rank named the hang
    suspect instead of one in forward)."""
    from ddparity.records import PHASES

    set_in_code = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_phase" \
                    and len(node.args) == 2:
                phase = node.args[1]
                assert isinstance(phase, ast.Constant), f"{name}:{node.lineno}: a phase must be a literal"
                set_in_code[phase.value] = f"{name}:{node.lineno}"
    assert len(set_in_code) >= 10, set_in_code  # the walk finds them
    assert {p: where for p, where in set_in_code.items() if p not in PHASES} == {}
    from ddparity.records import Position

    assert Position(1, "compare").order() > Position(1, "optimizer").order() > Position(1, "forward").order()
