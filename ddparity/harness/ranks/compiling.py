"""A compiled run inside a rank: what the step calls is ``torch.compile`` of what the mode
wrapped (the DDP or FSDP module itself, as PyTorch advises), and what the compile did is
read as it happens: the graph breaks (where, and why), the seconds spent compiling, and
under DDP how Dynamo's DDPOptimizer split the graph against the buckets.

Every compiled run starts from ``torch._dynamo.reset()``: code compiled for an earlier run
(another model, another ``optimize_ddp``) is never reused, and its graph breaks are seen
again. Inductor's own on-disk caches (in the controller's private folder, see
:func:`ddparity.harness.ranks.rank.rank_main`) stay, so a warm
world compiles the same model faster the second time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from ddparity.compile_spec import CompileSpec, CompileSummary
from ddparity.run_kinds import kind

GRAPH_BREAK_LOGGERS = tuple(f"torch._dynamo.{m}.__graph_breaks" for m in ("symbolic_convert", "exc", "convert_frame"))
"""Dynamo's ``graph_breaks`` artifact loggers: each break, with the user's file and line."""
COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")
"""Dynamo's own timers of a frame's compile and of the lazily compiled backward."""
COMPILE_TICK_S = 1.0
_WHERE = re.compile(r"in user code at (?P<file>[^\n]+?):(?P<line>\d+)\nGraph Break Reason: (?P<why>.*)", re.S)
_RESUMED = re.compile(r"torch_dynamo_resume_in_(\w+)_at_(\d+)")
_SKIPPED = re.compile(r"frame skipped: (?P<frame>\S+) \((?P<file>[^\n]+?) line (?P<line>\d+)\)")


class Eager:
    """An eager run, as the training loop sees a run (:class:`Compiled` is the other):
    what the mode wrapped is called as it is, and ddparity's own hooks may sit on the model."""

    traced = False
    """Whether Dynamo traces what the step calls (then no hook of ddparity's may sit on the
    model, nor a replaced dropout: they would be traced into its graphs)."""

    def wrap(self, wrapped: Any) -> Any:
        return wrapped

    def __enter__(self) -> Eager:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


EAGER = Eager()


class Compiled:
    """One compiled run: ``wrap`` what the step calls; train inside ``with compiled:``."""

    traced = True

    def __init__(self, spec: CompileSpec, mode: str) -> None:
        self.spec, self.mode = spec, mode
        self.summary = CompileSummary(spec.backend, spec.ddp if kind(mode).buckets else None, mode)
        self._stack = contextlib.ExitStack()

    def wrap(self, wrapped: Any) -> Any:
        import torch

        return torch.compile(wrapped, backend=self.spec.backend)

    def __enter__(self) -> Compiled:
        import torch._dynamo
        from torch._dynamo.utils import compilation_time_metrics

        torch._dynamo.reset()
        self._before = {k: sum(compilation_time_metrics.get(k, ())) for k in COMPILE_METRICS}
        self._stats = _stats()
        self._stack.enter_context(_graph_breaks(self.summary))
        self._stack.enter_context(_ticking_while_compiling())
        if kind(self.mode).buckets:
            self._stack.enter_context(torch._dynamo.config.patch(optimize_ddp=self.spec.ddp))
            self._stack.enter_context(_ddp_split(self.summary))
            if self.spec.ddp == "python_reducer":
                from torch._dynamo import compiled_autograd

                self._stack.enter_context(compiled_autograd._enable(torch.compile(backend=self.spec.backend)))
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo.utils import compilation_time_metrics

        self._stack.close()
        self.summary.seconds = sum(sum(compilation_time_metrics.get(k, ())) - self._before[k]
                                   for k in COMPILE_METRICS)
        after = _stats()
        self.summary.graphs = after["unique_graphs"] - self._stats["unique_graphs"]
        self.summary.ops = after["calls_captured"] - self._stats["calls_captured"]


def _stats() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: int(counters["stats"][k]) for k in ("unique_graphs", "calls_captured")}


