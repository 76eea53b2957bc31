"""Every default, choice list and limit, and the one validator per setting that the API,
the CLI and the pytest plugin share.

Each validator takes the value and ``where`` it came from (``--timeout``,
``$DDPARITY_TIMEOUT``, ``check()``) and raises :class:`UsageError` as
``"{where}: {problem}, got {value!r}"`` (pytest-timeout's ``_validate_timeout(value,
where)``). ``validate_*`` check values given to the Python API; text (the CLI, environment
variables, ini files) is read by :mod:`ddparity.parsing`'s ``parse_*`` into the same values.

A leaf module: it imports nothing from the harness, and not torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from ddparity.errors import UsageError
from ddparity.run_kinds import MODES

# -- choices -----------------------------------------------------------------------------

HSDP_SHARD = 2
"""Mode hsdp's shard size S when neither the Case nor ``--hsdp-shard`` says."""

WORLD_BACKENDS = ("auto", "gloo", "nccl")
"""Backends of real rank processes (worlds, profile, health, torchrun)."""

CHECK_BACKENDS = (*WORLD_BACKENDS, "threaded")
"""``check`` also simulates ranks as threads in one process (``threaded``)."""

# -- defaults ----------------------------------------------------------------------------

NEWER_TORCH = (2, 13)
"""The oldest torch that torchrun launches (``check``/``profile``) and the threaded backend
are tested on. On torch 2.4.1 (the oldest the project installs on) a mismatched collective
under torchrun was a crash of the wrong rank (gloo's abort took torchrun's agent and its
store with it), and one clean model crashed at simulated world size 8 (SIGABRT): there they
are refused with a message, not run."""


def torch_release() -> tuple[int, ...]:
    """This torch's (major, minor)."""
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2] if part.isdigit())


def needs_newer_torch(what: str, instead: str) -> None:
    """A UsageError naming ``what`` and the fix where this torch is older than
    :data:`NEWER_TORCH`."""
    import torch

    release = torch_release()
    if release and release < NEWER_TORCH:
        raise UsageError(f"{what} needs torch >= {NEWER_TORCH[0]}.{NEWER_TORCH[1]} (this is {torch.__version__}: "
                         f"on older torch it was found to give wrong verdicts); upgrade torch, or {instead}")


TIMEOUT_S = 60.0
"""Seconds without progress (a step, a phase, a collective) before a run counts as a hang."""

TIMEOUT_HELP = "seconds without progress before a run counts as a hang"

DEMO_FAULTS_TIMEOUT_S = 5.0
"""``--demo-faults`` injects hangs: a short timeout keeps the tour short."""
WATCH_TIMEOUT_S = 300.0
"""``watch``: how long a rank of a training run may stand still (its Python moves through
a long evaluation without collectives: that is no hang)."""

CHECK_MODES = ("single", "ddp")
CHECK_WORLD_SIZES = (1, 2, 4)
PROFILE_WORLD_SIZES = (1, 2, 4, 8)
PROFILE_MODES = ("ddp",)
"""What ``profile`` times unless ``--modes`` says otherwise."""
PROFILE_STEPS = 10
"""Measured iterations per world size."""
PROFILE_WARMUP = 2
"""Iterations run first and not measured."""
PLUGIN_WORLD_SIZES = (2,)
"""World sizes of ``@pytest.mark.world_size`` without arguments and unmarked ``parity`` tests."""

WORLD_TIMEOUT_S = 300.0
"""A :class:`ddparity.World`'s task timeout when none is given."""
WORLD_START_TIMEOUT_S = 60.0
"""How long a World's ranks may take to start and join their process group."""
PG_TIMEOUT_MARGIN_S = 60.0
"""torch's own process-group timeout sits this far beyond the World's, so that ddparity's
watchdog, with its stacks, always fires first."""

HEALTH_CPU_RANKS = 2
"""Local ``health`` ranks on a machine without GPUs."""
HEALTH_SIZES_MIB = (1, 8, 32)
"""All-reduce message sizes ``health`` measures bandwidth at."""
HEALTH_LONG_SIZES_MIB = (1, 8, 32, 256)
"""The same with ``--long`` (a larger message: a link's sustained bandwidth)."""
HEALTH_LONG_S = 60.0
"""Seconds of ``--long``'s stress pass by default."""
DEMO_FAULTS_WORLD_SIZES = (2,)
"""World sizes of ``--demo-faults`` (a fault fires on rank 1)."""

# -- limits ------------------------------------------------------------------------------

