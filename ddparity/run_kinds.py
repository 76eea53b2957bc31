"""The kinds of run ddparity knows, declared once: what each mode is, what it takes, when
it cannot run and how it is written in a note or a reproduce line.

Everything that differs between modes outside the rank code that trains them is a field
or a method of a :class:`RunKind` here; the rest of the package asks the row
(``kind(run.mode).sharded``), never compares a mode's name to a literal (a layout test
pins it). One rank task trains every replicated kind,
:func:`ddparity.harness.ranks.tasks.replica_task`, by its row (DDP, or FSDP2 on the row's
mesh); simulated ranks run that same task, handed to them
(:func:`ddparity.harness.ranks.threaded.threaded_task`).
Adding a mode: a mode file under ``harness/ranks/modes``, its task, a row here, fixtures
and docs (docs/architecture.md, "Adding a mode").
"""

from __future__ import annotations

from dataclasses import dataclass

from ddparity.errors import UsageError


@dataclass(frozen=True, slots=True)
class RunKind:
    """One mode: its name (``--modes``), what it is, and how it runs."""

    name: str
    title: str
    """What it is, in a phrase (for a reader of the table)."""
    reference: bool = False
    """The one-device run every other is compared with (trained once per check)."""
    one_process: bool = False
    """Its replicas live in one process (DataParallel): one world of one rank serves every
    world size, and torchrun has nothing to launch."""
    replicated: bool = False
    """Every rank is a process of the world, one run per world size (ddp, fsdp, hsdp); dp
    runs its replicas inside one process, single is the one-device reference."""
    sharded: bool = False
    """FSDP2: each rank holds shards of the parameters and the optimizer state."""
    mesh: bool = False
    """Runs on a (replicate, shard) mesh of W / S replicas of S shards (``--hsdp-shard``)."""
    buckets: bool = False
    """Gradients all-reduced by DDP's reducer, bucket by bucket (its ``bucket_cap_mb``, its
    comm hook, torch.compile's DDP optimizer)."""
    broadcasts_buffers: bool = False
    """Rank 0's buffers broadcast to every rank at each forward (DDP's ``broadcast_buffers``)."""

    def shard_size(self, world_size: int, hsdp_shard: int) -> int:
        """S, the ranks each parameter is split across (0 where nothing is sharded)."""
        if not self.sharded:
            return 0
        return hsdp_shard if self.mesh else world_size

    def skip_reason(self, world_size: int, hsdp_shard: int) -> str | None:
        """Why a run at ``world_size`` cannot happen, whatever the machine (None: it can)."""
        if self.mesh and world_size % hsdp_shard:
            return (f"{self.name}'s (replicate, shard) mesh needs a world size divisible by the shard size "
                    f"{hsdp_shard}; use --hsdp-shard with a divisor of {world_size} (1 and {world_size} included)")
        return None

    def mesh_note(self, world_size: int, hsdp_shard: int) -> str | None:
        """The run's note on its mesh (None where it has none to tell)."""
        if not self.mesh:
            return None
        return f"{self.name} mesh: {world_size // hsdp_shard} replica(s) x {hsdp_shard} shard(s)"

    def cli_flags(self, hsdp_shard: int | None) -> str:
        """What a CLI reproduce line adds for this kind's own options."""
        return f" --hsdp-shard {hsdp_shard}" if self.mesh and hsdp_shard else ""

    def call_args(self, hsdp_shard: int | None) -> str:
        """What a Python reproduce line (``ddparity.check(...)``) adds for them."""
        return f", hsdp_shard={hsdp_shard}" if self.mesh and hsdp_shard else ""


KINDS = (
    RunKind("single", "one device, the whole global batch (the reference)", reference=True),
    RunKind("dp", "torch.nn.DataParallel (replicas in one process; emulated without GPUs)", one_process=True),
    RunKind("ddp", "DistributedDataParallel", replicated=True, buckets=True, broadcasts_buffers=True),
    RunKind("fsdp", "FSDP2 (fully_shard) on a 1-D mesh of every rank", replicated=True, sharded=True),
    RunKind("hsdp", "FSDP2 on a (replicate, shard) mesh", replicated=True, sharded=True,
            mesh=True),
)
"""Every mode, in the order runs are planned and reported."""

_BY_NAME = {k.name: k for k in KINDS}

MODES = tuple(k.name for k in KINDS)
"""Ways to train a Case (``--modes``)."""
REPLICA_MODES = tuple(k.name for k in KINDS if k.replicated)
"""The modes whose every rank is a process of the world (a run per world size)."""
SHARDED_MODES = tuple(k.name for k in KINDS if k.sharded)
"""FSDP2's modes: each rank holds shards of the parameters and optimizer state."""
REFERENCE_MODE = next(k.name for k in KINDS if k.reference)
"""The one-device mode every other run is compared with."""
FLAT_SHARDED_MODE = next(k.name for k in KINDS if k.sharded and not k.mesh)
"""The sharded mode on a 1-D mesh: how the user's FSDP set-up runs on one rank (its
MixedPrecisionPolicy's noise alone, the sharded runs' noise floor)."""


def asked(modes: tuple[str, ...] | list[str], flag: str) -> list[str]:
    """The modes among ``modes`` whose row has ``flag`` set (``asked(opts.modes, "sharded")``)."""
    return [m for m in modes if getattr(kind(m), flag)]


def kind(name: str) -> RunKind:
    """The row of mode ``name``; a :class:`UsageError` naming the modes for any other."""
    found = _BY_NAME.get(name)
    if found is None:
        raise UsageError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    return found
