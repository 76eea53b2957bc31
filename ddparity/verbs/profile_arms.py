"""A profile's arms: the modes asked for and, for DDP, the settings swept (``--bucket-cap-mb``,
``--bucket-cap-mb-list``, ``--ddp``, ``--comm-hook``), each a row of one table timed in the
same warm worlds.

An arm is the case as the user wrote it with one setting changed: a bucket cap, a list of
caps bucket by bucket (DDP's ``bucket_cap_mb_list``, in newer torch), one of DDP's boolean
options turned on, or one of torch's own comm hooks in place of the case's. Without a sweep
every mode is one arm, named by the mode (the table reads as before).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddparity.case import Case, takes_bucket_lists
from ddparity.errors import UsageError
from ddparity.run_kinds import kind

DDP_FLAGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
"""DDP's boolean options an arm may turn on (``--ddp``)."""
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")
"""torch's own comm hooks an arm may use (``--comm-hook``)."""
POWERSGD_ON_GLOO = ("not timed over gloo: PowerSGD's hook issues all-reduces from completion callbacks, whose order "
                    "across ranks gloo does not keep (a plain DDP script with it at 2 ranks, torch 2.13: gloo aborts "
                    "with 'Received data size doesn't match expected size', or hangs). Profile it over nccl (GPUs)")


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
    bucket_cap_mb: float | None = None
    """The bucket cap it sweeps (``--bucket-cap-mb``), None for other arms."""

    def row(self, run: Any) -> Any:
        """``run`` (a ``WorldProfile``) as this arm's row: named by its setting where it sweeps one."""
        run.arm = self.label if self.label != self.mode else None
        run.bucket_cap_mb = self.bucket_cap_mb
        return run


def comm_hook(name: str) -> tuple[Any, Any]:
    """torch's hook ``name`` and a fresh state for it (every rank gets its own copy)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":  # vanilla all-reduce for the first two iterations (profile's warm-up), rank 1 after
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    return hooks[name], None


@dataclass(frozen=True)
class Sweep:
    """DDP's settings swept, as ``profile()`` takes them (every field empty: no sweep)."""

    bucket_cap_mb: tuple[float, ...] = ()
    bucket_cap_mb_list: tuple[tuple[float, ...], ...] = ()
    ddp: tuple[str, ...] = ()
    comm_hooks: tuple[str, ...] = ()

    @classmethod
    def of(cls, bucket_cap_mb: Any = None, bucket_cap_mb_list: Any = None, ddp: Any = None,
           comm_hooks: Any = None) -> Sweep:
        return cls(*(tuple(given or ()) for given in (bucket_cap_mb, bucket_cap_mb_list, ddp, comm_hooks)))

    def __bool__(self) -> bool:
        return bool(self.bucket_cap_mb or self.bucket_cap_mb_list or self.ddp or self.comm_hooks)


def _is_size(cap: Any) -> bool:
    return isinstance(cap, (int, float)) and not isinstance(cap, bool) and 0 < cap < float("inf")


def validated(modes: tuple[str, ...], sweep: Sweep) -> None:
    """Bad sweeps, named with the fix, before any work."""
    swept = [name for name, given in (("--bucket-cap-mb", sweep.bucket_cap_mb),
                                      ("--bucket-cap-mb-list", sweep.bucket_cap_mb_list), ("--ddp", sweep.ddp),
                                      ("--comm-hook", sweep.comm_hooks)) if given]
    if swept and not any(kind(m).buckets for m in modes):
        raise UsageError(f"{', '.join(swept)} sweep DDP's settings: add ddp to --modes (--modes ddp or ddp,fsdp)")
    for cap in sweep.bucket_cap_mb:
        if not _is_size(cap):
            raise UsageError(f"--bucket-cap-mb takes positive sizes in MB (e.g. 1,5,25,100), got {cap!r}")
    for caps in sweep.bucket_cap_mb_list:
        if isinstance(caps, (str, bytes)) or not isinstance(caps, (tuple, list)) or not caps \
                or not all(_is_size(c) for c in caps):
            raise UsageError(f"--bucket-cap-mb-list takes lists of positive sizes in MB, bucket by bucket "
                             f"(e.g. 1:25,5:25; in Python ((1, 25), (5, 25))), got {caps!r}")
    if sweep.bucket_cap_mb_list and not takes_bucket_lists():
        import torch

        raise UsageError(f"--bucket-cap-mb-list: DistributedDataParallel in torch {torch.__version__} takes no "
                         f"bucket_cap_mb_list (newer torch releases do): upgrade torch, or sweep --bucket-cap-mb")
    for flag in sweep.ddp:
        if flag not in DDP_FLAGS:
            raise UsageError(f"--ddp {flag!r} is not one of DDP's options swept here: {', '.join(DDP_FLAGS)}")
    for hook in sweep.comm_hooks:
        if hook not in COMM_HOOKS:
            raise UsageError(f"--comm-hook {hook!r} is not one of {', '.join(COMM_HOOKS)}")


def _python(caps: tuple[float, ...]) -> str:
    """``(1, 25)``, ``(5,)``: a tuple of sizes as the Python API takes it."""
    return f"({', '.join(f'{c:g}' for c in caps)}{',' if len(caps) == 1 else ''})"


def arms(case: Case, modes: tuple[str, ...], sweep: Sweep = Sweep()) -> list[Arm]:
    """Every arm, in the table's order: each mode, DDP's with its sweeps after it."""
    validated(modes, sweep)
    out = []
    for mode in modes:
        if not kind(mode).buckets or not sweep:
            out.append(Arm(mode, mode, case))
            continue
        for cap in sweep.bucket_cap_mb:
            options = {**case.ddp_options, "bucket_cap_mb": cap}
            out.append(Arm(mode, f"{mode} bucket {cap:g} MB", dataclasses.replace(case, ddp_options=options),
                           f" --bucket-cap-mb {cap:g}", f"bucket_cap_mb=({cap:g},), ", bucket_cap_mb=cap))
        for caps in sweep.bucket_cap_mb_list:
            options = {**case.ddp_options, "bucket_cap_mb_list": list(caps)}
            options.pop("bucket_cap_mb", None)  # DDP ignores it beside a list
            text = ":".join(f"{c:g}" for c in caps)
            out.append(Arm(mode, f"{mode} buckets {text} MB", dataclasses.replace(case, ddp_options=options),
                           f" --bucket-cap-mb-list {text}",
                           f"bucket_cap_mb_list=({_python(caps)},), "))
        for flag in sweep.ddp:
            options = {**case.ddp_options, flag: True}
            out.append(Arm(mode, f"{mode} {flag}", dataclasses.replace(case, ddp_options=options), f" --ddp {flag}",
                           f"ddp=({flag!r},), "))
        for name in sweep.comm_hooks:
            hook, state = comm_hook(name)
            out.append(Arm(mode, f"{mode} {name} hook", dataclasses.replace(case, comm_hook=hook, comm_hook_state=state),
                           f" --comm-hook {name}", f"comm_hooks=({name!r},), ",
                           POWERSGD_ON_GLOO if name == "powersgd" else None))
    return out


__all__ = ["COMM_HOOKS", "DDP_FLAGS", "Arm", "Sweep", "arms", "comm_hook", "validated"]
