"""What ranks measure and send back, as plain data: the profile's step and bucket
timings (:mod:`ddparity.harness.ranks.modes.timed`) and a rank's health measurements
(:mod:`ddparity.harness.health.probe`). Judged by :mod:`ddparity.checks.comm` and
:mod:`ddparity.checks.health`. A leaf module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class BucketTiming:
    """One gradient bucket's communication: the collectives its comm hook issued (op
    names), their bytes, and when it ran, in seconds from the start of the backward pass."""

    index: int
    nbytes: int
    start: float
    end: float
    ops: tuple[str, ...] = ("all_reduce",)
    group_size: int = 0
    """The ranks of the group it ran in (0: the whole world)."""
    own: bool = False
    """Issued by the training step itself (a contrastive loss's all-gather, a token count's
    all-reduce), not by DDP's buckets or FSDP."""


@dataclass(slots=True)
class StepTiming:
    """One measured iteration on one rank (seconds)."""

    sync: float
    no_sync: float
    optimizer: float
    buckets: list[BucketTiming] = field(default_factory=list)
    own_no_sync: list[BucketTiming] = field(default_factory=list)
    """The step's own collectives in the ``no_sync`` pass: communication, not compute."""


@dataclass(slots=True)
class RankProfile:
    rank: int
    world_size: int
    device: str
    samples: int  # this rank's samples per step
    steps: list[StepTiming] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes this rank held after the last step: ``params``, ``grads``, ``optimizer`` (its
    shards only, where sharded); ``peak_allocated`` on a GPU (over the measured steps)."""
    ddp_logging: dict[str, Any] = field(default_factory=dict)
    """What DDP's own logger said after the last step (``_get_ddp_logging_data()``: its
    average times in ns, bucket sizes, whether it rebuilt them); empty outside DDP."""


@dataclass(slots=True)
class PairTiming:
    """One all-reduce between two ranks alone (``--pairwise``): ``a`` and ``b`` the ranks,
    standing for their nodes where ``unit`` is ``node``; seconds the median of a few."""

    a: int
    b: int
    nbytes: int
    seconds: float
    unit: str = "rank"  # rank | node
    network_only: bool = False
    """Measured with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: through the network, never NVLink
    or shared memory."""


@dataclass(slots=True)
class RankHealth:
    rank: int
    world_size: int
    host: str
    device: str
    device_name: str
    torch_version: str
    cuda_version: str | None
    python_version: str
    barrier_s: float = 0.0
    # collective results that were wrong on this rank: "all_reduce 1000 elements: ..."
    collective_errors: list[str] = field(default_factory=list)
    matmul_max_rel_error: float = 0.0
    matmul_bits: int = 0
    """A digest of the float32 matmul's result bits (equal devices of one model give equal ones)."""
    matmul_bits_bf16: int = 0
    """The same of the bfloat16 matmul."""
    gflops: float = 0.0
    latency_s: float = 0.0
    # (bytes, seconds per all-reduce on this rank) for each size
    allreduce: list[tuple[int, float]] = field(default_factory=list)
    transfers: dict[str, Any] | str = "not measured"
    """Copy bandwidths, GB/s (:mod:`ddparity.harness.health.transfer_probe`), or why not."""
    pairs: list[PairTiming] = field(default_factory=list)
    """The pairs this rank was one end of (``--pairwise``)."""
    training: dict[str, Any] | None = None
    """Under torchrun, this rank's part of the gate's training launch: its child's exit code
    and output tail, and on rank 0 the check's runs (:mod:`ddparity.harness.launch.gate_training`)."""
    stress: dict[str, Any] | None = None
    """``--long``'s stress pass: seconds, repeats, matmul repeats whose bits differed from the
    first, all-reduces that were not exact (:mod:`ddparity.harness.health.stress_probe`)."""
    hardware: list[dict[str, Any]] | str = "not read"
    """This rank's devices as NVML reports them (:mod:`ddparity.harness.health.nvml_probe`), or why not."""
