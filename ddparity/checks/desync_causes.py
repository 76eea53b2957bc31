"""Why replicas drifted apart (a desync), where the evidence names it:

* a missed sync: (nearly) every parameter differs across the ranks after the first step — no
  gradient was all-reduced (``no_sync()`` or ``require_backward_grad_sync`` left off for
  the micro-batch that should synchronise, DDP's forward bypassed, a comm hook that reduces
  nothing);
* part of a step around DDP: the parameters that differ got their last gradient from a
  backward no DDP forward with sync on preceded, while one did run (``model.module.head(h)``,
  a GAN's generator pass through ``model.module``);
* parameters used on some ranks only (FSDP2's reduce-scatters of different sizes);
* a setting of the optimizer's that differs between the ranks;
* rank-local state: one rank alone drifts from the others that agree.
"""

from __future__ import annotations

from ddparity.checks.optimizer_settings import settings_desync
from ddparity.records import STEPPED
from ddparity.verdicts import Desync, MismatchedSlot

MISSED_SYNC_SHARE = 0.8
"""The share of parameters that differ across ranks after step 0 to call it a missed sync
(not all: Adam's first step moves a parameter by the sign of its gradient, which the
ranks' own gradients may share)."""


def _nothing_reduced(differing: int, params: int, step0: list[tuple[int, int]] | None,
                     hook_collectives: int | None) -> str:
    """No gradient all-reduced at step 0: DDP's forward bypassed, its sync left off, or (its
    forward run with sync on) a comm hook that reduced nothing, as each rank's count of DDP's
    forwards at step 0 (``step0``: calls, with sync on; None where not counted) and the
    case's comm hook's collectives (``hook_collectives``) say."""
    head = (f"no gradient was all-reduced at step 0 ({differing} of {params} parameters differ across ranks, as if "
            f"each rank trained alone)")
    missed = ("a missed sync — DDP synchronises a backward only if its forward ran with gradient sync on, so set "
              "require_backward_grad_sync (or leave no_sync()) before the last micro-batch's forward, not after it")
    if step0 is None:
        return f"likely cause: {head}: {missed}"
    calls, synced = sum(c for c, _ in step0), sum(s for _, s in step0)
    if not calls:
        return (f"likely cause: {head}: DDP's forward never ran — the step called the module DDP wraps "
                f"(model.module(x), getattr(model, 'module', model)(x), torch.compile(model.module)), and DDP "
                f"all-reduces only the gradients of a backward through its own forward; call the DDP model itself; "
                f"evidence: a hook on DDP's forward saw no call at step 0 on any rank")
    if not synced:
        return (f"likely cause: {head}: {missed}; evidence: DDP's forward ran {calls} time(s) at step 0 over the "
                f"ranks, each with gradient sync off")
    if hook_collectives == 0:
        return (f"likely cause: {head}: the case's comm hook returns its buckets unreduced — DDP's forward ran with "
                f"gradient sync on, and DDP hands each bucket to the hook, whose future's value becomes the "
                f"gradient; all-reduce the bucket in the hook and divide by the world size (or return "
                f"default_hooks.allreduce_hook(process_group, bucket)); evidence: {synced} forward(s) with sync on at "
                f"step 0 over the ranks, and no collective issued by the comm hook")
    return (f"candidate causes: {head} although DDP's forward ran with gradient sync on ({synced} of {calls} "
            f"forward(s) at step 0 over the ranks): a comm hook that returns its bucket without all-reducing it, "
            f"or gradients replaced after backward on each rank (set or recomputed outside DDP)")


def _unused_on_some_ranks(slot: MismatchedSlot) -> str | None:
    """FSDP2's own reduce-scatters of one ``slot`` with different sizes on the ranks: FSDP2
    reduce-scatters only the gradients a rank's backward made, so some parameters took no part
    in some ranks' loss. None for any other mismatch."""
    issued = slot.ranks
    calls = {rank: c.collective for rank, c in issued.items()}
    if (len(set(calls.values())) < 2 or not all(c.via == "FSDP2" for c in issued.values())
            or not all(call.startswith("reduce_scatter") for call in calls.values())):
        return None
    by_call: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        by_call.setdefault(call, []).append(rank)
    sizes = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:4]))}"
                      f"{' ...' if len(ranks) > 4 else ''}: {call}" for call, ranks in list(by_call.items())[:3])
    return (f"likely cause: parameters used on some ranks only: FSDP2 reduce-scattered gradients of different sizes "
            f"({sizes}), as it reduces only the gradients this rank's backward made; parameters that took no part "
            f"in some ranks' loss (mixture-of-experts experts no token of a shard was routed to, a branch the data "
            f"picks) leave them out there. Have FSDP2 reduce zeros for them: model.set_reduce_scatter_unused_params"
            f"(True) on the sharded root, in Case.fsdp here and after fully_shard in your training (torch's "
            f"counterpart of DDP's find_unused_parameters; a parameter no rank used then gets a zero gradient "
            f"where one device has none, which AdamW's weight decay and moments still act on); or make every "
            f"parameter take part in every rank's loss")


