"""From what a DDP run left behind (traces, side-channel records, a world failure) to the
verdict of its :class:`RunResult`: pass, diverged, desync, hang or crash.

Evidence is weighed root cause first: ranks that issued different collectives (desync)
explain a later hang or a gloo error; replicas that drifted apart (desync) explain a
divergence from the reference; a dead or raising rank is a crash; ranks that stopped
making progress are a hang.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddparity.checks.collectives import Mismatch, collective_mismatch
from ddparity.checks.desync import ReplicaDrift, first_desync
from ddparity.checks.hang import judge_hang, rank_places, stragglers
from ddparity.errors import (
    RankCrashed,
    SimulatedRankError,
    StillRunning,
    TaskFailed,
    TaskStopped,
    TaskTimeout,
    WorldFailure,
)
from ddparity.frames import hide_own_frames, tidy_faulthandler_dump
from ddparity.records import SHARD_TAG, Entry, parse_fingerprints, parse_ledger, parse_progress
from ddparity.run_kinds import kind
from ddparity.verdicts import Crash, Desync, Divergence, Failure, IssuedCollective, MismatchedSlot, RunResult

DECISIVE = 10.0
"""How many times further off the reference (in tolerances) a replica's drifted tensor must
be than the other replica's for the comparison to name it, where two replicas disagree."""

def mismatch_desync(mismatch: Mismatch, stacks: dict[int, str] | None = None) -> Desync:
    """The desync of ranks that issued different collectives at one slot."""
    issued = {r: IssuedCollective(e.desc, e.site, e.via, e.step) for r, e in sorted(mismatch.entries.items())}
    return Desync(step=mismatch.step, what=mismatch.what(), ranks=mismatch.ranks,
                  collective=MismatchedSlot(mismatch.group, mismatch.seq, issued), stacks=stacks)


def state_desync(found: ReplicaDrift) -> Desync:
    """The desync of replicas whose fingerprints differ after a step."""
    nan = (f" (rank {found.nonfinite[0]}'s parameters hold a NaN or inf, the other's none)"
           if found.nonfinite else "")
    return Desync(step=found.step, what=f"{found.what()} differ across ranks after step {found.step}{nan}",
                  ranks=found.ranks, differs=found.names, agreeing_ranks=found.agreeing,
                  in_backward=found.in_backward)


def _ledgers(records: dict[int, Any]) -> dict[int, list[Entry]]:
    """Each rank's ledger, completed with the recent entries of its progress record (a
    rank killed before its last ledger lines were written still has them there)."""
    out = {}
    for rank, sig in records.items():
        entries = parse_ledger(sig.ledger)
        seen = {(e.group, e.seq) for e in entries}
        position = parse_progress(sig.progress)
        recent = [e for e in position.recent if (e.group, e.seq) not in seen] if position else []
        out[rank] = entries + recent
    return out


def judge_completed(run: RunResult, records: dict[int, Any], found: list[Divergence]) -> RunResult:
    """A run where every rank finished: collectives, then replica state, then numbers."""
    if found:
        run.status = "diverged"
        run.first_divergence = found[0]
    mismatch = collective_mismatch(_ledgers(records))
    if mismatch is not None:
        run.status = "desync"
        run.desync = mismatch_desync(mismatch)
    else:
        first_step = found[0].step if found else None
        wrong = tuple(sorted({d.rank for d in found if d.step == first_step}))
        prints = {r: parse_fingerprints(s.fingerprints) for r, s in records.items()}
        drift = first_desync(prints, wrong)
        if drift is not None and not drift.agreeing:  # a tie: which of them the reference disagrees with
            named = off_the_reference(found, drift)
            drift = (first_desync(prints, named) or drift) if named else drift
        if drift is not None:
            run.status = "desync"
            run.desync = state_desync(drift)
    late = stragglers(records)
    if late:
        run.stragglers = late
    return run


def off_the_reference(found: list[Divergence], drift: ReplicaDrift) -> tuple[int, ...]:
    """Of replicas that disagree with no majority (``drift``: two ranks, or an HSDP shard's
    two replicas), those whose drifted tensors are also off the single-device reference at
    that step, by more than each other rank's error there (empty where that does not single
    them out): the comparison with the reference is the evidence a tie lacks."""
    tensors = {n.split(SHARD_TAG)[0] for n in drift.names}
    error: dict[int, float] = {}
    for d in found:
        if d.step == drift.step and f"{d.kind} {d.name}" in tensors and d.rank in drift.ranks and d.tolerance:
            error[d.rank] = max(error.get(d.rank, 0.0), d.max_abs / d.tolerance)
    if not error:
        return ()
    worst = max(error.values())
    named = tuple(sorted(r for r, e in error.items() if e == worst))
    others = [e for r, e in error.items() if r not in named] + [0.0] * (len(drift.ranks) - len(error))
    return named if len(named) < len(drift.ranks) and worst > DECISIVE * max(others, default=0.0) else ()


