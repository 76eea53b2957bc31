"""Why, not only what: when a DDP run's divergence has a signature we know, the one line
that names the likely cause and its fix.

* a summed loss (``reduction="sum"``): DDP averages the ranks' gradients, so each rank's
  sum over its shard trains on 1/W of the single-device objective — the recorded loss (the
  mean of the ranks' losses) is off by exactly ``1 - 1/W`` at the first step. A mean loss
  divided by the world size on every rank leaves the same numbers; a probe of the reference
  (:mod:`ddparity.harness.ranks.probes`: its first batch given twice doubles a sum and leaves
  a mean) tells them apart, and the line says so; without it, both are named as candidates;
* BatchNorm on shards: each rank normalises its shard with its own statistics — the
  running statistics differ from the first step on;
* a gradient scaled on its way (a comm hook that forgets to divide by W, or scales by a
  wrong factor): the loss matches, and (nearly) every gradient is off by the same relative
  error — counted by tensor, not by the ranks that report it;
* a desync's causes (a missed sync, part of a step around DDP, rank-local state):
  :mod:`ddparity.checks.desync_causes`;
* a per-rank normalisation: the loss differs at the first step and the batch's valid
  entries (labels not -100, mask ones) are not spread evenly over the shards — each
  rank's mean over its own valid entries, averaged by DDP, is not the mean over the batch.
"""

from __future__ import annotations

from collections.abc import Callable

from ddparity.checks.desync_causes import MISSED_SYNC_SHARE, desync_cause
from ddparity.records import GATHERED_WITH_GRAD, GATHERS, Entry, parse_ledger
from ddparity.run_kinds import kind
from ddparity.verdicts import Desync, Divergence

SIGNATURE_REL_TOL = 1e-3
"""How close the loss's relative error must be to ``1 - 1/W`` to name a summed loss (a
correct run is ~1e-7 away from the reference; other bugs land anywhere), or two ulps of the
precision the run computed in where those are more (a bf16 loss divided by W came 0.498 off
at 2 ranks, not 0.5: its cause went unnamed)."""

PROBE_REL_TOL = 1e-2
"""How close the probe's ratio (the loss on the first batch given twice, to its loss) must be
to 2 (a sum) or 1 (a mean) to decide (a float32 loss lands within ~1e-6; dropout aligned
per sample keeps it so)."""

BATCHNORM_STATISTICS = ("running_mean", "running_var")
OWN_VALID_ENTRIES = ("likely cause: a loss averaged over each rank's own valid entries",
                     "likely cause: a loss averaged over each replica's own valid entries")
