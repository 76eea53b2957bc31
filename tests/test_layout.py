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
LEAVES = ("ddparity.errors", "ddparity.settings", "ddparity.compile_spec", "ddparity.case", "ddparity.distances", "ddparity.records", "ddparity.frames",
          "ddparity.measurements", "ddparity.verdicts", "ddparity.run_kinds",
          "ddparity.parsing")
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


HARNESS_ROOMS = ("recording", "world", "ranks", "health", "launch")
"""``harness/``'s folders by process role; its files directly inside (what all three
share) count as one room."""
LAYERS = (
    LEAVES,
    ("ddparity.harness", "ddparity.checks", "ddparity.fixtures"),
    ("ddparity.render", "ddparity.report", "ddparity.plot"),
    ("ddparity.verbs",),
    ("ddparity.cli", "ddparity.cli_parser", "ddparity.cli_progress", "ddparity.pytest_plugin", "ddparity.strategies",
     "ddparity.__main__", "ddparity"),
)
"""From the bottom up: a module imports from its own layer or below, never above (value
types flow down, verdicts flow up)."""
HARNESS_LAYERS = ("ddparity.harness", "ddparity.harness.recording",
                  ("ddparity.harness.ranks", "ddparity.harness.health"), "ddparity.harness.world",
                  "ddparity.harness.launch")
"""Inside the harness, from the bottom up: what all share, the recorders (installed in
every process that trains), the rank side (training; health's probes beside it, neither
importing the other), the controller (which starts ranks), the launch
(whose processes are ranks and watch each other)."""
MAX_ROOM_SHARE = 0.30


