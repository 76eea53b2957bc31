"""Communication figures from the ranks' step timings (``ddparity profile``).

Per measured step, the slowest rank sets the step's time (everyone waits for it). Over
the steps, medians. Definitions, for a world of ``n`` ranks:

* ``step_s``: forward + backward (with DDP's all-reduces) + optimizer step;
* ``compute_s``: the same without gradient synchronisation (``no_sync``);
* ``exposed_comm_s``: ``step - compute``: communication the backward pass did not hide,
  waiting for slower ranks included;
* ``comm_s``: the time the gradient buckets were in flight on a rank (the union of their
  launch-to-completion intervals, so buckets in flight together count once);
* ``overlap``: ``1 - exposed / comm``, the share of communication hidden behind compute;
* ``algbw = bytes / comm_s`` and ``busbw = algbw x 2(n-1)/n`` (the all-reduce bus
  bandwidth of nccl-tests: what each link carried; comparable across world sizes);
* ``scaling_efficiency``: strong scaling of the case's global batch against the smallest
  world size profiled in the same mode, ``(T_base x base) / (T_n x n)``; 1.0 is perfect;
* ``collectives``: per op (the training step's own, FSDP's all-gathers and reduce-scatters, HSDP's all-reduce
  across replicas, DDP's bucket all-reduces), calls and bytes a step, busy time, and bus
  bandwidth in the op's own group of ``g`` ranks: ``2(g-1)/g`` for all-reduce,
  ``(g-1)/g`` for all-gather and reduce-scatter (nccl-tests' factors);
* ``memory_per_rank``: what the largest rank held after the last step, in bytes:
  parameters, gradients and optimizer state (shards only, where sharded), and on a GPU
  the peak allocated over the measured steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from ddparity.measurements import BucketTiming, RankProfile
from ddparity.run_kinds import kind
from ddparity.verdicts import Crash, Hang, json_or_none


@dataclass(slots=True)
class WorldProfile:
    """The figures of one world size (``status`` ``ok``; else ``reason`` says why not)."""

    world_size: int
    backend: str
    mode: str = "ddp"
    status: str = "ok"
    arm: str | None = None
    """The sweep's arm (``ddp bucket 25 MB``), None where the row is the mode as the case has it."""
    bucket_cap_mb: float | None = None
    """The arm's bucket cap in MB where it sweeps one (``--bucket-cap-mb``): the plot's bucket-size curve."""
    reason: str | None = None
    device: str = "cpu"
    steps: int = 0
    samples_per_step: int = 0
    step_s: float | None = None
    step_p95_s: float | None = None
    """The 95th percentile of the measured steps (linear between the two nearest)."""
    compute_s: float | None = None
    optimizer_s: float | None = None
    exposed_comm_s: float | None = None
    comm_s: float | None = None
    overlap: float | None = None
    bytes_per_step: int | None = None
    buckets: int | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    samples_per_s: float | None = None
    scaling_efficiency: float | None = None
    collectives: list[dict[str, Any]] | None = None
    memory_per_rank: dict[str, int] | None = None
    ddp_logging: dict[str, Any] | None = None
    """DDP's own logger's figures for the same run (rank 0; :func:`ddp_logged`), beside these."""
    step_memory: int | None = None
    """A rank's memory in a step: on a GPU its peak allocated; elsewhere the state it holds
    plus the activations autograd saved in a step (:func:`step_memory`)."""
    notes: list[str] = field(default_factory=list)
    hang: Hang | None = None
    crash: Crash | None = None
    seconds: float = 0.0
    repro: str = ""

    @property
    def label(self) -> str:
        """What the table calls the row: its arm, or its mode."""
        return self.arm or self.mode

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hang"], out["crash"] = json_or_none(self.hang), json_or_none(self.crash)
        out["notes"] = list(self.notes)
        return out


SMALL_MESSAGE_BYTES = 2**20
"""Below this size a message's time is mostly latency: its bus bandwidth is not the link's."""


def busy_seconds(buckets: list[BucketTiming]) -> float:
    """Length of the union of the buckets' ``[start, end]`` intervals."""
    total, reach = 0.0, None
    for b in sorted(buckets, key=lambda b: b.start):
        if reach is None or b.start > reach:
            total += b.end - b.start
            reach = b.end
        elif b.end > reach:
            total += b.end - reach
            reach = b.end
    return total


