"""Causes decided by *where* a run's first differing step first differs (the localisation's
:class:`~ddparity.verdicts.ModuleFinding`), where the numbers alone (:mod:`ddparity.checks.causes`)
fit more than one story or none:

* every gradient off by one factor: scaled before ``backward()`` (the gradient backward starts
  from differs already) or after it (every rank's forward and backward agree: a comm hook);
* a loss that differs at the loss itself and is a mean: a denominator or a selection taken from
  each shard (class-weighted cross-entropy, the hardest samples' losses);
* the parameters differing first, every gradient agreeing: the update (lr x W, a hand-written
  nudge on some ranks);
* the loss differing first at the loss on a rank that ran another number of forwards than one
  device: micro-batches whose count changes with the share, each loss divided by a fixed count
  (direct evidence: what the numbers alone guessed, a loss divided by W, yields to it);
* the loss's own gradient agreeing and a module inside the model adding what differs: a loss
  term computed there from each rank's shard (a mixture-of-experts load-balancing loss), which
  contradicts a per-rank token mean read from the padding;
* every activation agreeing and each rank's gradients one factor of the reference's, a factor
  of each rank's own: a scale computed from what the rank holds after the reduction (a clipping
  norm over FSDP's local shards);
* every activation agreeing where the model hooks its parameters' gradients
  (``p.register_hook``): the hooks, which run on each DDP rank's own gradient and not at all
  under FSDP2;
* a BatchNorm layer whose input agrees and whose output differs, where its running statistics
  could not tell (micro-batches, whose order the calibration twin's statistics depend on):
  BatchNorm on shards; a quantization observer so placed: its range taken from the shard.
"""

from __future__ import annotations

from collections.abc import Callable

from ddparity.checks.causes import OWN_VALID_ENTRIES, PROBE_REL_TOL, SAME_FACTOR, SIGNATURE_REL_TOL
from ddparity.run_kinds import kind
from ddparity.verdicts import Divergence, ModuleFinding

INPUT_GRADIENT = "input gradient"
"""A backward finding's ``differs`` where the module's output gradient agrees."""


def reread(notes: list[str], best: ModuleFinding, first: Divergence, found: list[Divergence], world_size: int,
           mode: str, replicated: bool, loss_scaling: Callable[[], float | None],
           update: tuple[float, float] | None = None,
           per_rank: dict[int, tuple[float, float]] | None = None,
           changed: dict[str, str] | None = None, noise: tuple[float, float] | None = None,
           hooks: list[str] | None = None) -> list[str]:
    """A run's ``notes`` once its first divergence (``first``, of ``found``) is placed at
    ``best``: a cause the place decides (a scale before or after backward), a cause the place
    contradicts replaced, and, where nothing named a cause, the one the place names
    (``update``: :func:`ddparity.distances.update_ratio` of step 0; ``per_rank``: of each
    rank's gradients at the first divergence's step; ``changed``: the parameters the
    reference's step changed in place outside ``optimizer.step()``, with what holds them;
    ``noise``: the calibration twin's own step-0 update ratio; ``hooks``: the parameters whose
    gradient the user's model hooks)."""
    if best.phase == "loss" and best.forwards is not None and replicated:  # what the numbers guessed yields to it
        return [n for n in notes if not n.startswith(("likely cause", "candidate causes"))] + [
            fewer_forwards(best, world_size, mode)]
    notes = [scale_placed(n, best.phase, best.factor, world_size, mode) or n for n in notes]
    inside = entered_inside(best, first, mode)
    if inside is not None:
        notes = [inside if n.startswith(OWN_VALID_ENTRIES) else n for n in notes]
    hooked = hooked_gradients(hooks or [], mode, per_rank) if best.phase == "reduction" else None
    if hooked is not None:  # what the numbers guessed (one factor: "a comm hook") yields to it
        notes = [n for n in notes if SAME_FACTOR not in n and not n.startswith("candidate causes")]
        if not any(n.startswith("likely cause") for n in notes):
            return notes + [hooked]
    if any(n.startswith(("likely cause", "candidate causes")) for n in notes):
        return notes
    if best.phase == "loss" and first.kind == "loss" and replicated:
        cause = per_shard_denominator(loss_scaling(), best.factor, world_size, mode, first.step)
        return notes + ([cause] if cause else [])
    if best.phase == "reduction" and per_rank:
        cause = scaled_per_rank(best.step, per_rank, mode)
        if cause:
            return notes + [cause]
    if not best.found and first.kind == "param":
        ranks = sorted({x.rank for x in found if x.step == first.step and x.kind == "param"})
        differing = [x.name for x in found if x.step == first.step and x.kind == "param"]
        # only where every parameter that differs is one the step changed by hand (an EMA teacher
        # follows a student that differs for another reason)
        explained = changed is not None and set(differing) <= set(changed)
        return notes + [(changed_in_the_step(differing, changed, mode) if changed and explained else None)
                        or after_the_gradients(first.step, world_size, mode, ranks, update, noise)]
    if inside is None:
        inside = normalised_apart(best, mode)
    if inside is None and changed:  # nothing else named: what the step changed by hand is a candidate
        inside = changed_in_the_step(list(changed), changed, mode, likely=False)
    return notes + ([inside] if inside is not None else [])