def judge_failure(exc: WorldFailure) -> Failure:
    """A run the World could not finish: desync if the ranks' collectives disagree (the
    likely cause of the hang or error), else hang or crash, with every rank's place."""
    records = exc.records or {}
    mismatch = collective_mismatch(_ledgers(records)) if records else None
    if mismatch is not None:
        return Failure("desync", _first_line(exc), desync=mismatch_desync(mismatch, stacks=dict(exc.stacks)))
    if isinstance(exc, (TaskTimeout, TaskStopped)):
        hang = judge_hang(records, exc.stacks, exc.pending_ranks, exc.flight)
        return Failure("hang", _first_line(exc), hang=hang)
    if isinstance(exc, RankCrashed):
        return Failure("crash", str(exc), crash=Crash(
            rank=exc.rank, exitcode=exc.exitcode, error=_first_line(exc),
            output=tidy_faulthandler_dump(exc.output.strip())[-8000:],
            ranks=rank_places(records, exc.stacks, sorted(exc.stacks)) if records else {}))
    if isinstance(exc, TaskFailed):
        bad = [o for o in exc.outcomes if not o.ok]
        raised = [o for o in bad if not isinstance(o.error, StillRunning)] or bad
        head = raised[0]
        failing_rank = head.error.rank if isinstance(head.error, SimulatedRankError) else head.rank
        stuck = [o.rank for o in bad if o not in raised]
        shown = hide_own_frames(head.traceback)
        places = rank_places(records, {o.rank: o.output for o in bad if o.rank in stuck}, stuck) if records else {}
        for o in raised[1:]:  # the other ranks that raised too: said, not "finished"
            if o.rank in places:
                places[o.rank] = dataclasses.replace(places[o.rank], raised=f"{type(o.error).__name__}: {o.error}")
        crash = Crash(rank=failing_rank, exitcode=None, error=f"{type(head.error).__name__}: {head.error}",
                      traceback=shown, ranks=places)
        reason = f"rank {head.rank}: {type(head.error).__name__}: {head.error}\n{shown}".rstrip()
        return Failure("crash", reason, crash=crash)
    return Failure("error")


MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"
"""What DTensor raises where an op is given a DTensor and a plain tensor."""


DTENSOR_REFUSED = ("in-place operations that require placement changes are not supported",
                   "does not have a sharding strategy registered", "Sharding propagation failed")
"""What DTensor raises for an op it cannot run on a sharded tensor."""


FREED_STORAGE = "out of bounds for storage of size 0"
"""What autograd raises where a backward reads a tensor whose storage FSDP2 freed (resized to 0)."""


def crash_cause(crash: Crash | None, mode: str) -> str | None:
    """The likely cause of a sharded run's crash where torch's DTensor refused: to mix with a
    plain tensor (the step computed with the model's parameters outside its forward, where
    FSDP2 holds them as DTensor shards), or to run the optimizer's update on the shards
    (torch's Adafactor and Rprop in torch 2.13); or where a backward read a parameter FSDP2
    had resharded after an earlier backward. None for any other crash."""
    if crash is None or not kind(mode).sharded:
        return None
    if FREED_STORAGE in crash.error and "setStorage" in crash.error:
        return (f"likely cause: a second backward through parameters {mode.upper()} had already resharded after a "
                f"first one (a gradient penalty: torch.autograd.grad(..., create_graph=True) and then "
                f"loss.backward(); or two backwards of one forward): after each backward it frees the gathered "
                f"parameters the second one reads; call model.set_reshard_after_backward(False) before the first "
                f"backward and model.set_reshard_after_backward(True) before the last (pytorch/pytorch#172543)")
    if any(refused in crash.error for refused in DTENSOR_REFUSED):
        return _optimizer_refused(crash, mode)
    if MIXED_DTENSOR not in crash.error:
        return None
    return (f"likely cause: the step computed with the model's parameters outside its forward (a penalty summed "
            f"over model.parameters(), a weight read by hand): between forwards {mode.upper()} holds each parameter "
            f"as a DTensor shard, which torch will not mix with the step's plain tensors; compute the term inside a "
            f"module's forward (where the parameters are gathered), or, for an L2 penalty, use the optimizer's "
            f"weight_decay")


def _optimizer_refused(crash: Crash, mode: str) -> str | None:
    """The crash's cause where DTensor refused an op of the optimizer's step (its traceback
    passes through ``optimizer.step()``); None where the op was elsewhere."""
    import re

    trace = crash.traceback or ""
    if "/torch/optim/optimizer.py" not in trace:
        return None
    files = [f for f in re.findall(r"/torch/optim/(\w+)\.py", trace) if f != "optimizer"]
    which = f"torch.optim's {files[-1].lstrip('_')}.py" if files else "the optimizer's step"
    op = re.search(r"(aten\.[\w.]+)", crash.error)
    what = f"{op.group(1)} " if op else "an op "
    return (f"likely cause: {which} runs {what}on {mode.upper()}'s sharded parameters in a way DTensor cannot (an "
            f"in-place op that would change their placement, or one it has no sharding rule for), so this optimizer "
            f"does not train under {mode.upper()} in this torch; use one that takes DTensor parameters (SGD, Adam, "
            f"AdamW pass), or check the model under DDP (--modes single,ddp)")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
