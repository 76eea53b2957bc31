"""A profile's arms: the modes asked for and, for DDP, the settings swept (``--bucket-cap-mb``,
``--ddp``, ``--comm-hook``), each a row of one table timed in the same warm worlds.

An arm is the case as the user wrote it with one setting changed: a bucket cap, one of DDP's
boolean options turned on, or one of torch's own comm hooks in place of the case's. Without
a sweep every mode is one arm, named by the mode (the table reads as before).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddparity.case import Case
from ddparity.errors import UsageError
from ddparity.run_kinds import kind

DDP_FLAGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
"""DDP's boolean options an arm may turn on (``--ddp``)."""
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")
"""torch's own comm hooks an arm may use (``--comm-hook``)."""
POWERSGD_ON_GLOO = ("not timed over gloo: PowerSGD's hook issues all-reduces from completion callbacks, whose order "
                    "across ranks gloo does not keep (a plain DDP script with it hangs at 2 ranks, torch 2.13, several "
                    "buckets; the profile's timed run of it hung once at 1 rank too). Profile it over nccl (GPUs)")


@dataclass(frozen=True)
class Arm:
    """One row of the profile's table at each world size."""

    mode: str
    label: str
    """What the table calls it: the mode, or ``ddp bucket 25 MB``, ``ddp static_graph``, ``ddp fp16 hook``."""
    case: Case
    flags: str = ""
    """The CLI options that reproduce it (``--bucket-cap-mb 25``)."""
    call: str = ""
    """The same as ``profile()`` arguments (``bucket_cap_mb=(25,), ``)."""
    not_on_gloo: str | None = None
    """Why the arm cannot run over gloo (its row is skipped there with this reason)."""


def comm_hook(name: str) -> tuple[Any, Any]:
    """torch's hook ``name`` and a fresh state for it (every rank gets its own copy)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":  # vanilla all-reduce for the first two iterations (profile's warm-up), rank 1 after
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    return hooks[name], None


def validated(modes: tuple[str, ...], bucket_cap_mb: tuple[float, ...] | list[float] | None,
              ddp: tuple[str, ...] | list[str] | None, comm_hooks: tuple[str, ...] | list[str] | None) -> None:
    """Bad sweeps, named with the fix, before any work."""
    swept = [name for name, given in (("--bucket-cap-mb", bucket_cap_mb), ("--ddp", ddp), ("--comm-hook", comm_hooks))
             if given]
    if swept and not any(kind(m).buckets for m in modes):
        raise UsageError(f"{', '.join(swept)} sweep DDP's settings: add ddp to --modes (--modes ddp or ddp,fsdp)")
    for cap in bucket_cap_mb or ():
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
            raise UsageError(f"--bucket-cap-mb takes positive sizes in MB (e.g. 1,5,25,100), got {cap!r}")
    for flag in ddp or ():
        if flag not in DDP_FLAGS:
            raise UsageError(f"--ddp {flag!r} is not one of DDP's options swept here: {', '.join(DDP_FLAGS)}")
    for hook in comm_hooks or ():
        if hook not in COMM_HOOKS:
            raise UsageError(f"--comm-hook {hook!r} is not one of {', '.join(COMM_HOOKS)}")


def arms(case: Case, modes: tuple[str, ...], bucket_cap_mb: tuple[float, ...] | list[float] | None = None,
         ddp: tuple[str, ...] | list[str] | None = None,
         comm_hooks: tuple[str, ...] | list[str] | None = None) -> list[Arm]:
    """Every arm, in the table's order: each mode, DDP's with its sweeps after it."""
    validated(modes, bucket_cap_mb, ddp, comm_hooks)
    out = []
    for mode in modes:
        if not kind(mode).buckets or not (bucket_cap_mb or ddp or comm_hooks):
            out.append(Arm(mode, mode, case))
            continue
        for cap in bucket_cap_mb or ():
            options = {**case.ddp_options, "bucket_cap_mb": cap}
            out.append(Arm(mode, f"{mode} bucket {cap:g} MB", dataclasses.replace(case, ddp_options=options),
                           f" --bucket-cap-mb {cap:g}", f"bucket_cap_mb=({cap:g},), "))
        for flag in ddp or ():
            options = {**case.ddp_options, flag: True}
            out.append(Arm(mode, f"{mode} {flag}", dataclasses.replace(case, ddp_options=options), f" --ddp {flag}",
                           f"ddp=({flag!r},), "))
        for name in comm_hooks or ():
            hook, state = comm_hook(name)
            out.append(Arm(mode, f"{mode} {name} hook", dataclasses.replace(case, comm_hook=hook, comm_hook_state=state),
                           f" --comm-hook {name}", f"comm_hooks=({name!r},), ",
                           POWERSGD_ON_GLOO if name == "powersgd" else None))
    return out


__all__ = ["COMM_HOOKS", "DDP_FLAGS", "Arm", "arms", "comm_hook", "validated"]