OBSERVERS = ("FakeQuantize", "Observer")
"""Words in the class names of torch.ao.quantization's observers and fake-quantize modules."""


def normalised_apart(best: ModuleFinding, mode: str) -> str | None:
    """The step first differs in a BatchNorm layer's forward (``best``), its input agreeing with
    the reference's rows for the same samples: each rank (replica) normalised its part of the
    batch with that part's own statistics; or in a quantization observer's (a fake-quantize
    module of quantization-aware training), which took its range from its part. None
    elsewhere (SyncBatchNorm's statistics are the whole batch's)."""
    if best.phase != "forward" or best.agrees_ok is not True:
        return None
    evidence = "evidence: its input agrees with the reference's rows for the same samples, its output differs"
    if any(word in best.type for word in OBSERVERS):
        part = "each replica observes its chunk" if kind(mode).one_process else "each rank observes its shard"
        return (f"likely cause: quantization observers on shards ({best.module} ({best.type})): {part} and "
                f"fake-quantizes with the range (min/max, then scale and zero point) of that part of the batch, "
                f"where one device takes the whole batch's; which matches one device once the observers are frozen: "
                f"calibrate with them on, then model.apply(torch.ao.quantization.disable_observer) before data-"
                f"parallel training; {evidence}")
    if "BatchNorm" not in best.type or best.type.startswith("Sync"):
        return None
    part = "each replica normalises its chunk" if kind(mode).one_process else "each rank normalises its shard"
    return (f"likely cause: BatchNorm on shards ({best.module} ({best.type})): {part} (each micro-batch of it, "
            f"where the step makes them) with its own statistics; use torch.nn.SyncBatchNorm.convert_sync_batchnorm "
            f"(GPUs), GroupNorm or LayerNorm, or BatchNorm in eval mode; {evidence}")