def bus_factor(world_size: int, op: str = "all_reduce") -> float:
    """Bus bandwidth / algorithm bandwidth of ``op`` in a group of ``world_size`` ranks
    (nccl-tests': ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter)."""
    share = (world_size - 1) / world_size
    return 2.0 * share if op == "all_reduce" else share


def by_op(profiles: list[RankProfile], steps: int) -> list[dict[str, Any]]:
    """Each collective op's calls, bytes and busy time a step in groups of one size (medians
    over the steps; the busiest rank's time in each step), its algorithm and bus bandwidth
    in that group size. One op in groups of two sizes is two rows: HSDP all-reduces the
    gradients in its replica groups and a step's loss or token count across the world, and a
    1-rank replica group (a mesh of one replica) moves nothing over a link."""
    out = []
    world = len(profiles)

    def key(b: BucketTiming) -> tuple[bool, str, int]:
        return b.own, b.ops[0], b.group_size or world

    last = profiles[0].steps[steps - 1].buckets
    for own, op, group in sorted({key(b) for b in last if b.ops}):
        mine = [[[b for b in p.steps[k].buckets if b.ops and key(b) == (own, op, group)] for p in profiles]
                for k in range(steps)]
        busy = statistics.median(max(busy_seconds(timings) for timings in step) for step in mine)
        nbytes = int(statistics.median(sum(b.nbytes for b in step[0]) for step in mine))
        row: dict[str, Any] = {"op": op, "calls": len(mine[-1][0]), "bytes": nbytes, "seconds": busy,
                               "group_size": group, "algbw_gbps": None, "busbw_gbps": None, "step": own}
        if busy > 0:
            row["algbw_gbps"] = nbytes / busy / 1e9
            if group > 1:
                row["busbw_gbps"] = row["algbw_gbps"] * bus_factor(group, op)
        out.append(row)
    return out


def memory_per_rank(profiles: list[RankProfile]) -> dict[str, int] | None:
    """Each figure's largest value over the ranks (the rank that needs the most sets the need)."""
    keys = list(dict.fromkeys(k for p in profiles for k in p.memory))  # params, grads, optimizer[, peak]
    return {k: max(p.memory.get(k, 0) for p in profiles) for k in keys} or None


