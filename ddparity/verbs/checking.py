"""One check, wherever its ranks run: its plan, its reference, its noise floors, its judging
and its reproduce lines, built once for a local check (:mod:`ddparity.verbs.check`: warm
worlds of this machine) and a launched one (:mod:`ddparity.verbs.launched`: torchrun's
processes); a :class:`Checking` turns their results, however they come back, into the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddparity.case import Case
from ddparity.checks import causes, placed
from ddparity.checks.comm import size_text
from ddparity.checks.equivalence import NonFinite, divergences, first_non_finite, worst
from ddparity.checks.judge import judge_completed
from ddparity.checks.optimizer_settings import settings_apart
from ddparity.checks.tolerance import Uncalibrated, auto_tolerance, fixed_tolerance, larger_floors
from ddparity.compile_spec import CompileSpec
from ddparity.distances import Distances, Reference, update_ratio
from ddparity.errors import RankCrashed, WorldFailure
from ddparity.harness.ranks.modes.dp import simulated as dp_simulated
from ddparity.records import BUCKET_VIA, parse_ledger
from ddparity.report import Report
from ddparity.run_kinds import REPLICA_MODES, asked, kind
from ddparity.settings import CheckOptions
from ddparity.verbs.plan import cannot_run, check_repro, failure_run
from ddparity.verdicts import Divergence, ModuleFinding, RunResult

Planned = tuple[str, int, "CompileSpec | None"]
"""One run a check asks for: its mode, world size and compile (None: eager)."""


@dataclass
class Checking:
    """One check of ``case`` with ``opts`` (resolved for it: :meth:`of`); ``launched``: its
    ranks are a torchrun launch's, whose world size torchrun decides (reproduce lines then
    say so). The reference and what it implies arrive by :meth:`referenced`."""

    case: Case
    opts: CheckOptions
    launched: bool = False
    reference: Reference | None = None
    blowup: NonFinite | None = None
    """The reference's first NaN or inf, where it computed one: no run is compared past it."""
    valid: dict[str, list[int]] = field(default_factory=dict)
    """Per input, the steps whose batch it held (what a run's cause may blame)."""
    policy: Distances | None = None
    """The user's FSDP set-up on one rank against the reference: the sharded runs' noise
    floor where its MixedPrecisionPolicy computes in a lower precision."""
    loss_probe: Callable[[], float | None] | None = None
    """Runs :func:`~ddparity.harness.ranks.probes.loss_scaling_task` where the reference
    is (set by the orchestrator): asked at most once, by a run whose loss fits both a sum
    and a mean divided by W."""
    _probed: list[float | None] = field(default_factory=list)
    locator: Callable[..., list[Any] | str] | None = None
    """``(mode, world size, backend, step, global batch size[, (module, call, tolerance)])``:
    re-runs a failing run's first differing step module by module where the ranks are (set by
    the orchestrator; :mod:`ddparity.harness.ranks.probes`): every rank's finding and module
    order (or the first differing op of that module call), or why it could not."""

    @classmethod
    def of(cls, case: Case, opts: CheckOptions, launched: bool = False) -> Checking:
        """The check of ``case`` (its steps as ``opts`` say, validated), its options resolved."""
        case = case.with_steps(opts.steps).validate()
        return cls(case, opts.for_case(case), launched)

    # -- the plan ----------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Whether a sharded mode is checked: the reference then writes its optimizer's
        state, which they compare (DDP's ranks publish theirs as fingerprints, compared
        across ranks)."""
        return any(kind(m).sharded for m in self.opts.modes)

    def planned(self) -> list[Planned]:
        """Every run asked for, in the order they are reported."""
        opts = self.opts
        compiles = (None, opts.compile) if opts.compile is not None else (None,)
        plan: list[Planned] = [(mode, 1, spec) for mode in asked(opts.modes, "reference") for spec in compiles]
        plan += [(mode, ws, None) for mode in asked(opts.modes, "one_process") for ws in opts.world_sizes]
        plan += [(mode, ws, spec) for mode in REPLICA_MODES if mode in opts.modes for ws in opts.world_sizes
                 for spec in compiles]
        return plan

    def repro(self, mode: str, ws: int, backend: str, spec: CompileSpec | None = None) -> str:
        """The line that runs this one run again (under a launch: without the world size)."""
        return check_repro(self.case, self.opts, mode, None if self.launched else ws, backend, spec)

    def cannot_run(self, backend: str, ws: int, sizes: list[int], mode: str,
                   spec: CompileSpec | None = None) -> RunResult | None:
        """The row that stands for a run which cannot happen here (None: it can)."""
        return cannot_run(self.case, self.opts, backend, ws, sizes, mode, spec)

    # -- the reference -----------------------------------------------------------------

    def referenced(self, reference: Reference, valid: dict[str, list[int]]) -> None:
        self.reference, self.valid = reference, valid
        self.blowup = first_non_finite(reference)

    def reference_rows(self, backend: str, seconds: float, blowup: str | None) -> list[RunResult]:
        """The reference's own rows (an ``error`` where it computed a NaN or inf:
        ``blowup``, its reason)."""
        return [RunResult(mode=mode, world_size=1, backend=backend, status="error" if blowup else "pass",
                          reason=blowup, seconds=seconds, tolerance="reference",
                          repro=self.repro(mode, 1, backend) if blowup else "")
                for mode in asked(self.opts.modes, "reference")]

    def policy_noise(self, distances: Distances) -> None:
        """The user's FSDP set-up on one rank, against the reference: kept as the noise of its
        ``MixedPrecisionPolicy`` where it computes in a lower precision."""
        self.policy = distances if distances.computed_dtype else None

    def tolerance(self, ws: int, low: str | None = None,
                  noise: list[dict[tuple[str, str], float]] | None = None) -> Any:
        """The tolerance of a run at ``ws`` (``low``: the precision it computed in; ``noise``:
        per step and tensor, what its set-up alone does to the numbers)."""
        assert self.reference is not None
        if self.opts.tolerance == "auto":
            return auto_tolerance(self.reference, ws, self.case.torch_dtype, low, noise)
        return fixed_tolerance(self.reference, float(self.opts.tolerance))

    # -- rows --------------------------------------------------------------------------

    def replica_row(self, mode: str, ws: int, backend: str, seconds: float, status: str = "pass",
                    spec: CompileSpec | None = None, said: list[str] | tuple[str, ...] = ()) -> RunResult:
        """The row of a replicated run, before judging: what ``said`` says of it, then its mesh."""
        run = mark(RunResult(mode=mode, world_size=ws, backend=backend, status=status, seconds=seconds,
                             repro=self.repro(mode, ws, backend, spec)), spec)
        run.notes += said
        mesh = kind(mode).mesh_note(ws, self.opts.shard)
        if mesh:
            run.notes.append(mesh)
        unused = [f"Case.{name}" for name in ("comm_hook", "ddp_options") if getattr(self.case, name)]
        if unused and not kind(mode).buckets:  # a comm hook's bug is no bug of this run's: say it did not run
            run.notes.append(f"{' and '.join(unused)} {'are' if len(unused) > 1 else 'is'} DDP's: this {mode} run "
                             f"trained without {'them' if len(unused) > 1 else 'it'} (FSDP2 reduces gradients "
                             f"its own way)")
        return run

    def failed(self, mode: str, ws: int, backend: str, exc: BaseException, seconds: float,
               spec: CompileSpec | None = None) -> RunResult:
        """A run that ``exc`` ended (a hang, a crash, an error)."""
        return mark(failure_run(mode, ws, backend, exc, seconds, self.repro(mode, ws, backend, spec)), spec)

    def failed_everywhere(self, report: Report, backend: str, exc: WorldFailure, elapsed: float) -> Report:
        """The case cannot even run on one device: every run asked for shares that fate."""
        for mode, ws, spec in self.planned():
            run = (self.failed_one_process(mode, ws, backend, exc, elapsed) if kind(mode).one_process and spec is None
                   else self.failed(mode, ws, backend, exc, elapsed, spec))
            if run.status == "crash" and not isinstance(exc, RankCrashed):
                run.status = "error"  # raised by the user's code on a single device: bad input
            report.runs.append(run)
        return report

    # -- judging -----------------------------------------------------------------------

    def judge(self, run: RunResult, runs: list[Distances], records: dict[int, Any],
              compile_noise: Distances | None = None) -> RunResult:
        """A replicated run whose every rank finished: its distances to the reference
        (``runs``, one per rank) and what the ranks left in the side channel (``records``)
        judged; the policy's noise (sharded runs) and ``compile_noise`` (a compiled
        single-device run's distances) are its noise too."""
        assert self.reference is not None
        ws, reference = run.world_size, self.reference
        low = next((r.computed_dtype for r in runs if r.computed_dtype), None)
        if run.compile is not None and kind(run.mode).sharded and self.policy is not None:
            low = low or self.policy.computed_dtype  # no hook measured it: Dynamo would trace hooks on the layers
        policy = self.policy if kind(run.mode).sharded and low else None
        floors = [d.steps for d in (policy, compile_noise) if d is not None]
        tol = self.tolerance(ws, low, larger_floors(floors) if floors else None)
        stop = self._stop(tol)
        found = divergences(reference, runs, tol, until=_until(stop))
        run.tolerance = tol.description
        run.worst = worst(found)
        if tol.loose:
            run.notes.append(tol.loose)
        judged = judge_completed(run, records, found)
        params = reference.params
        unsharded = sorted({n for r in runs for n in r.unsharded})
        cause = (causes.likely_cause(found, ws, params=params, valid=self.valid, layer_types=reference.layer_types,
                                     mode=run.mode, unsharded=unsharded, loss_scaling=self.loss_scaling, eps=tol.eps,
                                     gathered=causes.gathered_on_every_rank([r.ledger for r in records.values()],
                                                                            found))
                 if judged.status == "diverged"
                 else causes.likely_cause(found, ws, judged.desync, params, forwards=[r.forwards for r in runs],
                                          hook_collectives=self._hook_collectives(records),
                                          bypassed=[r.bypassed for r in runs])
                 if judged.status == "desync" else None)
        desync = judged.desync.step if judged.desync is not None else None
        cause = settings_apart(reference.settings, {r.rank: r.settings for r in runs}, found[0] if found else None,
                               ws, run.mode, desync) or cause
        if cause:
            judged.notes.append(cause)
        traffic = extra_syncs(runs)
        if traffic:
            judged.notes.append(traffic)
        return self.localise(_compared_up_to(judged, stop), found, runs)

    def localise(self, run: RunResult, found: list[Divergence], ranks: list[Distances]) -> RunResult:
        """A diverged (or drifted apart) eager run's first divergence, given where in the model
        that step first differs: the earliest place over the ranks' activations, else the
        parameters whose gradients the run's own comparison found off (``found``), by the
        module backward reached first; a note where it could not be found. ``ranks``: the
        run's distances, for the factors its update and each rank's gradients are of the
        reference's."""
        d = run.first_divergence
        if (d is None or self.locator is None or self.reference is None or run.compile is not None
                or run.status not in ("diverged", "desync") or kind(run.mode).reference):
            return run
        sizes = self.reference.batch_sizes
        answers = self.locator(run.mode, run.world_size, run.backend, d.step,
                               sizes[d.step] if d.step < len(sizes) else -1)
        if isinstance(answers, str):
            run.notes.append(f"first differing module: not found ({answers})")
            return run
        best = earliest([finding for finding, _ in answers])
        if best.phase == "none" and best.note:  # nothing of the step compared: no module agrees either
            run.notes.append(f"first differing module: not found ({best.note})")
            return run
        if best.phase == "forward" and kind(run.mode).replicated:  # (DataParallel's replicas: no op pass)
            best = self._inside(run, best, sizes[d.step] if d.step < len(sizes) else -1)
        if not best.found:
            with_grads = {n for n, _ in self.reference.entries(d.step, "grad")}
            best = dataclasses.replace(by_gradients(d.step, found, answers[0][1], with_grads) or best,
                                       uncompared=best.uncompared)
        run.first_divergence = dataclasses.replace(d, module=best)
        per_rank = {r.rank: ratio for r in ranks if d.step in r.grad_dots
                    for ratio in [update_ratio([r.grad_dots[d.step]])] if ratio is not None}
        run.notes = placed.reread(run.notes, best, d, found, run.world_size, run.mode, kind(run.mode).replicated,
                                  self.loss_scaling, update_ratio([r.moved for r in ranks if r.moved]), per_rank,
                                  self.reference.changed_outside.get(d.step), self.reference.update_noise,
                                  self.reference.grad_hooks)
        return run

    def _inside(self, run: RunResult, module: ModuleFinding, size: int) -> ModuleFinding:
        """A module that differs in forward, given the first aten op of its call that differs
        on its rank (where the ops of the call match the reference's), or why none is named."""
        assert self.locator is not None
        answers = self.locator(run.mode, run.world_size, run.backend, module.step, size,
                               (module.module, module.call, module.tolerance))
        if isinstance(answers, str):
            return dataclasses.replace(module, note=f"no op named ({answers})")
        op, error, why = answers[module.rank]
        return dataclasses.replace(module, op=op, op_error=error, note=f"no op named: {why}" if why else "")

    def _hook_collectives(self, records: dict[int, Any]) -> int | None:
        """With a comm hook of the case's: the collectives it issued at step 0 over the ranks'
        ledgers (the hook's calls are recorded by their bucket, ``DDP gradient bucket i``)."""
        if self.case.comm_hook is None or not records:
            return None
        return sum(1 for r in records.values() for e in parse_ledger(r.ledger)
                   if e.step == 0 and e.via.startswith(BUCKET_VIA))

    def judge_one_process(self, mode: str, ws: int, backend: str, distances: Distances, notes: dict[str, str],
                          simulated: bool, seconds: float) -> RunResult:
        """A run of DataParallel's replicas in one process (real on GPUs, else simulated),
        with the pitfalls it saw (``notes``); its row names the device the reference world's
        process ran it on (``backend``: that world's)."""
        assert self.reference is not None
        tol = self.tolerance(ws)
        stop = self._stop(tol)
        found = divergences(self.reference, [distances], tol, until=_until(stop))
        run = RunResult(mode=mode, world_size=ws, backend=_device(backend), status="diverged" if found else "pass",
                        simulated=simulated, seconds=seconds, tolerance=tol.description,
                        repro=self.repro(mode, ws, backend))
        if found:
            run.first_divergence, run.worst = found[0], worst(found)
        run.notes = [f"DataParallel pitfall, {name}: {text}" for name, text in notes.items()
                     if found or name not in DIVERGED_ONLY]
        if tol.loose:
            run.notes.append(tol.loose)
        cause = (settings_apart(self.reference.settings, {0: distances.settings}, found[0] if found else None, ws, mode)
                 or causes.replica_cause(found, ws, self.valid, self.loss_scaling))
        if cause:
            run.notes.append(cause)
        return self.localise(_compared_up_to(run, stop), found, [distances])

    def failed_one_process(self, mode: str, ws: int, backend: str, exc: BaseException, seconds: float) -> RunResult:
        """A run of DataParallel's replicas that ``exc`` ended, labelled as a finished one is
        (the device; simulated where it was emulated)."""
        run = self.failed(mode, ws, backend, exc, seconds)
        run.backend, run.simulated = _device(backend), dp_simulated(_device(backend), ws)
        return run

    def loss_scaling(self) -> float | None:
        """The probe's ratio (the loss on the first batch given twice, to its loss), run once."""
        if not self._probed:
            self._probed.append(self.loss_probe() if self.loss_probe is not None else None)
        return self._probed[0]

    def _stop(self, tol: Any) -> NonFinite | Uncalibrated | None:
        """Where comparing ends: the reference's blow-up, or the first step no tolerance can
        be calibrated for, whichever comes first."""
        stops = [s for s in (self.blowup, tol.uncalibrated) if s is not None]
        return min(stops, key=lambda s: s.step) if stops else None