def desync_cause(desync: Desync, params: int, forwards: list[dict[int, tuple[int, int]] | None],
                  hook_collectives: int | None = None,
                  bypassed: list[dict[int, list[str]] | None] | None = None) -> str | None:
    if desync.collective is not None:
        return _unused_on_some_ranks(desync.collective)
    if desync.differs is None:
        return None
    out_of_step = _out_of_step(desync)
    if out_of_step:
        return out_of_step
    if desync.in_backward:
        return (f"likely cause: the optimizer stepped inside backward (a post-accumulate-grad hook calling "
                f"optimizer.step(), the optimizer-in-backward pattern) at step {desync.step}, on every rank: DDP "
                f"all-reduces a gradient after backward has produced it, bucket by bucket, so each rank stepped "
                f"with its own shard's gradient before the average arrived; under DDP step after backward() "
                f"returns (or register the step as a DDP comm hook's continuation: "
                f"ddp._register_fused_optim), or use FSDP2, whose post-accumulate-grad hooks run on the reduced "
                f"gradient")
    settings = settings_desync(desync.differs, desync.step, desync.ranks, desync.agreeing_ranks)
    if settings:
        return settings
    synced = forwards and all(f is not None and f.get(desync.step, (0, 0))[1] for f in forwards)
    unsynced = _bypassing(desync, params, bypassed or []) if synced else None
    if unsynced:
        return unsynced
    differing = [d for d in desync.differs if d.startswith("param ")]
    if desync.step == 0 and params and len(differing) >= MISSED_SYNC_SHARE * params:
        return _nothing_reduced(len(differing), params, [f.get(0, (0, 0)) for f in forwards if f is not None]
                                if forwards and all(f is not None for f in forwards) else None, hook_collectives)
    if len(desync.ranks) == 1 and desync.agreeing_ranks:
        return (f"likely cause: rank {desync.ranks[0]} alone drifts from ranks {desync.agreeing_ranks}, which agree: "
                f"something only that rank does — rank-local state, a comm hook or data that depends on the rank, "
                f"a parameter changed outside the optimizer on one rank")
    return None


def _bypassing(desync: Desync, params: int, bypassed: list[dict[int, list[str]] | None]) -> str | None:
    """The parameters that differ across ranks whose gradient, on every rank, reached
    ``optimizer.step()`` from a backward no DDP forward with sync on preceded, though one did
    run in the step: part of the step went around DDP (``model.module.head(h)``, a GAN's
    generator pass through ``model.module``)."""
    if not bypassed or any(b is None for b in bypassed):
        return None
    differing = [d.split(" ", 1)[1] for d in desync.differs or [] if d.startswith("param ")]  # model order
    steps = [s for s in sorted({s for b in bypassed if b for s in b}) if s <= desync.step]
    for step in steps:
        everywhere = set.intersection(*[set(b.get(step, ())) for b in bypassed if b is not None])
        names = [n for n in differing if n in everywhere]
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            return (f"likely cause: the gradients of {shown} ({len(names)} of {params} parameters) reached "
                    f"optimizer.step() at step {step} from a backward that no DDP forward with gradient sync on "
                    f"preceded, so DDP never all-reduced them and each rank stepped with its own shard's: that pass "
                    f"called the module DDP wraps (model.module(x), getattr(model, 'module', model)(x)) or a part of "
                    f"it (model.module.head(h)); call the DDP model itself for every forward whose gradients the "
                    f"optimizer uses (several forwards in a step each through DDP, with find_unused_parameters=True "
                    f"where one leaves parameters unused); evidence: a hook on each parameter saw its last gradient of "
                    f"step {step} arrive in such a backward on every rank, while DDP's forward ran with sync on for "
                    f"another")
    return None


def _out_of_step(desync: Desync) -> str | None:
    """The ranks stepped different optimizers at the same step (a watched script's steps are
    counted over every ``optimizer.step()`` call): one rank skipped or added a step."""
    stepped = [d[len(STEPPED):] for d in desync.differs or [] if d.startswith(STEPPED)]
    if len(stepped) < 2:
        return None
    return (f"likely cause: the ranks' optimizer steps are out of step: at step {desync.step} (counted over every "
            f"optimizer.step() call) the ranks stepped different optimizers ({' and '.join(stepped[:2])}), so one "
            f"rank skipped an optimizer.step() the others took, or took one more (a step under a condition that "
            f"depends on the rank's own data or loss, a GradScaler whose inf check differed); every later step "
            f"compares different optimizers' parameters, so the first such step is where to look; make the condition "
            f"the same on every rank (decide it from all-reduced values)")