REAL_RANKS_LIMIT = max(4, 2 * (os.cpu_count() or 1))
"""With ``backend="auto"``, CPU world sizes above this run as simulated (threaded) ranks
in ``check``, and are skipped by ``profile``."""


def default_max_ranks(workers: int = 1) -> int:
    """Live rank processes one pool keeps: ``max(8, 2 x CPUs)`` for the machine, shared
    by ``workers`` pools (pytest-xdist workers) so that together they stay within it."""
    return max(1, max(8, 2 * (os.cpu_count() or 1)) // max(1, workers))


# -- validators (values from the API) ----------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_modes(modes: Any, where: str) -> tuple[str, ...]:
    modes = tuple(_sequence(modes, "modes", where, "('single', 'ddp')"))
    if not modes:
        raise UsageError(f"{where}: no modes given; use one or more of: {', '.join(MODES)}")
    for mode in modes:
        if mode not in MODES:
            raise UsageError(f"{where}: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return modes


def validate_world_sizes(sizes: Any, where: str) -> tuple[int, ...]:
    sizes = tuple(_sequence(sizes, "world_sizes", where))
    if not sizes:
        raise UsageError(f"{where}: no world sizes given; use e.g. --world-sizes 1,2,4")
    for ws in sizes:
        validate_world_size(ws, where)
    return sizes


def validate_world_size(ws: Any, where: str) -> int:
    if not _is_int(ws) or ws < 1:
        raise UsageError(f"{where}: world size must be an integer >= 1, got {ws!r}")
    return ws


def validate_backend(backend: Any, where: str, choices: tuple[str, ...] = CHECK_BACKENDS) -> str:
    if backend not in choices:
        raise UsageError(f"{where}: unknown backend {backend!r}; choose from {', '.join(choices)}")
    return str(backend)


MIN_TIMEOUT_S = 1.0
"""Ranks publish that they are computing once a second: a shorter timeout would take a
clean step for a hang."""


def timeout_problem(value: float) -> str | None:
    if not math.isfinite(value):
        return "must be a finite number of seconds (an infinite one would never report a hang)"
    if not value >= MIN_TIMEOUT_S:
        return (f"must be at least {MIN_TIMEOUT_S:g} s (ranks publish their progress every second: a shorter "
                f"timeout takes a clean step for a hang)" if value > 0 else "must be a positive number of seconds")
    return None


def validate_timeout(timeout: Any, where: str) -> float:
    problem = timeout_problem(timeout) if _is_number(timeout) else "must be a positive number of seconds"
    if problem:
        raise UsageError(f"{where}: timeout {problem}, got {timeout!r}")
    return timeout


def tolerance_ok(value: float) -> bool:
    """A relative tolerance compares: finite, >= 0 (0 = bit-exact) and below 1 (1 would pass
    a tensor that is all zeros, or twice its size)."""
    return math.isfinite(value) and 0 <= value < 1


TOLERANCE_HELP = "tolerance must be 'auto' or a relative tolerance 0 <= t < 1 (0 = bit-exact)"


def validate_tolerance(tolerance: Any, where: str) -> str | float:
    if tolerance == "auto":
        return "auto"
    if not _is_number(tolerance) or not tolerance_ok(tolerance):
        raise UsageError(f"{where}: {TOLERANCE_HELP}, got {tolerance!r}")
    return tolerance


def validate_count(value: Any, name: str, where: str, least: int = 1) -> int:
    """An integer setting such as ``steps`` (>= 1) or ``warmup`` (>= 0)."""
    if not _is_int(value) or value < least:
        raise UsageError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
    return value


def validate_max_ranks(value: Any, where: str) -> int | None:
    if value is not None and (not _is_int(value) or value < 1):
        raise UsageError(f"{where}: max_ranks must be an integer >= 1 or None, got {value!r}")
    return value


def validate_min_busbw(value: Any, where: str) -> float | None:
    if value is not None and (not _is_number(value) or not value >= 0):
        raise UsageError(f"{where}: --min-busbw must be a number of GB/s >= 0, got {value!r}")
    return value


def validate_sizes_mib(sizes: Any, where: str) -> tuple[float, ...]:
    sizes = tuple(sizes)
    if not sizes or any(not _is_number(s) or not s > 0 for s in sizes):
        raise UsageError(f"{where}: message sizes must be positive MiB, got {sizes!r}")
    return sizes


# -- resolved settings, one dataclass per concern -----------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckOptions:
    """What ``check`` (and ``profile``) run. Built once from the API, CLI or plugin."""

    modes: tuple[str, ...] = CHECK_MODES
    """single, dp, ddp, fsdp and/or hsdp."""
    world_sizes: tuple[int, ...] = CHECK_WORLD_SIZES
    backend: str = "auto"
    timeout: float = TIMEOUT_S
    tolerance: str | float = "auto"
    """``"auto"`` (calibrated noise floor) or a relative tolerance (0: bit-exact)."""
    steps: int | None = None
    """Overrides the Case's own number of steps."""
    hsdp_shard: int | None = None
    """Overrides the Case's ``hsdp_shard`` (mode hsdp's shard size)."""
    compile: Any = None
    """A :class:`~ddparity.compile_spec.CompileSpec`: each mode also runs compiled."""

    @classmethod
    def validated(cls, where: str, **values: Any) -> CheckOptions:
        """The options, each value checked by its validator; errors name ``where``."""
        out: dict[str, Any] = {}
        if "modes" in values:
            out["modes"] = validate_modes(values["modes"], where)
        if "world_sizes" in values:
            out["world_sizes"] = validate_world_sizes(_sequence(values["world_sizes"], "world_sizes", where), where)
        if "backend" in values:
            out["backend"] = validate_backend(values["backend"], where)
        if "timeout" in values:
            out["timeout"] = validate_timeout(values["timeout"], where)
        if "tolerance" in values:
            out["tolerance"] = validate_tolerance(values["tolerance"], where)
        if values.get("steps") is not None:
            out["steps"] = validate_count(values["steps"], "steps", where)
        if values.get("hsdp_shard") is not None:
            out["hsdp_shard"] = validate_count(values["hsdp_shard"], "hsdp_shard", where)
        if values.get("compile") is not None or values.get("compile_ddp") is not None:
            from ddparity.compile_spec import validate_compile

            if values.get("compile") is not None and torch_release() < NEWER_TORCH:
                raise UsageError(f"{where}: compile is tested on torch >= {NEWER_TORCH[0]}.{NEWER_TORCH[1]} only "
                                 f"(this is {'.'.join(map(str, torch_release()))}); upgrade torch, or check eagerly")
            out["compile"] = validate_compile(values.get("compile"), values.get("compile_ddp"), where)
        return cls(**out)

    def for_case(self, case: Any) -> CheckOptions:
        """These options with mode hsdp's shard size resolved for ``case``, once: the
        option's, else the Case's, else :data:`HSDP_SHARD`."""
        return replace(self, hsdp_shard=self.hsdp_shard or case.hsdp_shard or HSDP_SHARD)

    @property
    def shard(self) -> int:
        """Mode hsdp's shard size, as :meth:`for_case` resolved it."""
        if self.hsdp_shard is None:
            raise RuntimeError("CheckOptions.shard read before the options were resolved for a case (for_case)")
        return self.hsdp_shard


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldSpec:
    """How a world is built. Validated once; errors name the bad value and the fix."""

    world_size: int
    backend: str = "gloo"
    timeout: float = WORLD_TIMEOUT_S
    """Seconds a task may go without progress (see :meth:`ddparity.World.submit`)."""
    start_timeout: float = WORLD_START_TIMEOUT_S
    threads_per_rank: int = 1
    clean_start: bool = False
    """Start the ranks from the forkserver (a process that only imported torch), never
    forked from the controller: for a process that runs many threads of torch work."""
    error_grace: float = 0.5
    """After a rank raised, how long the others may keep running before they are stopped."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables each rank sets before its process group starts (NCCL reads its
    own once, at a process's first communicator: ``NCCL_P2P_DISABLE`` can only reach a fresh
    rank)."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise UsageError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("timeout", "start_timeout", "error_grace"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.threads_per_rank, int) or self.threads_per_rank < 1:
            raise UsageError(f"threads_per_rank must be an int >= 1, got {self.threads_per_rank!r}")
        if not all(isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(v, str) for v in pair)
                   for pair in self.env):
            raise UsageError(f"env must be (name, value) pairs of strings, got {self.env!r}")


def _sequence(value: Any, name: str, where: str, example: str = "(1, 2, 4)") -> Any:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise UsageError(f"{where}: {name} must be a sequence such as {example}, got {value!r}")
    return value


__all__ = [
    "CHECK_BACKENDS",
    "MODES",
    "REAL_RANKS_LIMIT",
    "TIMEOUT_S",
    "WORLD_BACKENDS",
    "CheckOptions",
    "WorldSpec",
    "default_max_ranks",
]