def mark(run: RunResult, spec: CompileSpec | None) -> RunResult:
    """``run`` as a compiled one (``spec`` None: an eager one, left as it is)."""
    if spec is None:
        return run
    run.compile = spec.for_mode(run.mode)
    run.label = spec.label(run.mode)
    return run


PHASES = ("forward", "loss", "backward", "reduction", "none")


def earliest(findings: list[ModuleFinding]) -> ModuleFinding:
    """The finding that comes first in the step (forward, then the loss, then backward; by
    the place of the call; the lowest rank of a tie)."""
    return min(findings, key=lambda f: (PHASES.index(f.phase), f.position, f.rank))


def by_gradients(step: int, found: list[Divergence], order: list[tuple[str, str, list[str]]],
                 with_grads: set[str]) -> ModuleFinding | None:
    """Where every activation agrees: the reduction, if every parameter's gradient at
    ``step`` is off (``with_grads``: those the reference has), else the first module in
    backward's ``order`` whose parameter's gradient is (None: none is)."""
    grads = [d for d in found if d.kind == "grad" and d.step == step]
    if not grads:
        return None
    off = {d.name for d in grads}
    if len(with_grads) > 1 and with_grads <= off:
        d = max(grads, key=lambda g: g.excess)
        return ModuleFinding(step=step, rank=d.rank, phase="reduction", differs="every parameter's gradient",
                             error=d.max_abs, tolerance=d.tolerance, scale="abs",
                             agrees="every activation and activation gradient", agrees_ok=True)
    for position, (module, type_name, params) in enumerate(order):
        hits = [d for d in grads if d.name in params]
        if hits:
            d = min(hits, key=lambda g: g.rank)
            return ModuleFinding(step=step, rank=d.rank, phase="backward", module=module, type=type_name,
                                 differs=f"gradient of {d.name.rsplit('.', 1)[-1]}", error=d.max_abs,
                                 tolerance=d.tolerance, scale="abs", mismatch=d.mismatch or "",
                                 agrees="output gradient", agrees_ok=True, position=position)
    return None


