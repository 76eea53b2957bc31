"""The pytest plugin: parity checks as ordinary tests (auto-loaded via ``pytest11``).

An adapter over the library: markers, options and fixtures map onto :func:`ddparity.check`
and :class:`ddparity.World`. Importing it imports neither torch nor the harness; a session
without ddparity tests pays nothing.

Settings are resolved once per session, per setting, in this order (first wins):
command-line option, environment variable (``DDPARITY_WORLD_SIZES``, ``DDPARITY_BACKEND``,
``DDPARITY_TIMEOUT``, ``DDPARITY_REPORT``, ``DDPARITY_MAX_RANKS``), ini setting
(``ddparity_world_sizes`` ...), default. ``@pytest.mark.world_size(2, 4)`` lays the test's
own world sizes over them.

Each process (each xdist worker) keeps its own warm worlds; together they keep at most
``max(8, 2 x CPUs)`` idle rank processes alive (``--ddparity-max-ranks`` per process),
closing the least recently used world to make room.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import pytest

from ddparity import parsing, settings
from ddparity.errors import UsageError
from ddparity.render import module_line
from ddparity.run_kinds import kind


@dataclass(frozen=True, kw_only=True, slots=True)
class PluginSettings:
    """The session's ddparity settings, each with where it came from (for errors)."""

    world_sizes: tuple[int, ...] = settings.PLUGIN_WORLD_SIZES
    backend: str = "auto"
    timeout: float = settings.TIMEOUT_S
    report: str | None = None
    max_ranks: int | None = None
    """Live rank processes per pytest process; None: the machine's share (see module doc)."""

    @classmethod
    def from_config(cls, config: pytest.Config) -> PluginSettings:
        def pick(name: str) -> tuple[str | None, str]:
            option = config.getoption(f"ddparity_{name}", None)
            if option not in (None, ""):
                return str(option), f"--ddparity-{name.replace('_', '-')}"
            env = os.environ.get(f"DDPARITY_{name.upper()}")
            if env:
                return env, f"${'DDPARITY_' + name.upper()}"
            ini = config.getini(f"ddparity_{name}")
            if ini:
                return str(ini), f"ini ddparity_{name}"
            return None, "default"

        parsers = {
            "world_sizes": parsing.parse_world_sizes,
            "backend": lambda text, where: settings.validate_backend(text, where),
            "timeout": parsing.parse_timeout,
            "report": lambda text, where: text,
            "max_ranks": parsing.parse_max_ranks,
        }
        values: dict[str, Any] = {}
        for name, parse in parsers.items():
            text, source = pick(name)
            if text is not None:
                try:
                    values[name] = parse(text, source)
                except UsageError as exc:
                    raise pytest.UsageError(str(exc)) from None
        return cls(**values)