"""The heads of the per-rank (per-replica) token-mean causes: read from the loss's numbers and
the batch's padding, contradicted where the loss's own gradient agrees (:mod:`ddparity.checks.placed`)."""
SAME_FACTOR = "are scaled by the same factor"
UNIFORM_SCALE_TOL = 1e-2
"""How close every gradient's relative error must be to one another to call it one factor."""
def likely_cause(found: list[Divergence], world_size: int, desync: Desync | None = None,
                 params: int = 0, valid: dict[str, list[int]] | None = None,
                 layer_types: dict[str, str] | None = None, mode: str = "ddp",
                 unsharded: list[str] | None = None,
                 loss_scaling: Callable[[], float | None] | None = None,
                 forwards: list[dict[int, tuple[int, int]] | None] | None = None,
                 hook_collectives: int | None = None, eps: float = 0.0,
                 gathered: list[str] | None = None,
                 bypassed: list[dict[int, list[str]] | None] | None = None) -> str | None:
    """The likely cause of a DDP run's divergences (in the order they happened) or of its
    desync (``params``: how many parameters the model has; ``valid``: the first batch's
    valid entries per sample, by tensor; ``layer_types``: the class of each layer with
    running statistics, by name; ``mode``: ddp, fsdp or hsdp, as the text names it;
    ``unsharded``: under FSDP, the parameters left out of sharding; ``loss_scaling``: asked
    only where a summed loss and a loss divided by W both fit, the probe's ratio of the loss
    on the first batch given twice to its loss, None where it has none; ``forwards``: each
    rank's count of DDP's forwards per step, and of those with sync on; ``hook_collectives``:
    with a comm hook of the case's, the collectives it issued at step 0 over the ranks'
    ledgers; ``eps``: the ulp of the precision the run computed in; ``gathered``: where the
    step all-gathered a tensor that requires grad with nothing sent back in backward, from
    :func:`gathered_without_grad`; ``bypassed``: each rank's parameters, per step, whose
    gradient came from a backward no DDP forward with sync on preceded), or None."""
    if desync is not None:
        return (desync_cause(desync, params, forwards or [], hook_collectives, bypassed or [])
                if world_size > 1 else None)
    if not found:
        return None
    first = found[0]
    grads = [d for d in found if d.step == first.step and d.kind == "grad"]
    names = {d.name for d in grads}  # each rank reports its own copy of a tensor (or shard)
    sharded = _sharded_cause(first, grads, names, params, mode, unsharded or [])
    if sharded or world_size < 2:
        return sharded
    if first.kind == "optimizer":
        ranks = sorted({d.rank for d in found if d.step == first.step and d.kind == "optimizer"})
        return (f"likely cause: the optimizer's state differs on rank(s) {ranks} while the loss, gradients and "
                f"parameters of step {first.step} match: state lost or reset there (a resume that restored the "
                f"weights but not the optimizer), or an optimizer stepping other tensors than the model's")
    off_by = 1 - 1 / world_size
    types = layer_types or {}
    layers = [f"{name} ({types[name]})" if name in types else name
              for name in dict.fromkeys(d.name.rsplit(".", 1)[0] for d in found if d.kind == "buffer"
                                        and d.name.rsplit(".", 1)[-1] in BATCHNORM_STATISTICS)]
    if first.kind == "loss" and first.step == 0 and abs(first.max_rel - off_by) <= max(SIGNATURE_REL_TOL, 2 * eps):
        also = (f"; BatchNorm statistics differ too ({_first_few(layers)}): BatchNorm on shards may remain once "
                f"the loss is fixed, check again" if layers else "")
        return _loss_one_over_w(world_size, mode, loss_scaling() if loss_scaling else None) + also
    statistics = [d for d in found if d.step == first.step and d.kind == "buffer"
                  and d.name.rsplit(".", 1)[-1] in BATCHNORM_STATISTICS]
    if first.kind == "buffer" and not statistics and not any(
            d.step == first.step and d.kind in ("loss", "grad", "param") for d in found):
        return _buffer_from_the_shard(first, mode)
    if statistics:
        return (f"likely cause: BatchNorm on shards ({_first_few(layers)}): each rank normalises its shard with its own "
                f"statistics; use torch.nn.SyncBatchNorm.convert_sync_batchnorm (GPUs), GroupNorm or LayerNorm, "
                f"or BatchNorm in eval mode")
    if first.kind == "grad" and len(names) >= 2 and (not params or len(names) >= MISSED_SYNC_SHARE * params):
        # a tensor's error: the largest over the ranks (under FSDP each holds a shard of it)
        whole: dict[str, float] = {}
        for d in grads:
            whole[d.name] = max(whole.get(d.name, 0.0), d.max_rel)
        rels = list(whole.values())
        if max(rels) - min(rels) <= UNIFORM_SCALE_TOL * max(rels):
            hint = f" (an unaveraged sum is off by {world_size - 1:g}, a double division by {1 - 1 / world_size:g})"
            share = f"all {len(names)} gradients" if len(names) >= params else f"{len(names)} of {params} gradients"
            if gathered and abs(rels[0] - off_by) <= max(SIGNATURE_REL_TOL, 2 * eps):
                return _gathered_cause(share, rels[0], world_size, mode, gathered)
            return (f"likely cause: {share} {SAME_FACTOR} (relative error {rels[0]:.3g} in "
                    f"each, the loss matches){hint}: a comm hook or step that scales the averaged gradient, such "
                    f"as a hook that forgets to divide the all-reduced sum by the world size; DDP's gradient is the "
                    f"mean over ranks: divide the sum by the world size once, and scale nothing else")
    if gathered:
        return _gathered_cause(None, 0.0, world_size, mode, gathered)
    if first.kind == "loss" and first.step == 0:
        return _uneven_valid_entries(valid or {}, world_size, mode) or _not_per_sample(
            loss_scaling() if loss_scaling else None, mode)
    return None