DIVERGED_ONLY = {"outputs not one row per sample"}
"""Pitfalls said only on a run that diverged: rows flattened sample-major ((B*T, V) logits)
come back in one device's order, and a passing run shows that nothing was misordered."""


def extra_syncs(runs: list[Distances]) -> str | None:
    """A note where DDP all-reduced every gradient more than once in a step (each forward with
    sync on: micro-batches accumulated without ``no_sync()``): correct, and the bytes that
    ``no_sync()`` for all but the last micro-batch would save (rank 0's count)."""
    accumulated = next((r.accumulated for r in runs if r.accumulated), None)
    grad_bytes = next((r.grad_bytes for r in runs if r.grad_bytes), 0)
    most = max(accumulated.values()) if accumulated else 0
    if most < 2:
        return None
    saved = (most - 1) * grad_bytes
    return (f"traffic: DDP all-reduced every gradient {most} times in a step (each forward ran with gradient sync "
            f"on: micro-batches accumulated without no_sync()); correct, but ctx.no_sync() (model.no_sync()) for "
            f"all but the last micro-batch would send {size_text(saved)} less a step per rank "
            f"({size_text(most * grad_bytes)} -> {size_text(grad_bytes)})")


def _until(stop: NonFinite | Uncalibrated | None) -> int | None:
    """The step before which runs are compared: the stop's, but every step where the stop is
    only imprecision (a tolerance looser than it should be is still a bound: a run beyond it
    diverged)."""
    if stop is None or (isinstance(stop, Uncalibrated) and stop.world_size):
        return None
    return stop.step


def _compared_up_to(run: RunResult, blowup: NonFinite | Uncalibrated | None) -> RunResult:
    """A run compared only up to the reference's blow-up (or the end of calibration): never
    a pass."""
    if blowup is None:
        return run
    if (isinstance(blowup, NonFinite) and run.status == "desync" and run.desync is not None
            and run.desync.step >= blowup.step):
        run.status, run.desync = "pass", None  # replicas of NaN: their bits say nothing
    if run.status == "pass":
        matched = f"; steps before {blowup.step} matched" if blowup.step else ""
        run.status, run.reason = "error", blowup.reason() + matched
    elif isinstance(blowup, Uncalibrated) and blowup.world_size:
        run.notes.append(f"judged within loose tolerances only: {blowup.reason()}")
    else:
        run.notes.append(f"compared up to step {blowup.step} only: {blowup.reason()}")
    return run


def _device(backend: str) -> str:
    """The device of a one-process run in a world of ``backend``."""
    return "cuda" if backend == "nccl" else "cpu"


__all__ = ["Checking", "Planned", "mark"]
