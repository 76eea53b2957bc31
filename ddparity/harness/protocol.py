"""Every message between the controller and a rank process.

Messages are small frozen dataclasses with primitive payloads; anything richer (the task
callable, its result) travels as cloudpickled ``bytes`` so that what crosses the process
boundary is always plain data. ``tests/harness/test_protocol.py`` round-trips each one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank process needs to join its world."""

    rank: int
    world_size: int
    backend: str
    device: str
    rendezvous: str  # the FileStore's path, in the world's private folder
    store_prefix: str
    pg_timeout_s: float
    threads: int
    loopback_ifname: str | None
    controller_pid: int = 0  # allowed to ptrace the rank (py-spy stacks) where ptrace is restricted
    side_dir: str = ""  # the world's private side-channel folder (ddparity.harness.sidechannel)
    env: tuple[tuple[str, str], ...] = ()  # set before the process group starts (WorldSpec.env)


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a task function receives as its first argument on every rank."""

    rank: int
    world_size: int
    backend: str
    device: str


# controller -> rank


@dataclass(frozen=True, slots=True)
class RunTask:
    task_id: int
    payload: bytes  # cloudpickle of (fn, args, kwargs)
    sys_path: tuple[str, ...]  # the controller's import path at submission time
    pg_timeout_s: float = 0.0
    """The task's own process-group timeout (its progress timeout and a margin), so that
    torch's timeout never fires before the controller's report; 0: the world's."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# rank -> controller


@dataclass(frozen=True, slots=True)
class RankReady:
    rank: int
    pid: int
    seconds: float  # time to join the process group


@dataclass(frozen=True, slots=True)
class RankStartFailed:
    rank: int
    error: str
    traceback: str


@dataclass(frozen=True, slots=True)
class TaskDone:
    task_id: int
    rank: int
    ok: bool
    payload: bytes  # cloudpickle of the return value (ok) or of the exception (not ok)
    error: str  # "Type: message" when not ok
    traceback: str
    seconds: float


OUTPUT_END_MARK = b"\n\x00ddparity-task-end:%d\x00\n"
"""Written to a rank's output stream after a task, so the controller can cut the
stream at task boundaries even though output and messages travel on different pipes."""


@dataclass(frozen=True, slots=True)
class RunName:
    """How a rank task is shown while it runs (the CLI's live line): declared by the task
    itself (:func:`names_run`), not looked up by its function's name."""

    label: str
    sized: bool = False
    """Shown with its world size and backend (``ddp world_size=4 (gloo)``)."""
    simulated: bool = False
    """Its ranks are threads of one process: its world size is the simulated ranks' count."""

    def shown(self, world_size: int, backend: str) -> str:
        """``ddp world_size=4 (gloo)`` (a simulated run's ranks are threads, whatever its host
        world's backend), or the label alone where the run is not sized."""
        if not self.sized:
            return self.label
        return f"{self.label} world_size={world_size} ({'threaded' if self.simulated else backend})"


_Task = TypeVar("_Task", bound=Callable[..., Any])


def names_run(label: str, sized: bool = False, simulated: bool = False) -> Callable[[_Task], _Task]:
    """Declare how the decorated rank task is shown while it runs."""

    def declare(fn: _Task) -> _Task:
        fn.run_name = RunName(label, sized, simulated)  # type: ignore[attr-defined]
        return fn

    return declare


def run_name(fn: Any) -> RunName:
    """How ``fn`` is shown while it runs (its function name, if it declared nothing)."""
    return getattr(fn, "run_name", None) or RunName(getattr(fn, "__name__", "task"))


def dumps(obj: Any) -> bytes:
    """``obj`` cloudpickled, with torch's module-like namespaces (``torch.ops``,
    ``torch.backends.cudnn``, ``torch._VF``: objects of module subclasses registered in
    ``sys.modules``) pickled by name. cloudpickle finds them among the submodules that a
    function pickled by value uses (any function of a target file calling
    ``torch.ops.aten...``) and cannot pickle them: ``cannot pickle '_Ops' object``."""
    import sys

    import cloudpickle

    global _MODULES_SEEN
    if len(sys.modules) != _MODULES_SEEN:  # a task is submitted per run: scan again only after imports
        _MODULES_SEEN = len(sys.modules)
        _module_likes_by_name()
    return cloudpickle.dumps(obj)


_MODULES_SEEN = 0
"""How many modules :func:`dumps` last looked through."""


def _module_likes_by_name() -> None:
    """Every module subclass in ``sys.modules`` pickled as an import of its name."""
    import copyreg
    import importlib
    import sys
    import types

    for name, module in list(sys.modules.items()):
        kind = type(module)
        if kind is types.ModuleType or not isinstance(module, types.ModuleType) or kind in copyreg.dispatch_table:
            continue
        try:
            named = module.__name__ == name
        except Exception:  # a lazy module's attribute access may do anything
            continue
        if named:
            copyreg.pickle(kind, lambda m: (importlib.import_module, (m.__name__,)))