def hooked_gradients(hooks: list[str], mode: str, per_rank: dict[int, tuple[float, float]] | None) -> str | None:
    """Every module agreed and the reduced gradients differ, in a model that hooks its
    parameters' gradients (``hooks``): under DDP the hooks ran on each rank's own gradient
    before the average, which changes the result unless the hook is linear (so not where each
    rank's gradients are one factor of the reference's, ``per_rank``); under FSDP2 they did
    not run at all (``fully_shard`` replaces the parameters; a tensor hook on the new ones never
    fires). None for DataParallel (the hook runs on the summed gradient, as on one device),
    and where each rank's gradients are one factor of their own (:func:`scaled_per_rank`)."""
    if not hooks or not (kind(mode).sharded or kind(mode).replicated) or kind(mode).one_process:
        return None
    if per_rank and scaled_per_rank(0, per_rank, mode):
        return None  # each rank one factor of its own: a scale's signature, which no hook (run or not) makes
    shown = ", ".join(hooks[:3]) + (f" and {len(hooks) - 3} more" if len(hooks) > 3 else "")
    fix = ("apply it to the whole gradient in the step, between backward() and optimizer.step() "
           "(torch.nn.utils.clip_grad_value_ for a clamp)")
    evidence = "evidence: every module's output and activation gradient agrees, the reduced gradients do not"
    if kind(mode).sharded:
        return (f"likely cause: the model hooks its parameters' gradients ({shown}: p.register_hook), and "
                f"{mode.upper()} never runs those hooks: fully_shard replaces every parameter with a sharded "
                f"DTensor (hooks on the old ones are lost, and one registered on the new never fires); {fix}, or "
                f"register_post_accumulate_grad_hook after fully_shard (it runs on the reduced shard); {evidence}")
    if per_rank and all(off < ONE_FACTOR for _, off in per_rank.values()):
        return None  # one factor of the reference's on every rank: a scale, which a linear hook cannot make
    return (f"likely cause: the model hooks its parameters' gradients ({shown}: p.register_hook), and each hook "
            f"runs on a rank's own gradient, before DDP averages them: a hook that is not linear (a clamp, a norm "
            f"clip) gives another result on the ranks' shares than on one device's whole batch; {fix}, or in a "
            f"DDP comm hook after the all-reduce; {evidence}")