def _not_per_sample(ratio: float | None, mode: str) -> str | None:
    """The loss differs at step 0 and the probe's ``ratio`` (the first batch given twice, on
    one device) is neither a mean's 1x nor a sum's 2x: the loss is no per-sample mean or
    sum, so each rank's loss over its shard is another objective."""
    if ratio is None or abs(ratio - 1) <= PROBE_REL_TOL or abs(ratio - 2) <= PROBE_REL_TOL * 2:
        return None
    return (f"likely cause: the loss is not a mean or sum over samples: on one device the first batch given twice "
            f"gives {ratio:.3g}x its loss (a mean over samples gives 1x, a sum 2x), so a rank's loss over its shard "
            f"is another objective than the loss over the batch: a loss that couples the samples of a batch (a "
            f"contrastive loss with in-batch negatives, a loss over batch statistics) computed on each rank's shard "
            f"alone, or a term that does not grow with the batch added to a summed loss; under {mode.upper()}, "
            f"gather what the loss contrasts across ranks with torch.distributed.nn.functional.all_gather (its "
            f"backward returns each rank its gradient; open_clip's gather_with_grad=True), or add such a term once "
            f"per batch, not once per rank")


def gathered_without_grad(entries: list[Entry], step: int) -> list[str]:
    """Where the user's step all-gathered a tensor that requires grad at ``step`` (one rank's
    ledger ``entries``, in order) with no collective of its own after it before the optimizer:
    nothing sent the gathered copies' gradients back (``torch.distributed.nn``'s all-gather,
    ``via`` it, does in backward; FSDP2's own calls are ``via`` FSDP2). Empty where that is not so."""
    mine = [e for e in entries if e.step == step and not e.via and not e.site.startswith("ddparity/harness/")
            and e.phase != "optimizer"]
    first = next((i for i, e in enumerate(mine) if e.op in GATHERS and e.desc.endswith(GATHERED_WITH_GRAD)), None)
    if first is None or any(e.op not in GATHERS for e in mine[first:]):
        return []
    return list(dict.fromkeys(e.site for e in mine[first:] if e.desc.endswith(GATHERED_WITH_GRAD)))


def gathered_on_every_rank(ledgers: list[str], found: list[Divergence]) -> list[str]:
    """Where the first divergence's step all-gathered, on every rank (their ledgers' text), a
    tensor that requires grad with nothing sent back in backward (:func:`gathered_without_grad`)."""
    if not found or not ledgers:
        return []
    each = [gathered_without_grad(parse_ledger(text), found[0].step) for text in ledgers]
    return each[0] if all(each) else []


def _gathered_cause(share: str | None, rel: float, world_size: int, mode: str, sites: list[str]) -> str:
    """The step all-gathered a tensor that requires grad and nothing answered it in backward,
    with every gradient at 1/W and the loss matching (``share``: how many gradients): a loss
    over the whole batch's features gathered without their gradient (open_clip's ClipLoss
    without ``gather_with_grad``); without ``share`` the gradients differ otherwise."""
    where = (f"({'; '.join(sites[:2])}: a tensor that requires grad, and no collective in backward to send the "
             f"gradients of the gathered copies back)")
    fix = ("gather with torch.distributed.nn.functional.all_gather, whose backward returns each rank the gradient "
           "of its copy (open_clip's gather_with_grad=True)")
    if share is None:
        return (f"likely cause: the loss uses tensors all-gathered without their gradient {where}: the gradient "
                f"that reaches each rank misses what the loss sends through the other ranks' copies; {fix}")
    return (f"likely cause: {share} are 1/{world_size} of the reference's (relative error {rel:.3g} in each, the "
            f"loss matches): the loss is computed on tensors all-gathered without their gradient {where}: each "
            f"rank's backward reaches only its own samples' part, and {mode.upper()}'s average over the ranks leaves "
            f"1/{world_size} of the one-device gradient (open_clip's ClipLoss without gather_with_grad); {fix}, or "
            f"multiply the loss by the world size; if what you gathered does not reach the loss, look for a loss "
            f"divided by the world size before backward")