def graph_break(message: str, torch_dir: str, own_dir: str) -> tuple[str, str]:
    """Where one of Dynamo's graph-break messages lies (``user``, ``torch``, ``ddparity``, or
    ``""``: not a break), and for the user's code ``file:line: reason``. A break inside a
    loop makes Dynamo run the whole frame eagerly ("frame skipped"): where that frame is the
    user's, the break is the user's whatever file it arose in (a call of an FSDP-sharded block
    in a ``for`` loop breaks at FSDP's hooks, and the model's forward then runs uncompiled)."""
    found = _WHERE.search(message)
    if found is None:
        return "", ""
    where, why = f"{found['file']}:{found['line']}", found["why"]
    reason = next((line.strip() for line in why.splitlines()[1:] if line.strip()), "")
    if not reason or reason.startswith("Explanation"):
        reason = why.splitlines()[0].strip()
    skipped = _SKIPPED.search(why)
    if skipped is not None and not skipped["file"].startswith((torch_dir, own_dir + os.sep)):
        at = "FSDP's hooks, which Dynamo does not trace" if f"{os.sep}fsdp{os.sep}" in where else reason
        resumed = _RESUMED.fullmatch(skipped["frame"])  # the part of a frame after an earlier break
        frame = f"{resumed[1]} from line {resumed[2]} on" if resumed else skipped["frame"]
        return "user", (f"{skipped['file']}:{skipped['line']}: {frame} ran eagerly: a graph break inside its loop "
                        f"({at}, at {where}) makes Dynamo skip the frame: its ops ran uncompiled")
    if found["file"].startswith(torch_dir) or "DistributedDataParallel." in why:
        return "torch", ""
    if found["file"].startswith(own_dir + os.sep):
        return "ddparity", ""
    return "user", f"{where}: {reason}"


@contextlib.contextmanager
def _graph_breaks(summary: CompileSummary) -> Iterator[None]:
    """Dynamo's graph-break log, caught (not printed) while the run compiles."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddparity/harness: its recording

    class Breaks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            where, text = graph_break(record.getMessage(), torch_dir, own_dir)
            if where == "torch":
                summary.torch_breaks += 1
            elif where == "ddparity":
                summary.own_breaks += 1
            elif where == "user" and text not in summary.graph_breaks:
                summary.graph_breaks.append(text)

    handler = Breaks(logging.DEBUG)
    saved = []
    for name in GRAPH_BREAK_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


@contextlib.contextmanager
def _ticking_while_compiling() -> Iterator[None]:
    """A compile (inductor's can take minutes) is progress, not a hang: the rank's recorder
    ticks every :data:`COMPILE_TICK_S` while Dynamo compiles."""
    import torch._dynamo.callback as callback

    from ddparity.harness.recording import recorder

    rec = recorder.active()
    compiling = threading.Event()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(COMPILE_TICK_S):
            if compiling.is_set():
                rec.tick()

    def start(*_: Any) -> None:
        compiling.set()

    def end(*_: Any) -> None:
        compiling.clear()
        rec.tick()

    handler = callback.callback_handler
    handler.register_start_callback(start)
    handler.register_end_callback(end)
    ticker = threading.Thread(target=tick, name="ddparity-compile-ticks", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        handler.remove_start_callback(start)
        handler.remove_end_callback(end)
        ticker.join(timeout=COMPILE_TICK_S * 2)


@contextlib.contextmanager
def _ddp_split(summary: CompileSummary) -> Iterator[None]:
    """DDPOptimizer's bucket assignment as it splits a graph (it only logs it): read by
    wrapping the function it reports through, which computes nothing."""
    from torch._dynamo.backends import distributed

    report = distributed.pretty_print_buckets

    def read(buckets: list[Any], bucket_bytes_cap: int) -> None:
        summary.ddp_split.append([int(b.size) for b in reversed(buckets) if b.params])
        summary.ddp_cap = int(bucket_bytes_cap)
        report(buckets, bucket_bytes_cap)

    distributed.pretty_print_buckets = read
    try:
        yield
    finally:
        distributed.pretty_print_buckets = report