def scaled_per_rank(step: int, per_rank: dict[int, tuple[float, float]], mode: str) -> str | None:
    """Every module agreed and each rank's gradients at ``step`` are one factor of the
    reference's (``per_rank``: rank -> (factor, 1 - cos^2), from
    :func:`~ddparity.distances.update_ratio`), a factor that differs between ranks: each rank
    scaled what it holds after the reduction by a number of its own. None where some rank's
    gradients are no one factor of the reference's, or every rank's is the same one (the
    uniform scale's causes)."""
    if len(per_rank) < 2 or any(off >= ONE_FACTOR for _, off in per_rank.values()):
        return None
    factors = [f for f, _ in per_rank.values()]
    if max(factors) - min(factors) <= FACTOR_TOL * max(abs(f) for f in factors):
        return None
    ranks = sorted(per_rank.items())
    listed = ", ".join(f"rank {r} {f:.3g}x" for r, (f, _) in ranks[:4]) + (
        f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
    worst = max(off for _, off in per_rank.values())
    if kind(mode).sharded:
        what = (f"a number computed from the rank's own shards — a gradient norm for clipping taken over the local "
                f"shards (p.grad.to_local(), a hand-written clip that reads FSDP1's flat parameters or each rank's "
                f"slice), a scale read from the rank's own gradients; compute it over the whole model: "
                f"torch.nn.utils.clip_grad_norm_ on {mode.upper()}'s DTensor gradients reduces the norm across the "
                f"mesh (or all-reduce the squared norms first)")
    else:
        what = ("a number that depends on the rank (a scale, a clip or a learning rate computed per rank); every "
                "replica must apply one device's")
    return (f"likely cause: at step {step} each rank's gradients were scaled after the reduction by a factor of its "
            f"own ({listed} the reference's): {what}; evidence: every module's output and activation gradient "
            f"agrees, and each rank's gradients are one factor of the reference's (1 - cos^2 <= {worst:.1e})")


def entered_inside(best: ModuleFinding, first: Divergence, mode: str) -> str | None:
    """The step first differs inside the model (``best``: backward, a module whose output
    gradient agrees and whose input gradient differs, every module nearer the loss agreeing):
    the loss's own gradient is the reference's, so what differs is added on the way — a term of
    the loss computed inside that module from each rank's shard alone (where the loss differs
    too, at step 0: the likely cause), or that module's backward itself. None elsewhere."""
    if best.phase != "backward" or best.differs != INPUT_GRADIENT or best.agrees_ok is not True:
        return None
    where = f"{best.module} ({best.type})" if best.type else best.module
    name, part = (("DataParallel", "each replica's own chunk") if kind(mode).one_process
                  else (mode.upper(), "each rank's own shard"))
    term = (f"a term of the loss computed inside {where} that {name} does not train as one device does: "
            f"an auxiliary loss (a mixture-of-experts load-balancing loss: transformers' output_router_logits, "
            f"router_aux_loss_coef; a regulariser over the batch) computed from {part}, or multiplied "
            f"by the world size along with the loss it is added to (transformers' Trainer scales the model's whole "
            f"loss, auxiliary term included, by the number of processes when it averages tokens across devices); "
            f"scale only the loss normalised over the global batch by the world size, and compute the term's "
            f"statistics over the whole batch (all-reduce them) if the objective must be one device's, or check "
            f"the model without the term")
    evidence = (f"evidence: the gradient backward starts from, and every module's output gradient down to {where}, "
                f"agree with the reference's; its input gradient differs")
    if first.kind == "loss" and first.step == best.step == 0:
        return f"likely cause: {term}; {evidence}, and so does the loss"
    return (f"candidate causes: {term}; or a backward of {where} that differs from one device's (a backward hook "
            f"or custom autograd function that scales or depends on the rank or world size); {evidence}")


def scale_placed(cause: str, phase: str, factor: float | None, world_size: int, mode: str) -> str | None:
    """The uniform gradient scale of :func:`likely_cause` decided by where its step first
    differs (the first differing module's ``phase``): at the loss (every forward agrees and
    the gradient backward starts from is already scaled, by ``factor``) the step scaled the
    loss it gave ``backward()``; in the reduction (every rank's forward and backward agree
    with the reference's rows) a comm hook or the step scaled the gradients after backward.
    None where ``cause`` is not that signature or the place decides nothing."""
    if not cause.startswith("likely cause: ") or SAME_FACTOR not in cause or phase not in ("loss", "reduction"):
        return None
    head = cause[:cause.index(")") + 1]  # likely cause: all 6 gradients are scaled ... (relative error ..., the loss matches)
    name = mode.upper()
    if phase == "loss":
        by = f" ({factor:.3g}x the reference's)" if factor is not None else ""
        over_w = factor is not None and abs(factor * world_size - 1) <= SIGNATURE_REL_TOL
        what = (f"a loss divided by the world size before backward ((loss / world_size).backward()), which {name} "
                f"already averages over the ranks; backward the mean loss itself" if over_w else
                "a loss scaled before backward(); backward the loss the step returns (a loss scale, such as "
                "GradScaler's, must be undone before the optimizer steps)")
        return (f"{head}: the loss the step gave backward() is scaled, not the one it returns: {what}; evidence: "
                f"every module's forward agrees and the gradient backward starts from (the loss's) differs "
                f"already{by}")
    return (f"{head}: the gradients were scaled after every rank's backward, by a comm hook (one that forgets to "
            f"divide the all-reduced sum by the world size, or scales by another factor) or by the step between "
            f"backward() and optimizer.step(); divide the sum by the world size once, and scale nothing else; "
            f"evidence: every rank's forward and backward agree with the reference's rows, the reduced gradients "
            f"do not")


def fewer_forwards(best: ModuleFinding, world_size: int, mode: str) -> str:
    """Every forward agrees and the loss's gradient differs (``best``), on a rank that ran
    another number of forwards of the model in the step than one device (``best.forwards``):
    a step that divides by a fixed number of micro-batches while a rank's smaller share makes
    fewer (``x.chunk(k)`` of fewer than ``k`` samples). Likely where the gradient's factor is
    the ratio of the counts."""
    mine, one = best.forwards or (0, 0)
    fits = best.factor is not None and one and abs(best.factor * one / mine - 1) <= SIGNATURE_REL_TOL
    head = "likely cause" if fits else "candidate causes"
    by = f" (the gradient backward starts from is {best.factor:.3g}x the reference's)" if best.factor is not None else ""
    return (f"{head}: the step ran {mine} forward(s) of the model on rank {best.rank} and {one} on one device{by}: "
            f"micro-batches made from each rank's share of the batch, whose count changes with the share's size "
            f"(x.chunk(k) of fewer than k samples makes fewer, and so does a fixed micro-batch size), while each "
            f"micro-batch's loss is divided by a fixed count; divide by the number of micro-batches the step "
            f"actually made (and weight each by its samples), or give every {mode.upper()} rank at least as many "
            f"samples as micro-batches (a global batch of at least {world_size} x the micro-batch count)")


def per_shard_denominator(ratio: float | None, factor: float | None, world_size: int, mode: str,
                          step: int = 0) -> str | None:
    """The loss first differs (at ``step``, every step before it agreeing) at the loss itself
    (every module's forward agrees; the gradient backward starts from is ``factor`` x the
    reference's, not 1/W), and it is a mean (the probe's ``ratio``: 1x for step 0's batch given
    twice): a mean whose denominator, or a selection whose threshold, each rank takes from its
    own shard. None where the probe says otherwise or nothing."""
    if ratio is None or abs(ratio - 1) > PROBE_REL_TOL:
        return None
    if factor is not None and abs(factor * world_size - 1) <= SIGNATURE_REL_TOL:
        return None  # 1/W: named by the loss's own signatures
    by = f" (the gradient backward starts from is {factor:.3g}x the reference's)" if factor is not None else ""
    at = f" at step {step}, every step before it agreeing," if step else ""
    return (f"candidate causes:{at} every module's forward agrees and the loss differs{by}, and the loss is a mean "
            f"(on one device the first batch given twice gives {ratio:.3g}x its loss): a mean whose denominator each "
            f"rank takes from its own shard — cross_entropy with class weights (weight=...: it divides by the sum of "
            f"the shard's labels' weights), valid entries counted per rank, a normalisation by a statistic of the "
            f"shard — or a selection made within the shard (the hardest samples: the top-k of the losses, online hard "
            f"example mining; in-batch negatives); {mode.upper()} averages the ranks' means, which is not the mean "
            f"over the batch: sum the loss (reduction='sum'), divide by the whole batch's denominator (all-reduced) "
            f"and multiply by the world size; select over the whole batch (all-gather the per-sample losses)")


FACTOR_TOL = 1e-3
"""How near the world size a step-0 update's factor must be to read as lr x W."""
DIRECTION_HEADROOM = 4.0
"""How many times the twin's own departure from one factor a run's update may show."""
ONE_FACTOR_CAP = 1e-2
"""The most the twin's noise may widen :data:`ONE_FACTOR` and :data:`FACTOR_TOL` to: a bf16
autocast's AdamW twin left 1 - cos^2 = 0.1, wide enough to read a rank-local learning rate
(x3 on one rank of two: 0.2) as one factor."""
ONE_FACTOR = 1e-5
"""1 - cos^2 of the run's step-0 update against the reference's below which every parameter
moved by one factor (the dot products' float32 rounding leaves ~1e-7; an angle of 0.2
degrees)."""


def changed_in_the_step(differing: list[str], changed: dict[str, str], mode: str, likely: bool = True) -> str | None:
    """The step changed some of the parameters that differ in place outside
    ``optimizer.step()`` (``changed``: by name, with what holds them): that change, made by
    each rank from its own shard (or lost), is the cause — ``likely`` where the parameters
    differ first with every module and gradient agreeing, a candidate where nothing else was
    named."""
    names = list(dict.fromkeys(n for n in differing if n in changed))
    if not names:
        return None
    held = ", ".join(f"{n!r} ({changed[n]})" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    head = f"{'likely cause' if likely else 'candidate causes'}: the step changes {held} in place outside optimizer.step()"
    name = "DataParallel" if kind(mode).one_process else mode.upper()
    if any("max_norm=" in changed[n] for n in names):
        where = (f"each {name} rank renormalises the weight it gathered from the shards, which it frees after the "
                 f"forward: the shards stay as they were" if kind(mode).sharded else
                 f"each {name} rank renormalises only the rows its own shard's samples look up, other rows than one "
                 f"device does" if kind(mode).replicated else
                 "DataParallel renormalises, on every device but the first, a copy of the weight (its broadcast "
                 "replica, dropped after the forward): only the rows the first device's samples look up stay "
                 "renormalised")
        return (f"{head}: an embedding's max_norm renormalises, in its forward, the rows the batch looks up, and "
                f"{where}; drop max_norm and bound the looked-up vectors instead (F.normalize, or a clamp of their "
                f"norm: no in-place change to the weight), or renormalise the rows of the whole batch on every rank")
    if kind(mode).sharded:
        return (f"{head} (in its forward or in the step's own code): in the forward each {name} rank changes the "
                f"parameter it gathered from the shards, which it frees after the forward, so the change is lost; keep "
                f"such state in a buffer (register_buffer), made from the whole batch (all-reduce what it depends on), "
                f"or leave the parameters to the optimizer")
    return (f"{head} (in its forward or in the step's own code): where that change depends on the batch (a statistic, "
            f"the rows or samples it saw), each {name} {'rank' if kind(mode).replicated else 'replica'} makes it "
            f"from its own shard, not from the whole batch as one device does; make it from the whole batch "
            f"(all-reduce what it depends on), or leave the parameters to the optimizer")


def after_the_gradients(step: int, world_size: int, mode: str, ranks: list[int],
                        update: tuple[float, float] | None = None, noise: tuple[float, float] | None = None) -> str:
    """The parameters differ first (on ``ranks``), after a step whose every module's output
    and gradient agreed with the reference on every rank: the update itself differs; where
    every parameter moved by one factor of the reference's step-0 move (``update``), that
    factor names it. ``noise``: the calibration twin's own (factor, 1 - cos^2), the rounding
    an optimizer that computes in bf16 leaves in a correct update's direction and size (Muon's
    twin: 0.992x, 1 - cos^2 = 0.03; a correct 2-rank FSDP run 0.005), which widens both bounds,
    to at most :data:`ONE_FACTOR_CAP`. Under a sharded mode the ranks' shards differ in size,
    so some may fall under their tolerance while the whole update is one factor."""
    one, near = ONE_FACTOR, FACTOR_TOL
    if noise is not None:
        one = min(max(one, DIRECTION_HEADROOM * noise[1]), ONE_FACTOR_CAP)
        near = min(max(near, DIRECTION_HEADROOM * abs(1 - noise[0])), ONE_FACTOR_CAP)
    every = len(ranks) in (0, world_size) or kind(mode).sharded
    if step == 0 and update is not None and update[1] < one and every:
        factor, name = update[0], mode.upper()
        evidence = (f"evidence: with the same gradients every parameter moved {factor:.4g}x as far as on one device "
                    f"in step 0 (the update's direction the same to 1 - cos^2 = {update[1]:.1e})")
        if abs(factor - world_size) <= near * world_size:
            return (f"likely cause: the learning rate multiplied by the world size ({world_size}), the linear "
                    f"scaling rule, on a global batch that did not grow: ddparity keeps the global batch, so "
                    f"{world_size} {name} ranks must train with one device's rate; scale it where the global batch "
                    f"grows, not with the ranks; {evidence}")
        if abs(factor - 1) > near:
            return (f"likely cause: a learning rate (or another factor of the update) {factor:.4g}x one device's, "
                    f"one that depends on the world size or the rank; {evidence}")
    head = (f"candidate causes: at step {step} every gradient agrees and the parameters differ after the optimizer "
            f"step, so the update itself differs")
    if 0 < len(ranks) < world_size:
        return (f"{head}, on rank(s) {ranks} only: parameters changed there outside the optimizer (a nudge, a clamp, "
                f"an update written by hand on some ranks), or an optimizer whose state or settings differ on those "
                f"ranks")
    return (f"{head}: a learning rate (or another optimizer setting) that depends on the world size or the rank — the "
            f"linear scaling rule (lr x world size) among them: ddparity keeps the global batch, so {world_size} "
            f"{mode.upper()} ranks must train with one device's rate; scale it where the global batch grows, not "
            f"with the ranks — or parameters changed outside the optimizer (a clamp, an update written by hand) "
            f"differently than on one device")