SETTINGS = pytest.StashKey[PluginSettings]()
RUNS = pytest.StashKey[list]()  # JSON runs of every check in this process's session


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddparity", "data-parallel parity checks")
    group.addoption("--ddparity-world-sizes", dest="ddparity_world_sizes", metavar="N,N",
                    help="world sizes for @pytest.mark.world_size without arguments and for the "
                         "parity fixture in unmarked tests (default 2)")
    group.addoption("--ddparity-backend", dest="ddparity_backend", metavar="NAME",
                    help="auto | gloo | nccl | threaded (default auto)")
    group.addoption("--ddparity-timeout", dest="ddparity_timeout", metavar="SECONDS",
                    help=f"{settings.TIMEOUT_HELP} (default {settings.TIMEOUT_S:g})")
    group.addoption("--ddparity-report", dest="ddparity_report", metavar="PATH",
                    help="write the JSON report of every check in the session here")
    group.addoption("--ddparity-max-ranks", dest="ddparity_max_ranks", metavar="N",
                    help="rank processes this pytest process keeps alive between tests; idle worlds "
                         "beyond are closed, least recently used first (default: max(8, 2 x CPUs) "
                         "shared by the xdist workers)")
    parser.addini("ddparity_world_sizes", "default world sizes, e.g. 2,4")
    parser.addini("ddparity_backend", "auto | gloo | nccl | threaded")
    parser.addini("ddparity_timeout", settings.TIMEOUT_HELP)
    parser.addini("ddparity_report", "path of the session's JSON report")
    parser.addini("ddparity_max_ranks", "rank processes one pytest process keeps alive between tests")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(*sizes): run the test once per world size (ids ws2, ws4); without arguments, "
        "the --ddparity-world-sizes setting",
    )
    config.addinivalue_line(
        "markers",
        "ddparity_timeout(seconds): this test's timeout for the world and parity fixtures (default "
        "--ddparity-timeout)",
    )
    config.stash[SETTINGS] = PluginSettings.from_config(config)
    config.stash[RUNS] = []
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistReport(config), "ddparity-xdist")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return
    if marker.args:
        where = f"@pytest.mark.world_size on {metafunc.definition.nodeid}"
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in marker.args):
            raise pytest.UsageError(f"{where}: world sizes must be integers >= 1, got {marker.args!r}")
        sizes = tuple(marker.args)
    else:
        sizes = metafunc.config.stash[SETTINGS].world_sizes
    if "world_size" not in metafunc.fixturenames:
        metafunc.fixturenames.append("world_size")
    metafunc.parametrize("world_size", sizes, ids=[f"ws{s}" for s in sizes], indirect=True)


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """This test's world size (from ``@pytest.mark.world_size``), else the first of the
    session's world sizes."""
    if hasattr(request, "param"):
        return int(request.param)
    return request.config.stash[SETTINGS].world_sizes[0]


