"""``check --compile``: the compiled single-device run, judged against the eager reference,
whose distances are the noise floor of every compiled replica run (what compiling alone
does to the numbers); what each compile did, said in the run's notes.

Every selected mode runs eager and compiled; a compiled row carries ``compile`` in its JSON
(``{"backend", "ddp"}``) and says so in the table.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddparity.checks.equivalence import divergences, worst
from ddparity.checks.placed import scale_placed
from ddparity.checks.tolerance import compiled_tolerance
from ddparity.compile_spec import CompileSpec, CompileSummary
from ddparity.distances import Distances, Reference
from ddparity.errors import WorldFailure
from ddparity.harness.ranks.compiled_blocks import compiled_blocks_task
from ddparity.harness.ranks.tasks import compiled_single_task, float64_single_task
from ddparity.run_kinds import MODES, REFERENCE_MODE, kind
from ddparity.settings import CheckOptions
from ddparity.verbs.checking import Checking, mark
from ddparity.verdicts import ModuleFinding, RunResult

if TYPE_CHECKING:
    from ddparity.case import Case

DP_NOT_COMPILED = ("not compiled: DataParallel replicates the module on every forward, which torch.compile does "
                   "not support; PyTorch advises DDP (check --modes ddp --compile ...)")
NOTHING = ("not compared compiled: torch.compile captured nothing of the model, every op ran eagerly, so this run "
           "compared no compiled code and says nothing about compiled training")
NOTHING_COMPILED = (NOTHING + " (Dynamo does not trace a forward that is torch's own code, e.g. a bare nn.Sequential "
                    "as the module DDP or FSDP wraps; wrap it in a module of your own with a forward)")
NOTHING_COMPILED_SHARDED = (
    NOTHING + " (under FSDP2 every sharded module's call breaks the "
    "graph at FSDP's hooks, which Dynamo does not trace; what lay between the breaks was torch's own code, a layer's "
    "or a bare nn.Sequential's forward, which Dynamo does not trace on its own, or a frame it ran eagerly after a "
    "break inside a loop (the graph breaks noted say where); shard blocks of your own with a forward (Case.fsdp), "
    "or check compiled under ddp)")
LOOP_BREAK = "ran eagerly: a graph break inside its loop"
"""How a graph-break note says Dynamo ran a frame of the user's eagerly (``compiling``)."""
DYNAMIC_SHAPE_BREAK = "Dynamic shape operator"
"""Dynamo's graph-break reason for an op whose output shape depends on the data (``nonzero``)."""
NOTHING_COMPILED_LOOP = (NOTHING + " (a graph break inside a loop of your forward made Dynamo run the whole frame "
                         "eagerly: the graph breaks noted say where")
DYNAMIC_SHAPES = ("; an op whose output's shape depends on the data, such as torch.nonzero or a boolean mask (a "
                  "mixture of experts' routing), is traced with torch._dynamo.config.capture_dynamic_output_shape_ops "
                  "= True)")
LIKELY = "likely cause: "
SPLIT_SHOWN = 8
"""Bucket sizes listed in a note before ``...``."""


def compiled_single(checking: Checking, spec: CompileSpec, world: Any,
                    spool: Any) -> tuple[RunResult, Distances | None]:
    """The compiled single-device run's row, and its distances when they can be the compiled
    runs' noise floor (None when it failed or diverged: compiling itself then changes the
    training, and the compiled replica runs are judged against eager's noise alone)."""
    case, opts, reference, blowup = checking.case, checking.opts, checking.reference, checking.blowup
    assert reference is not None
    started = time.perf_counter()
    repro = checking.repro(REFERENCE_MODE, 1, world.backend, spec)
    exact = _float64_error(case, opts, world, spool) if opts.tolerance == "auto" else None
    try:
        [distances] = world.run(compiled_single_task, case, spool.path, spec, timeout=opts.timeout)
    except WorldFailure as exc:
        return checking.failed(REFERENCE_MODE, 1, world.backend, exc, time.perf_counter() - started, spec), None
    tol = checking.tolerance(1)
    if opts.tolerance == "auto":
        tol = compiled_tolerance(tol, reference, case.torch_dtype, exact)
    stop = blowup.step if blowup is not None else None
    found = divergences(reference, [distances], tol, until=stop)
    run = mark(RunResult(mode=REFERENCE_MODE, world_size=1, backend=world.backend,
                         status="diverged" if found else "pass", seconds=time.perf_counter() - started,
                         tolerance=tol.description, repro=repro), spec)
    compared_nothing(describe(run, [distances.compiled]))
    if found:
        run.first_divergence, run.worst = found[0], worst(found)
        _first_block(run, checking, spec, world, spool)
        run.notes.append("compiling changes the training on one device, before any data parallelism: a compiler "
                         "bug or a model that computes differently when traced (torch.compiler.is_compiling(), "
                         "Python side effects in forward); the compiled data-parallel runs are judged against "
                         "eager's noise alone")
        return run, None
    return run, (distances if run.status == "pass" else None)


