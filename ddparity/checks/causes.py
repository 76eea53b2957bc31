"""Why, not only what: when a DDP run's divergence has a signature we know, the one line
that names the likely cause and its fix.

* a summed loss (``reduction="sum"``): DDP averages the ranks' gradients, so each rank's
  sum over its shard trains on 1/W of the single-device objective — the recorded loss (the
  mean of the ranks' losses) is off by exactly ``1 - 1/W`` at the first step;
* BatchNorm on shards: each rank normalises its shard with its own statistics — the
  running statistics differ from the first step on.
"""

from __future__ import annotations

from ddparity.verdicts import Divergence

SIGNATURE_REL_TOL = 1e-3
"""How close the loss's relative error must be to ``1 - 1/W`` to name a summed loss (a
correct run is ~1e-7 away from the reference; other bugs land anywhere)."""

BATCHNORM_STATISTICS = ("running_mean", "running_var")


def likely_cause(found: list[Divergence], world_size: int) -> str | None:
    """The likely cause of a DDP run's divergences (in the order they happened), or None."""
    if not found or world_size < 2:
        return None
    first = found[0]
    off_by = 1 - 1 / world_size
    if first.kind == "loss" and first.step == 0 and abs(first.max_rel - off_by) <= SIGNATURE_REL_TOL:
        return (f"likely cause: a loss summed over the batch (reduction='sum'): the loss is off by exactly "
                f"1 - 1/{world_size} = {off_by:g}, because DDP averages the ranks' gradients and each rank's sum "
                f"covers 1/{world_size} of the batch; use reduction='mean' (or multiply the loss by the world size)")
    statistics = [d for d in found if d.step == first.step and d.kind == "buffer"
                  and d.name.rsplit(".", 1)[-1] in BATCHNORM_STATISTICS]
    if statistics:
        layer = statistics[0].name.rsplit(".", 1)[0]
        return (f"likely cause: BatchNorm on shards ({layer}): each rank normalises its shard with its own "
                f"statistics; use torch.nn.SyncBatchNorm.convert_sync_batchnorm (GPUs), GroupNorm or LayerNorm, "
                f"or BatchNorm in eval mode")
    return None