@pytest.fixture(scope="session")
def ddparity_pool(request: pytest.FixtureRequest) -> Any:
    """The session's warm worlds (one pool per process; under xdist, per worker)."""
    from ddparity.harness.world.pool import WorldPool

    max_ranks = request.config.stash[SETTINGS].max_ranks
    if max_ranks is None:
        max_ranks = settings.default_max_ranks(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    pool = WorldPool(max_ranks=max_ranks)
    request.addfinalizer(pool.close)
    return pool


def _timeout(request: pytest.FixtureRequest) -> float:
    """The test's ``@pytest.mark.ddparity_timeout(SECONDS)``, else the session's setting."""
    marker = request.node.get_closest_marker("ddparity_timeout")
    if marker is None:
        return request.config.stash[SETTINGS].timeout
    if len(marker.args) != 1 or marker.kwargs:
        raise pytest.UsageError(f"{request.node.nodeid}: use @pytest.mark.ddparity_timeout(SECONDS)")
    try:
        return settings.validate_timeout(marker.args[0], "@pytest.mark.ddparity_timeout")
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


class _TimedWorld:
    """The pool's World, with the test's timeout as every task's default (a task that hangs
    fails its test at ``--ddparity-timeout``, not at the World's own 300 s)."""

    def __init__(self, world: Any, timeout: float) -> None:
        self._world, self._timeout = world, timeout

    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._world.run(fn, *args, timeout=self._timeout if timeout is None else timeout, **kwargs)

    def execute(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._world.execute(fn, *args, timeout=self._timeout if timeout is None else timeout, **kwargs)

    def submit(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._world.submit(fn, *args, timeout=self._timeout if timeout is None else timeout, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._world, name)

    def __repr__(self) -> str:
        return f"{self._world!r} (task timeout {self._timeout:g} s)"


@pytest.fixture
def world(request: pytest.FixtureRequest, world_size: int, ddparity_pool: Any) -> Any:
    """A warm :class:`ddparity.World` of the test's world size, shared across tests; a
    world whose ranks died or hung is rebuilt before the next task. Tasks time out at the
    session's ``--ddparity-timeout`` (or the test's ``@pytest.mark.ddparity_timeout``)."""
    session = request.config.stash[SETTINGS]
    from ddparity.verbs.plan import choose_backend

    try:
        backend = choose_backend(session.backend, (world_size,))
        return _TimedWorld(ddparity_pool.get(world_size, backend), _timeout(request))
    except UsageError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def parity(request: pytest.FixtureRequest, ddparity_pool: Any) -> Any:
    """``parity(case, modes=("single", "ddp"), **check_options)``: run :func:`ddparity.check`
    at this test's world size (or the session's world sizes in an unmarked test) and
    fail the test with the readable report if any run is not equivalent."""
    settings = request.config.stash[SETTINGS]
    marked = request.node.get_closest_marker("world_size") is not None
    sizes = (request.getfixturevalue("world_size"),) if marked else settings.world_sizes

    def run(case: Any, modes: tuple[str, ...] | list[str] = ("single", "ddp"), **options: Any) -> Any:
        from ddparity.verbs.check import check
        from ddparity.verbs.plan import choose_backend

        options.setdefault("backend", settings.backend)
        options.setdefault("timeout", _timeout(request))
        options.setdefault("world_sizes", sizes)
        try:
            choose_backend(options["backend"], tuple(options["world_sizes"]))
        except UsageError as exc:  # this machine cannot run the backend (e.g. nccl, no GPU)
            pytest.skip(f"ddparity: {exc}")
        if getattr(case, "name", "?") is None:  # name the report after the test
            case = dataclasses.replace(case, name=request.node.name)
        try:
            report = check(case, modes=modes, pool=ddparity_pool, **options)
        except UsageError as exc:
            pytest.fail(f"ddparity: {exc}", pytrace=False)
        _record(request, report)
        if not report.ok:
            pytest.fail(_failure_text(request, report), pytrace=False)
        compared = [r for r in report.runs if not kind(r.mode).reference or r.compile]
        if compared and all(r.status == "skipped" for r in compared):
            # nothing was compared here (e.g. nccl with fewer GPUs than the world size)
            pytest.skip("ddparity: " + "; ".join(sorted({f"{r.name} ws{r.world_size}: {r.reason}" for r in compared})))
        return report

    return run


def _record(request: pytest.FixtureRequest, report: Any) -> None:
    """Every run into the session report; the ddp runs' verdicts as JUnit properties."""
    runs = request.config.stash[RUNS]
    for run in report.runs:
        runs.append(dict(run.to_json(), case=report.case, test=request.node.nodeid))
    props = request.node.user_properties
    for run in report.runs:
        if kind(run.mode).reference and not run.compile:
            continue
        tag = f"ddparity[{run.name} ws{run.world_size}]"
        props.append((f"{tag} status", run.status))
        props.append((f"{tag} world_size", run.world_size))
        if run.first_divergence is not None:
            d = run.first_divergence
            props.append((f"{tag} first_divergence", d.where))
            if d.module is not None:
                props.append((f"{tag} first_divergence module", module_line(d.module)))
        if run.desync is not None:
            props.append((f"{tag} desync", f"step {run.desync.step} ranks {run.desync.ranks}"))
        if run.hang is not None:
            props.append((f"{tag} hang suspects", str(run.hang.suspect_ranks)))
        if run.crash is not None:
            props.append((f"{tag} crash", f"rank {run.crash.rank}: {run.crash.error}"))


def _failure_text(request: pytest.FixtureRequest, report: Any) -> str:
    settings = request.config.stash[SETTINGS]
    rerun = f"pytest {request.node.nodeid!r} --ddparity-backend {settings.backend} --ddparity-timeout {settings.timeout:g}"
    return f"{report.render()}\nreproduce: {rerun}"


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    runs = config.stash.get(RUNS, [])
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the runs to the controller
        workeroutput["ddparity_runs"] = json.dumps(runs)
        return
    path = config.stash[SETTINGS].report if SETTINGS in config.stash else None
    if path:
        write_report(path, runs)


def write_report(path: str, runs: list[dict[str, Any]]) -> None:
    from ddparity.verdicts import FAILING

    data = {"version": 1, "ok": all(r["status"] not in FAILING for r in runs),
            "case": "pytest session", "runs": runs}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


class _XdistReport:
    """On the xdist controller: gathers each worker's runs as the worker finishes."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        text = getattr(node, "workeroutput", {}).get("ddparity_runs")
        if text:
            self.config.stash[RUNS].extend(json.loads(text))