def _first_block(run: RunResult, checking: Checking, spec: CompileSpec, world: Any, spool: Any) -> None:
    """The compiled single run's first divergence, given the first block whose compiled output
    differs from its eager output (:mod:`ddparity.harness.ranks.compiled_blocks`), or a note
    of why none is named."""
    assert run.first_divergence is not None
    try:
        [block] = world.run(compiled_blocks_task, checking.case, spool.path, spec, timeout=checking.opts.timeout)
    except WorldFailure as exc:
        run.notes.append(f"first block that differs compiled: not found (the search failed: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
        return
    if block is None:
        run.notes.append("first block that differs compiled: none: the model's compiled forward agrees with eager's "
                         "on step 0's input; the difference is in backward or after it")
        return
    run.first_divergence = dataclasses.replace(run.first_divergence, module=block)


def locate_compiled(runs: list[RunResult], search: Callable[[RunResult], list[Any] | str]) -> None:
    """Where each compiled data-parallel run that diverged first differs. It is not re-run with
    hooks on every module (they change what Dynamo compiles): ``search(run)`` (the run's ranks,
    :func:`~ddparity.harness.ranks.compiled_blocks.compiled_replica_blocks_task`) compiles its
    blocks against eager on each rank's own input of the first differing step; where one
    differs, that block is the run's place. Where none does, the place is its eager twin's
    (the same mode and world size, re-run module by module), said as such; or a note of what
    the twin and the compiled single-device run tell."""
    eager = {(r.mode, r.world_size): r for r in runs if r.compile is None}
    single_differs = any(r.compile is not None and kind(r.mode).reference and r.status == "diverged" for r in runs)
    for run in runs:
        d, twin = run.first_divergence, eager.get((run.mode, run.world_size))
        if run.compile is None or run.status not in ("diverged", "desync") or kind(run.mode).reference or d is None:
            continue
        where = f"the eager {run.mode} run at world size {run.world_size}"
        if twin is not None and twin.status == "pass":  # no data-parallel cause, whatever the numbers fit
            run.notes = [_ruled_out(n, where) for n in run.notes]
        searched = _rank_blocks(run, search)
        if isinstance(searched, ModuleFinding):
            run.first_divergence = dataclasses.replace(d, module=searched)
            continue
        m = twin.first_divergence.module if twin is not None and twin.first_divergence is not None else None
        if twin is not None and twin.status in ("diverged", "desync") and m is not None and m.found:
            run.first_divergence = dataclasses.replace(d, module=m)
            run.notes = [scale_placed(n, m.phase, m.factor, run.world_size, run.mode) or n for n in run.notes]
            placed = [n for n in twin.notes if n.startswith(CAUSES)]
            if placed and twin.first_divergence is not None and twin.first_divergence.step == d.step:
                run.notes = [n for n in run.notes if not n.startswith(CAUSES)] + placed  # what its place named
            run.notes.append(f"first differing module: as in {where}, which differs too ({searched}): a "
                             f"data-parallel difference, not compile's")
        elif twin is not None and twin.status == "pass" and single_differs:
            run.notes.append(f"first differing module: not found ({searched}); {where} passes and the compiled "
                             f"single-device run diverges too: compiling alone changes the numbers (that run's "
                             f"block search says where)")
        elif twin is not None and twin.status == "pass":
            run.notes.append(f"first differing module: not found ({searched}); {where} passes and the compiled "
                             f"single-device run does not diverge: the difference comes with compiling the "
                             f"data-parallel run, in its backward or its reduction")
        else:
            ended = "did not run" if twin is None else f"ended {twin.status} without a place named"
            run.notes.append(f"first differing module: not found ({searched}); {where} {ended}")


CAUSES = ("likely cause", "candidate causes")


def _ruled_out(note: str, where: str) -> str:
    """A data-parallel cause line of a compiled run whose eager twin (``where``) passes, said
    to be ruled out (the numbers fit it; the twin's do not)."""
    if not note.startswith(LIKELY):
        return note
    cause = note[len(LIKELY):].split(":")[0]
    return (f"cause ruled out: the numbers fit {cause}, but {where} passes: the difference comes with compiling, "
            f"not with data parallelism")


def _rank_blocks(run: RunResult, search: Callable[[RunResult], list[Any] | str]) -> ModuleFinding | str:
    """The first block that differs compiled on the lowest rank where one does, or in words
    why none is named."""
    assert run.first_divergence is not None
    step = run.first_divergence.step
    answers = search(run)
    if isinstance(answers, str):
        return f"the block search failed: {answers}"
    found = [a for a in answers if a is not None]
    if found:
        return found[0]
    return f"every block, compiled alone, agrees with eager on each rank's input of step {step}"


def _float64_error(case: Case, opts: CheckOptions, world: Any, spool: Any) -> list[dict[tuple[str, str], float]] | None:
    """The reference's own rounding error, per step and tensor: its distance to the same
    training in float64 (None where the case cannot train in float64: the compiled run is then
    judged by a fixed share, said in its tolerance)."""
    try:
        [exact] = world.run(float64_single_task, case, spool.path, timeout=opts.timeout)
    except WorldFailure:
        return None
    return exact.steps if not exact.mismatches else None


def compared_nothing(run: RunResult) -> RunResult:
    """A compiled ``run`` whose compile captured no op compared eager code only: ``skipped``
    (with the reason), never a pass of compiled training; a divergence found stays one (it is
    real, though not the compiler's), said in a note."""
    if run.compile is None or run.compile.get("ops") != 0:
        return run
    why = NOTHING_COMPILED_SHARDED if kind(run.mode).sharded else NOTHING_COMPILED
    if not kind(run.mode).sharded and any(LOOP_BREAK in n for n in run.notes):
        why = NOTHING_COMPILED_LOOP + (DYNAMIC_SHAPES if any(DYNAMIC_SHAPE_BREAK in n for n in run.notes) else ")")
    if run.status == "pass":
        run.status, run.reason = "skipped", why
    else:
        run.notes.append(why.replace("not compared compiled: ", "", 1))
    return run


def fewer_ops(runs: list[RunResult], single: RunResult) -> None:
    """A note on each compiled data-parallel run that captured fewer ops than the compiled
    single-device run of the same model: the rest of its model ran eagerly, so its verdict
    speaks for compiled code that much less (FSDP's hooks break the graph at every sharded
    module's call; a break inside a loop runs the loop's whole frame eagerly)."""
    whole = single.compile.get("ops") if single.compile is not None else None
    for run in runs:
        ops = run.compile.get("ops") if run.compile is not None else None
        if not whole or not ops or ops >= whole or kind(run.mode).reference:
            continue  # no op captured: compared_nothing says so
        why = " at FSDP's hooks, which break the graph at every sharded module's call" if kind(run.mode).sharded else ""
        run.notes.append(f"{ops} op(s) captured, of the {whole} the single-device compile of this model captures: "
                         f"the rest ran eagerly{why} (the graph breaks above say where)")


def dropout_drawn(reference: Reference) -> str | None:
    """Why the compiled runs of this case cannot be compared: its model draws dropout masks,
    which ddparity aligns across modes by replacing torch's dropouts in eager runs only
    (traced, the replacement would be baked into the graph); None when it draws none."""
    if not reference.dropout_calls:
        return None
    return (f"not compared compiled: the step draws random numbers per sample ({reference.dropout_calls} dropout, "
            f"stochastic-depth or noise draw(s) a step), and a compiled run's draws cannot be the eager reference's; "
            f"check compiled with dropout off (p=0, e.g. a config's dropout set to 0.0; a drop-path rate of 0) and "
            f"without noise drawn in the step, eager runs compare it with them on")


def refused_run(checking: Checking, spec: CompileSpec, mode: str, ws: int, backend: str, reason: str) -> RunResult:
    """A compiled run that cannot be compared (``reason``): an ``error`` naming the fix."""
    return mark(RunResult(mode=mode, world_size=ws, backend=backend, status="error", reason=reason,
                          repro=checking.repro(mode, ws, backend, spec)), spec)



def describe(run: RunResult, summaries: list[CompileSummary | None]) -> RunResult:
    """``run``'s notes and JSON ``compile`` with what compiling did (rank 0's summary)."""
    run.notes += summary_notes(summaries)
    return compile_figures(run, summaries)


def compile_figures(run: RunResult, summaries: list[CompileSummary | None]) -> RunResult:
    """``run``'s JSON ``compile`` with what compiling did (rank 0's summary): seconds,
    graphs, ops, graph breaks."""
    summary = next((s for s in summaries if s is not None), None)
    if summary is not None and run.compile is not None:
        run.compile.update(seconds=round(summary.seconds, 3), graphs=summary.graphs, ops=summary.ops,
                           graph_breaks=list(summary.graph_breaks))
    return run


def summary_notes(summaries: list[CompileSummary | None]) -> list[str]:
    """What compiling did, from rank 0's summary (every rank compiles the same code)."""
    summary = next((s for s in summaries if s is not None), None)
    if summary is None:
        return []
    notes = [f"compiled with {summary.backend}{' (' + summary.ddp + ')' if summary.ddp else ''}: "
             f"{summary.graphs} graph(s), {summary.ops} op(s) captured, {summary.seconds:.2f} s compiling "
             f"(counted apart from the steps)"]
    if summary.graph_breaks:
        notes.append(f"{len(summary.graph_breaks)} graph break(s) in your code: " + "; ".join(summary.graph_breaks))
    else:
        notes.append("no graph break in your code")
    if summary.torch_breaks or summary.own_breaks:
        row = kind(summary.mode) if summary.mode in MODES else None
        wrapper = ("DDP's forward" if row.buckets else "FSDP's hooks" if row.sharded else None) if row else None
        eager = ("runs" if row.buckets else "run") if wrapper and row else ""
        own = f"{summary.own_breaks} at ddparity's recording" if summary.own_breaks else ""
        theirs = f"{summary.torch_breaks} in {wrapper or 'torch'}" if summary.torch_breaks else ""
        notes.append(f"{summary.torch_breaks + summary.own_breaks} graph break(s) outside the model's own code "
                     f"({', '.join(t for t in (theirs, own) if t)}), at the edges of the graphs Dynamo compiles "
                     f"of it{': ' + wrapper + ' ' + eager + ' eagerly by design' if wrapper else ''}")
    if summary.ddp_split:
        pieces = [len(split) for split in summary.ddp_split]
        largest = max(summary.ddp_split, key=len)
        sizes = ", ".join(_size(b) for b in largest[:SPLIT_SHOWN]) + (", ..." if len(largest) > SPLIT_SHOWN else "")
        notes.append(f"DDPOptimizer split {len(pieces)} graph(s) at DDP's bucket boundaries (cap "
                     f"{_size(summary.ddp_cap)}) into {', '.join(map(str, pieces))} piece(s); the largest "
                     f"split: {sizes}")
    elif summary.ddp == "ddp_optimizer" and summary.ops:
        notes.append("DDPOptimizer split no graph: the compiled graphs hold no parameters of DDP's buckets")
    return notes


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 2**10:.1f} kB"