def room(module: str) -> str:
    """The room a module lives in: a folder (``harness``'s role folders each one, its files
    directly inside together one), or a top-level module alone."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "harness" and parts[2] in HARNESS_ROOMS:
        return f"harness/{parts[2]}"
    if len(parts) > 2 or (len(parts) == 2 and MODULES.get(module, PACKAGE).name == "__init__.py"):
        return parts[1]
    return module


def layer(module: str, layers: tuple[tuple[str, ...], ...] | tuple[str, ...]) -> int:
    """The index of the innermost (longest) room prefix of ``module`` in ``layers``."""
    best, found = -1, -1
    for i, rooms in enumerate(layers):
        for r in (rooms,) if isinstance(rooms, str) else rooms:
            if within(module, (r,)) and len(r) > best:
                best, found = len(r), i
    assert found >= 0, f"{module} is in no layer of the layout test; place it"
    return found


def room_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for target in ddparity_imports(path):
            a, b = room(name), room(target)
            if a != b and b != "ddparity":
                edges.setdefault(a, set()).add(b)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of any length in a graph (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_room_imports_a_room_that_imports_it_back():
    """No circle of any length between rooms, top-level modules included."""
    edges = room_graph()
    assert not circles(edges), f"rooms that import each other, round a circle: {circles(edges)}"
    assert len(edges) >= 10  # the walk finds the rooms


def test_no_module_imports_a_module_that_imports_it_back():
    """Nor between files, lazy imports included (the training loop once imported FSDP's
    no_sync back from the mode that imports the loop)."""
    edges = {name: {m for m in ddparity_imports(path) if m in MODULES and m not in (name, "ddparity")}
             for name, path in MODULES.items()}
    assert not circles(edges), f"modules that import each other, round a circle: {circles(edges)}"
    assert sum(map(len, edges.values())) >= 100  # the walk finds the imports


@pytest.mark.parametrize("name", [m for m in MODULES if m != "ddparity"])
def test_no_arrow_runs_back_up(name):
    mine = layer(name, LAYERS)
    up = sorted(m for m in ddparity_imports(MODULES[name]) if m != "ddparity" and layer(m, LAYERS) > mine)
    assert not up, f"{name} (layer {mine} of {LAYERS[mine]}) imports from above it: {up}"
    if within(name, ("ddparity.harness",)):
        mine = layer(name, HARNESS_LAYERS)
        up = sorted(m for m in ddparity_imports(MODULES[name])
                    if within(m, ("ddparity.harness",)) and layer(m, HARNESS_LAYERS) > mine)
        assert not up, f"{name} ({HARNESS_LAYERS[mine]}) imports a harness room above it: {up}"


def test_the_rooms_side_by_side_import_nothing_of_each_other():
    """Rooms on one harness layer (the training ranks, health's probes) stay apart."""
    for rooms in (r for r in HARNESS_LAYERS if isinstance(r, tuple)):
        for name in (m for m in MODULES if within(m, rooms)):
            mine = next(r for r in rooms if within(name, (r,)))
            beside = sorted(m for m in ddparity_imports(MODULES[name]) if within(m, tuple(r for r in rooms if r != mine)))
            assert not beside, f"{name} imports {beside}, a room beside it on its layer"


def test_no_room_holds_more_than_a_share_of_the_package():
    """Of the package's own code: the fixtures (models written to be checked) count for no room."""
    lines: dict[str, int] = {}
    for name, path in MODULES.items():
        if not within(name, ("ddparity.fixtures",)):
            lines[room(name)] = lines.get(room(name), 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    big = {r: f"{n / total:.0%}" for r, n in lines.items() if n > MAX_ROOM_SHARE * total}
    assert not big, f"rooms over {MAX_ROOM_SHARE:.0%} of the package's own {total} lines: {big}; split them by role"
    assert {"harness", "harness/recording", "harness/world", "harness/ranks", "harness/launch", "checks",
            "verbs"} <= set(lines)


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


def mode_literal_comparisons(tree: ast.AST) -> list[int]:
    """Lines where a mode's name (a literal) is compared (``==``, ``!=``, ``in``) with
    anything, or a container of mode names is tested for membership."""
    from ddparity.run_kinds import MODES

    def names_a_mode(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in MODES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_a_mode(e) for e in node.elts)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            and any(names_a_mode(side) for side in (node.left, *node.comparators))]


def test_modes_are_told_apart_by_their_row_not_their_name():
    """What differs between modes is a field of its row in ``ddparity.run_kinds``: a new
    mode is a row there (and a mode file), not a hunt for every ``mode == "hsdp"``."""
    found = {name: lines for name, path in MODULES.items() if not name.startswith("ddparity.fixtures")
             and name != "ddparity.run_kinds" and (lines := mode_literal_comparisons(ast.parse(path.read_text())))}
    assert found == {}, f"compare a mode's row, not its name (kind(mode).sharded, asked(modes, 'mesh')): {found}"
    planted = ast.parse('a = run.mode == "hsdp"\nb = "dp" in opts.modes\nc = m not in ("fsdp", "x")\nd = m == "x"\n')
    assert sorted(mode_literal_comparisons(planted)) == [1, 2, 3]  # each way of writing it; not another name


def test_the_architecture_map_names_every_module():
    """docs/architecture.md's map, one line per file: a module missing there is a room a
    newcomer cannot find (eight were, before this test)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" or p.parent == PACKAGE
                     if f"`{p.relative_to(PACKAGE)}`" not in text)
    assert missing == [], f"add a line for each to the map in docs/architecture.md: {missing}"


STORE_OPS = {"set", "get", "add", "check", "multi_get", "multi_set", "compare_set", "delete_key", "append", "wait"}


def spelled_store_keys(tree: ast.AST) -> list[int]:
    """Lines where a store is called with a key spelled out (a string or an f-string, alone
    or in a list) rather than named by ``ddparity.harness.store_keys``."""
    def spelled(node: ast.AST) -> bool:
        if isinstance(node, (ast.Constant, ast.JoinedStr)):
            return isinstance(node, ast.JoinedStr) or isinstance(node.value, str)
        return isinstance(node, (ast.List, ast.Tuple)) and any(spelled(e) for e in node.elts)

    def a_store(node: ast.AST) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        return "store" in name.lower()

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_OPS and a_store(node.func.value)
            and node.args and spelled(node.args[0])]


def test_a_launchs_store_keys_are_named_in_one_module():
    """Every key of a launch's store is named by ``harness/store_keys.py`` (the side
    channel spells its own per-task records, under their prefix)."""
    owners = ("ddparity.harness.store_keys", "ddparity.harness.sidechannel")
    found = {name: lines for name, path in MODULES.items() if name not in owners
             and (lines := spelled_store_keys(ast.parse(path.read_text())))}
    assert found == {}, f"name these keys in ddparity/harness/store_keys.py: {found}"
    planted = ast.parse('store.set("go", "1")\nself.store.check([f"R{s}/{r}"])\nstore.add(keys.NEWS, 1)\n')
    assert spelled_store_keys(planted) == [1, 2]