def _loss_one_over_w(world_size: int, mode: str, ratio: float | None) -> str:
    """The loss and the gradients at 1/W of the reference's: a summed loss, or a mean loss
    divided by the world size, as the probe's ``ratio`` says (both candidates without it)."""
    off_by = 1 - 1 / world_size
    summed = (f"a loss summed over the batch (reduction='sum'): the loss is off by exactly 1 - 1/{world_size} = "
              f"{off_by:g}, because {mode.upper()} averages the ranks' gradients and each rank's sum covers "
              f"1/{world_size} of the batch; use reduction='mean' (or multiply the loss by the world size)")
    divided = (f"a mean loss divided by the world size on every rank (loss / ctx.world_size, or a rank's sum divided "
               f"by the whole batch's count, as transformers' num_items_in_batch is): the loss and every gradient are "
               f"1/{world_size} of the single-device run's, because {mode.upper()} already averages the ranks' "
               f"gradients; drop the division (or multiply such a loss by the world size)")
    found = f" (the probe found {ratio:.3g}x, neither a sum's 2x nor a mean's 1x)" if ratio is not None else ""
    return _sum_or_mean(ratio, summed, divided, f"candidate causes, the loss off by exactly 1 - 1/{world_size} = "
                                                f"{off_by:g} at step 0 fits both{found}: {summed}; or {divided}")


def _sum_or_mean(ratio: float | None, summed: str, divided: str, undecided: str) -> str:
    """``summed`` or ``divided`` as the likely cause where the probe's ``ratio`` (the first
    batch given twice, on one device) says a sum (2x) or a mean (1x); else ``undecided``."""
    if ratio is not None and abs(ratio - 2) <= PROBE_REL_TOL * 2:
        return (f"likely cause: {summed}; evidence: on one device, the first batch given twice gives {ratio:.3g}x "
                f"its loss (a sum doubles, a mean stays)")
    if ratio is not None and abs(ratio - 1) <= PROBE_REL_TOL:
        return (f"likely cause: {divided}; evidence: on one device, the first batch given twice gives {ratio:.3g}x "
                f"its loss (a mean, not a sum: a sum would double)")
    return undecided


def _buffer_from_the_shard(first: Divergence, mode: str) -> str:
    """A buffer other than BatchNorm's differs first, the step's loss, gradients and parameters
    matching: updated in the step from each rank's own shard and never combined."""
    name = mode.upper()
    broadcast = (f" ({name} broadcasts rank 0's buffers at each forward: the other ranks' updates are lost)"
                 if kind(mode).broadcasts_buffers else "")
    return (f"likely cause: buffer '{first.name}' differs first (step {first.step}) while the loss, every gradient "
            f"and every parameter match: it is updated from each rank's own shard (a running statistic of the "
            f"batch: DINO's teacher center, an EMA of batch statistics; a queue of the batch's features, MoCo's), "
            f"which {name} neither averages nor gathers{broadcast}; compute it over the whole batch as one "
            f"device does: all-reduce the statistic's sum and count (all-gather the features a queue takes in) "
            f"before updating the buffer")


def _first_few(names: list[str], limit: int = 3) -> str:
    """The first layers named, the rest counted (the JSON report's divergences list every
    tensor)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _sharded_cause(first: Divergence, grads: list[Divergence], names: set[str], params: int, mode: str,
                   unsharded: list[str]) -> str | None:
    """FSDP's own signatures: a gradient left out of sharding never reduced; no gradient
    reaching the optimizer because the sync stayed off."""
    if not kind(mode).sharded or first.kind != "grad":
        return None
    left_out = sorted(n for n in names if n in unsharded)
    if left_out and first.name in unsharded:
        return (f"likely cause: {', '.join(left_out)} left out of sharding (ignored_params): FSDP2 neither shards "
                f"nor reduces them, so each rank keeps the gradient of its own share of the batch; all-reduce their "
                f"gradients yourself and divide by the world size (a post-accumulate-grad hook), or shard them")
    missing = {d.name for d in grads if d.mismatch and d.mismatch.startswith("missing")}
    if first.step == 0 and missing and len(missing) >= MISSED_SYNC_SHARE * max(params, 1):
        replicas = (" or, in HSDP, its all-reduce across replicas (set_requires_all_reduce(False): FSDP2 then keeps "
                    "the partial gradient for a later all-reduce)") if kind(mode).mesh else ""
        return (f"likely cause: no gradient reached the optimizer ({len(missing)} of {params} missing at step 0): "
                f"{mode.upper()}'s gradient sync was off (set_requires_gradient_sync(False), ctx.no_sync()){replicas} "
                f"through the last backward, so no gradient reached the sharded parameters; turn it back on before "
                f"the last micro-batch's backward")
    return None


def _uneven_shares(valid: dict[str, list[int]], world_size: int) -> tuple[str, str] | None:
    """The first batched tensor whose valid entries (``valid``: per sample) are not spread
    evenly over ``world_size`` equal, contiguous shares: its path and the shares' counts."""
    for path, counts in valid.items():
        if len(counts) % world_size:
            continue
        per = len(counts) // world_size
        totals = [sum(counts[r * per:(r + 1) * per]) for r in range(world_size)]
        if len(set(totals)) > 1:
            return path, ", ".join(map(str, totals[:4])) + (", ..." if len(totals) > 4 else "")
    return None