def summarize(profiles: list[RankProfile], backend: str, mode: str = "ddp") -> WorldProfile:
    """One world size's figures from every rank's timings."""
    n = len(profiles)
    steps = min(len(p.steps) for p in profiles)
    if steps == 0:
        raise ValueError("no measured steps")
    sync = [max(p.steps[k].sync for p in profiles) for k in range(steps)]
    # compute: the no_sync pass less the step's own collectives in it (communication all the same)
    no_sync = [max(p.steps[k].no_sync - busy_seconds(p.steps[k].own_no_sync) for p in profiles) for k in range(steps)]
    opt = [max(p.steps[k].optimizer for p in profiles) for k in range(steps)]
    busy = [max(busy_seconds(p.steps[k].buckets) for p in profiles) for k in range(steps)]
    # sent: a 1-rank group's collective (HSDP with one replica) sends nothing
    nbytes = [sum(b.nbytes for b in profiles[0].steps[k].buckets if b.group_size != 1) for k in range(steps)]
    step_s = statistics.median(s + o for s, o in zip(sync, opt))
    step_p95 = percentile([s + o for s, o in zip(sync, opt)], 0.95)
    compute_s = statistics.median(c + o for c, o in zip(no_sync, opt))
    exposed = max(0.0, statistics.median(s - c for s, c in zip(sync, no_sync)))
    comm = statistics.median(busy)
    per_step_bytes = int(statistics.median(nbytes))
    out = WorldProfile(
        world_size=n, backend=backend, mode=mode, device=profiles[0].device, steps=steps,
        samples_per_step=sum(p.samples for p in profiles),
        step_s=step_s, step_p95_s=step_p95, compute_s=compute_s, optimizer_s=statistics.median(opt),
        exposed_comm_s=exposed, comm_s=comm,
        bytes_per_step=per_step_bytes, buckets=len([b for b in profiles[0].steps[-1].buckets if not b.own]),
    )
    ops = sorted({op for b in profiles[0].steps[-1].buckets for op in b.ops if not b.own})
    own = [b for b in profiles[0].steps[-1].buckets if b.own]
    out.collectives, out.memory_per_rank = by_op(profiles, steps), memory_per_rank(profiles)
    if comm > 0:
        out.overlap = min(1.0, max(0.0, 1.0 - exposed / comm))
        out.algbw_gbps = per_step_bytes / comm / 1e9
        if n > 1 and ops == ["all_reduce"] and all(b.ops == ("all_reduce",) for b in own):
            out.busbw_gbps = out.algbw_gbps * bus_factor(n)
    per_message = per_step_bytes / max(out.buckets or 1, 1)
    if out.busbw_gbps is not None and per_message < SMALL_MESSAGE_BYTES:
        out.notes.append(f"messages of {per_message / 1e3:.0f} kB on average: at this size latency, not the link, "
                         f"decides a collective's time, so bus bandwidth says little about the interconnect "
                         f"(it means something from about {SMALL_MESSAGE_BYTES / 2**20:g} MiB a message up)")
    if own:
        out.notes.append(f"the training step's own collectives ({', '.join(sorted({b.ops[0] for b in own}))}: "
                         f"{len(own)} a step, {size_text(sum(b.nbytes for b in own))}) are counted as communication "
                         f"(comm, exposed, sent/step), not compute: they block the step with or without "
                         f"{'DDP' if kind(mode).buckets else 'FSDP'}'s sync")
    if n > 1 and ops and ops != ["all_reduce"] and kind(mode).buckets:
        out.notes.append(f"the comm hook issues {', '.join(ops)}: bytes and algorithm bandwidth only "
                         f"(bus bandwidth is defined here for all-reduce)")
    out.ddp_logging = ddp_logged(profiles[0].ddp_logging)
    if out.ddp_logging and out.memory_per_rank is not None:  # DDP's flat buckets: a copy of the gradients, unless views
        copies = 0 if profiles[0].ddp_logging.get("gradient_as_bucket_view") else sum(out.ddp_logging["bucket_bytes"])
        out.memory_per_rank["ddp_buckets"] = copies
    out.step_memory = step_memory(out.memory_per_rank)
    buckets_s = statistics.median(max(busy_seconds([b for b in p.steps[k].buckets if not b.own]) for p in profiles)
                                  for k in range(steps))
    out.notes += cross_checked(out, out.ddp_logging, buckets_s)
    reduced = per_step_bytes - sum(b.nbytes for b in own if b.group_size != 1)  # DDP's buckets' alone
    traffic = extra_traffic(mode, ops, reduced, profiles[0].memory.get("grads", 0))
    if traffic:
        out.notes.append(traffic)
    if step_s > 0:
        out.samples_per_s = out.samples_per_step / step_s
    return out


NOT_STATE = ("peak_allocated", "activations")
"""Of ``memory_per_rank``: what is not the state a rank holds between steps."""


def state_of(memory: dict[str, int] | None) -> int:
    """The state a rank holds between steps: parameters, gradients, optimizer state, DDP's
    bucket copies of the gradients."""
    return sum(v for k, v in (memory or {}).items() if k not in NOT_STATE)


def step_memory(memory: dict[str, int] | None) -> int | None:
    """A rank's memory in a step: its peak allocated where measured (GPUs), else its state
    plus the activations saved for backward (counted in a warm-up step; None without)."""
    if not memory:
        return None
    if "peak_allocated" in memory:
        return memory["peak_allocated"]
    if "activations" in memory:
        return state_of(memory) + memory["activations"]
    return None


