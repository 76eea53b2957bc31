"""What ``--compile`` asks for: the ``torch.compile`` backend every selected mode's compiled
run uses, and (DDP) which of Dynamo's DDP paths. Validated in the controller, before any
work starts; the rank side (:mod:`ddparity.harness.ranks.compiling`) compiles with it.

A leaf module: it imports nothing from the harness; torch only inside the validator.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from ddparity.errors import UsageError
from ddparity.run_kinds import kind

COMPILE_DDP = ("ddp_optimizer", "python_reducer")
"""Dynamo's ways of compiling a DDP model (``torch._dynamo.config.optimize_ddp``): the graph
split at DDP's bucket boundaries, the C++ reducer all-reducing as in eager
(``ddp_optimizer``, the default); or the all-reduces traced into the backward graph by
compiled autograd (``python_reducer``)."""
CXX_COMPILERS = ("g++", "c++", "clang++")
"""What inductor builds its CPU kernels with (``$CXX`` first)."""


@dataclass(frozen=True, slots=True)
class CompileSpec:
    backend: str
    """A ``torch.compile`` backend: ``inductor``, ``aot_eager``, ``eager``, ..."""
    ddp: str = "ddp_optimizer"
    """Dynamo's DDP path (:data:`COMPILE_DDP`), for the ddp runs."""

    def for_mode(self, mode: str) -> dict[str, Any]:
        """The run's JSON ``compile``: the backend, and the DDP path where the mode is ddp."""
        return {"backend": self.backend, "ddp": self.ddp if kind(mode).buckets else None}

    def label(self, mode: str) -> str:
        """How a row names its compiled run: ``compiled aot_eager`` (ddp: ``, python_reducer``)."""
        return f"compiled {self.backend}" + (f", {self.ddp}" if kind(mode).buckets else "")

    def flags(self) -> str:
        """The CLI flags that ask for this again."""
        return f" --compile {self.backend}" + (f" --compile-ddp {self.ddp}" if self.ddp != "ddp_optimizer" else "")


@dataclass
class CompileSummary:
    """What compiling one run did (plain data: it crosses to the controller)."""

    backend: str
    ddp: str | None
    mode: str = ""
    seconds: float = 0.0
    """Spent compiling (Dynamo's frames and the backward), apart from the steps."""
    graph_breaks: list[str] = field(default_factory=list)
    """Each break in the user's code: ``file:line: reason``."""
    torch_breaks: int = 0
    """Breaks inside torch's own wrappers (DDP's forward breaks by design)."""
    own_breaks: int = 0
    """Breaks at ddparity's recording in DDP's wrapper (outside the model's graphs)."""
    graphs: int = 0
    """Graphs compiled (Dynamo's ``unique_graphs``)."""
    ops: int = 0
    """Calls captured into them (0: nothing of the model was compiled)."""
    ddp_split: list[list[int]] = field(default_factory=list)
    """Under DDPOptimizer: per graph it split, the bytes of each bucket, in backward order."""
    ddp_cap: int = 0


def validate_compile(backend: Any, ddp: Any, where: str) -> CompileSpec | None:
    """The compile asked for (None: eager only). The backend must be one this torch has;
    inductor on a CPU needs a C++ compiler, named when missing. (The torch release is the
    caller's to check: :meth:`ddparity.settings.CheckOptions.validated`.)"""
    if backend is None:
        if ddp is not None:
            raise UsageError(f"{where}: compile_ddp={ddp!r} given without compile; add --compile BACKEND "
                             f"(e.g. --compile inductor)")
        return None
    if not isinstance(backend, str) or not backend:
        raise UsageError(f"{where}: compile must be a torch.compile backend name, e.g. 'inductor', got {backend!r}")
    if ddp is None:
        ddp = COMPILE_DDP[0]
    if ddp not in COMPILE_DDP:
        raise UsageError(f"{where}: compile_ddp must be one of {', '.join(COMPILE_DDP)}, got {ddp!r}")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UsageError(f"{where}: unknown torch.compile backend {backend!r}; this torch has: {', '.join(known)}")
    if backend == "inductor" and not _gpus() and not _cxx():
        raise UsageError(f"{where}: the inductor backend builds its CPU kernels with a C++ compiler, and none was "
                         f"found ($CXX, {', '.join(CXX_COMPILERS)}); install one (e.g. apt install g++), or "
                         f"compile with --compile aot_eager (Dynamo and AOTAutograd without inductor's kernels)")
    return CompileSpec(backend, ddp)


def _cxx() -> str | None:
    named = os.environ.get("CXX")
    return shutil.which(named) if named else next((c for c in CXX_COMPILERS if shutil.which(c)), None)


def _gpus() -> bool:
    import torch

    return torch.cuda.is_available()