def _uneven_valid_entries(valid: dict[str, list[int]], world_size: int, mode: str = "ddp") -> str | None:
    uneven = _uneven_shares(valid, world_size)
    if uneven is None:
        return None
    path, shown = uneven
    return (f"{OWN_VALID_ENTRIES[0]}: {path} has {shown} valid "
            f"entries on the ranks' shards (labels not -100, mask ones), and {mode.upper()} averages the ranks' means, "
            f"which is not the mean over the batch; sum the loss, divide by the count of the whole batch "
            f"(all-reduce it; transformers: num_items_in_batch) and multiply by the world size (in a "
            f"Case's train_step: ctx.world_size)")


def replica_cause(found: list[Divergence], replicas: int, valid: dict[str, list[int]],
                  loss_scaling: Callable[[], float | None] | None = None) -> str | None:
    """The likely cause of a DataParallel run's divergence (``replicas``: its devices): the
    model's own loss, a mean over each replica's valid entries, averaged over the replicas
    (``out.loss.mean()`` of what DataParallel gathers) while the entries are not spread evenly
    over the replicas' chunks; a loss 1/W of one device's (sums averaged, or a division by W:
    the probe, ``loss_scaling``, decides) or W times it."""
    if not found or replicas < 2 or found[0].kind != "loss" or found[0].step != 0:
        return None
    rel = found[0].max_rel
    if abs(rel - (replicas - 1)) <= SIGNATURE_REL_TOL * replicas:
        return (f"candidate causes: the loss is {replicas}x one device's (relative error {rel:.3g}): the step sums "
                f"the per-replica losses DataParallel gathers (out.loss.sum() of means over each chunk: take "
                f".mean()), or multiplies the loss by the world size, which only DDP's average over ranks needs "
                f"(DataParallel's loss already covers the whole batch: leave it out under DataParallel)")
    if abs(rel - (1 - 1 / replicas)) <= SIGNATURE_REL_TOL:
        summed = ("the step averages the per-replica losses DataParallel gathers (out.loss.mean()) while each is a "
                  "sum over its chunk: sum them (out.loss.sum()), or compute the loss from the gathered outputs")
        divided = ("a loss divided by the world size, which only DDP's average over ranks needs: DataParallel's loss "
                   "already covers the whole batch; leave the division out under DataParallel")
        head = f"the loss is 1/{replicas} of one device's (relative error {rel:.3g})"
        return _sum_or_mean(loss_scaling() if loss_scaling else None, f"{head}: {summed}", f"{head}: {divided}",
                            f"candidate causes: {head}: {summed}; or {divided}")
    uneven = _uneven_shares(valid, replicas)
    if uneven is None:
        return None
    path, shown = uneven
    return (f"{OWN_VALID_ENTRIES[1]}: {path} has {shown} valid entries "
            f"in the replicas' chunks of the batch (labels not -100, mask ones), and the mean of the replicas' losses "
            f"(out.loss.mean() of what DataParallel gathers) is not the mean over the batch; compute the loss from "
            f"the gathered outputs (logits) outside the model, or have each replica sum its loss and divide the "
            f"gathered sum by the whole batch's count")