def ddp_logged(data: dict[str, Any]) -> dict[str, Any] | None:
    """DDP's own logging data as a profile shows it: its average forward, backward compute,
    backward communication and overlap times (ms; sampled by DDP over the iterations it ran,
    the profile's no_sync passes among them) and its buckets (the rebuilt ones where it
    rebuilt them)."""
    if not data:
        return None
    rebuilt = bool(data.get("has_rebuilt_buckets"))
    sizes_text = str(data.get("rebuilt_bucket_sizes" if rebuilt else "bucket_sizes", ""))
    sizes = [int(v) for v in sizes_text.replace(",", " ").split() if v.strip().isdigit()]

    def ms(key: str) -> float | None:
        value = data.get(key)
        return value / 1e6 if isinstance(value, (int, float)) and value > 0 else None

    return {"forward_ms": ms("avg_forward_compute_time"), "backward_compute_ms": ms("avg_backward_compute_time"),
            "backward_comm_ms": ms("avg_backward_comm_time"),
            "overlap_ms": ms("avg_backward_compute_comm_overlap_time"), "buckets": len(sizes) or None,
            "bucket_bytes": sizes, "rebuilt": rebuilt}


def cross_checked(run: WorldProfile, logged: dict[str, Any] | None, buckets_s: float | None = None) -> list[str]:
    """Notes where DDP's own logging disagrees with the profile's figures: another number of
    buckets (a count, no noise), or backward communication more than 2x apart (the two time
    different things: DDP from its first bucket's launch to its last's end, averaged over
    the iterations it sampled; the profile each bucket's flight, median over synced steps;
    ``buckets_s``: the buckets' alone, where the step issued collectives of its own)."""
    if not logged:
        return []
    notes = []
    if logged["buckets"] is not None and run.buckets is not None and logged["buckets"] != run.buckets:
        notes.append(f"DDP's own logging reports {logged['buckets']} bucket(s) "
                     f"({'rebuilt' if logged['rebuilt'] else 'as first built'}); the profile timed {run.buckets} a step")
    comm, ours = logged["backward_comm_ms"], run.comm_s if buckets_s is None else buckets_s
    if comm is not None and ours and run.world_size > 1 and not 0.5 <= comm / (ours * 1e3) <= 2.0:
        notes.append(f"DDP's own logging: backward communication {comm:.2f} ms a sampled iteration against the "
                     f"profile's {ours * 1e3:.2f} ms of its buckets in flight: more than 2x apart")
    return notes


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between the two nearest (numpy's default)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def extra_traffic(mode: str, ops: list[str], per_step: int, grad_bytes: int) -> str | None:
    """A note where DDP all-reduced the gradients more than once a step (each micro-batch's
    forward with sync on: accumulation without ``no_sync()``): the bytes ``no_sync()`` for all
    but the last micro-batch would save."""
    if not (kind(mode).buckets and ops == ["all_reduce"] and grad_bytes and per_step >= 1.5 * grad_bytes):
        return None
    times = per_step / grad_bytes
    return (f"traffic: DDP all-reduced {times:.1f}x the model's gradient bytes a step ({size_text(per_step)} against "
            f"{size_text(grad_bytes)} of gradients): each forward ran with gradient sync on (micro-batches accumulated "
            f"without no_sync(), a second forward); correct, but ctx.no_sync() (model.no_sync()) for all but the "
            f"last micro-batch would send {size_text(per_step - grad_bytes)} less a step per rank")


def size_text(n: float) -> str:
    """``8 B``, ``6.8 kB``, ``1.5 MB``."""
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} kB" if n >= 2**10 else f"{n:.0f} B"


def add_scaling(runs: list[WorldProfile]) -> None:
    """Fill ``scaling_efficiency`` against the smallest world size that ran, arm by arm."""
    for label in dict.fromkeys(r.label for r in runs):
        ran = [r for r in runs if r.status == "ok" and r.step_s and r.label == label]
        if not ran:
            continue
        base = min(ran, key=lambda r: r.world_size)
        assert base.step_s is not None
        for r in ran:
            assert r.step_s is not None
            r.scaling_efficiency = (base.step_s * base.world_size) / (r.step_s * r.world_size)
            if base.world_size != 1 and r is not base:
                r.notes.append(f"scaling efficiency relative to world size {base.world_size}")


__all__ = ["NOT_STATE", "WorldProfile", "add_scaling", "bus_factor", "busy_seconds", "by_op", "cross_checked",
           "ddp_logged", "extra_traffic", "memory_per_rank", "percentile", "size_text", "state_of", "step_memory",
           "summarize"]
