"""Modes ``fsdp`` and ``hsdp``: this rank's contiguous shard of every global batch under
FSDP2 (``torch.distributed.fsdp.fully_shard``), on a 1-D mesh of every rank (``fsdp``) or
a 2-D (replicate, shard) mesh (``hsdp``: R = W / S replicas of S-way shards).

The model is sharded the way the case says (``Case.fsdp(model, mesh)``: the user's own
wrapping and policies) or, by default, each direct child that holds parameters, then the
root. Parameters and their gradients are DTensors: each rank's sink compares its local
shard with the same slice of the reference (:mod:`ddparity.harness.shards`). The
loss compared is the mean of the ranks' losses, as with DDP. Under HSDP with more than one
replica, each rank publishes fingerprints of its shards after every step, named with the
shard: the replicas of one shard must hold the same bits (a desync otherwise); under
``fsdp`` every rank holds a different shard, and nothing is compared across ranks.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ddparity.errors import CaseError
from ddparity.harness.ranks.batches import shard
from ddparity.harness.ranks.stepping import record_step
from ddparity.harness.ranks.training import Replica, finish_shared_step
from ddparity.harness.recording import recorder
from ddparity.harness.recording.fingerprint import shard_fingerprint
from ddparity.harness.shards import is_sharded
from ddparity.run_kinds import kind

_MESHES: dict[tuple[Any, ...], Any] = {}
"""Meshes made in this rank process, reused by later checks in the same warm world (a 2-D
mesh makes process groups, each holding sockets)."""


@dataclass
class FSDPMode:
    steps: int
    rank: int
    world_size: int
    device: str
    shard_size: int
    """S: each parameter is split S ways (W for ``fsdp``)."""
    apply: Any = None
    """``Case.fsdp``: the user's own ``fully_shard`` calls."""
    name: str = "fsdp"
    settle: Any = None
    """Called once the model is sharded (simulated ranks: no thread trains while another shards)."""
    traced: bool = False
    """A compiled run: no hook of ddparity's on the model's layers (Dynamo would trace them
    into the user's graphs and compile differently); the precision is then the policy run's."""
    align_dropout: bool = True
    watch_draws: bool = False
    name_draws: bool = False

    def __post_init__(self) -> None:
        self.recorder = recorder.active()
        self._step = -1
        self.shard_index: int | None = None
        """This rank's shard (HSDP with replicas: its fingerprints are compared with theirs)."""
        self.unsharded: list[str] = []
        """The parameters left out of sharding (``ignored_params``), once wrapped."""
        self.computed_dtype: str | None = None
        """The lowest floating dtype a layer's parameters had in a forward, where lower than
        the sharded parameters' own (a ``MixedPrecisionPolicy``'s ``param_dtype``)."""

    def wrap(self, model: Any) -> Any:
        self.recorder.set_phase(-1, "fsdp")
        model, mesh = sharded(model, self.device, self.world_size, self.shard_size if kind(self.name).mesh else None,
                              self.apply)
        model.register_forward_hook(recorder.untraced(self._after_forward))
        self.unsharded = [name for name, p in model.named_parameters() if not is_sharded(p)]
        self.shard_index = mesh.get_local_rank("shard") if kind(self.name).mesh and mesh.size(0) > 1 else None
        stored = {p.dtype for p in model.parameters()}
        for module in model.modules() if not self.traced else ():  # after FSDP's own pre-forward hooks:
            if any(True for _ in module.parameters(recurse=False)):  # the all-gathered parameters
                module.register_forward_pre_hook(lambda m, args: self._note_precision(m, stored))
        if self.settle is not None:
            self.settle()
        return model

    def _note_precision(self, module: Any, stored: set[Any]) -> None:
        import torch

        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype not in stored and (
                    self.computed_dtype is None or torch.finfo(p.dtype).eps > torch.finfo(getattr(torch, self.computed_dtype)).eps):
                self.computed_dtype = str(p.dtype).removeprefix("torch.")

    def _after_forward(self, module: Any, args: Any, outputs: Any) -> None:
        self.recorder.set_phase(self._step, "backward")

    def sync_off(self, wrapped: Any) -> Any:
        return fsdp_no_sync(wrapped)

    def share(self, batch: Any, size: int | None) -> Any:
        return shard(batch, self.rank, self.world_size, size)

    def before_optimizer(self, replica: Replica) -> None:
        self.recorder.set_phase(self._step, "optimizer")
        refuse_zero(replica.optimizer)

    def step(self, step: int, replica: Replica, batch: Any) -> None:
        self._step = step
        loss, stepped = record_step(step, replica, batch)  # FSDP's reduce-scatters end inside backward
        finish_shared_step(self, replica, step, loss, stepped)
        if self.shard_index is not None:  # the replicas of each shard: the same bits
            self.recorder.set_phase(step, "fingerprint")
            part = None if step == self.steps - 1 else step  # everything at the last step
            self.recorder.fingerprints(step, shard_fingerprint(replica.model, replica.optimizer, self.shard_index,
                                                               part))


def device_mesh(device: str, world_size: int, shard_size: int | None) -> Any:
    """A 1-D mesh of every rank, or (``shard_size``) a 2-D (replicate, shard) one."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = torch.device(device).type
    shape = (world_size,) if shard_size is None else (world_size // shard_size, shard_size)
    names = ("shard",) if shard_size is None else ("replicate", "shard")
    if dist.get_backend() == "threaded":  # a simulated rank: its process group ends with the run
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    key = (device_type, shape, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def sharded(model: Any, device: str, world_size: int, shard_size: int | None, apply: Any) -> tuple[Any, Any]:
    """``model`` sharded on its mesh (:func:`device_mesh`) the case's way (``apply``:
    ``Case.fsdp``), else :func:`default_wrapping`; and the mesh."""
    mesh = device_mesh(device, world_size, shard_size)
    if apply is None:
        refuse_scalars(model)
        refuse_scripted(model)
        default_wrapping(model, mesh)
    else:
        returned = apply(model, mesh)
        model = model if returned is None else returned
    refuse_sparse(model)
    return model, mesh


def refuse_scalars(model: Any) -> None:
    """A :class:`~ddparity.errors.CaseError` for 0-d parameters, which ``fully_shard`` refuses
    (CLIP's ``logit_scale``): the default wrapping cannot shard this model as it is."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise CaseError(
            f"fully_shard cannot shard 0-d parameters: {', '.join(scalars[:4])}{' ...' if len(scalars) > 4 else ''} "
            f"(torch: \"fully_shard doesn't support scalar parameters\"), so ddparity's default wrapping cannot "
            f"shard this model; make each a 1-D parameter of one element (nn.Parameter(t.reshape(1))), or give "
            f"Case(fsdp=...) your own wrapping that leaves it out (fully_shard(..., ignored_params={{...}})) and "
            f"all-reduce its gradient yourself, as FSDP2 then does not; or check this model with --modes single,ddp")


def refuse_scripted(model: Any) -> None:
    """A :class:`~ddparity.errors.CaseError` for TorchScript modules: FSDP2 hooks, swaps the
    class of and replaces the parameters of every module in its tree, which a scripted
    module refuses (torch raises from inside ``fully_shard``, or at its first forward)."""
    import torch

    found = {name: m for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)}
    scripted = [f"{repr(name) if name else 'the model'} ({getattr(m, 'original_name', type(m).__name__)})"
                for name, m in found.items()
                if not any(o != name and (o == "" or name.startswith(f"{o}.")) for o in found)]  # the outermost
    if scripted:
        raise CaseError(
            f"fully_shard cannot shard a model that holds TorchScript modules: {', '.join(scripted[:4])}"
            f"{' ...' if len(scripted) > 4 else ''} (torch.jit.script); FSDP2 hooks every module of its tree and "
            f"replaces its parameters, which a scripted module does not allow. Check the eager module here (script it "
            f"after training, or compile it with torch.compile, which FSDP2 takes), or check this model with "
            f"--modes single,dp,ddp (DDP and DataParallel take scripted modules)")


def refuse_zero(optimizer: Any) -> None:
    """A :class:`~ddparity.errors.CaseError` for a ``ZeroRedundancyOptimizer``, before its
    first step under FSDP2 (torch raises from inside it: DTensor has no rule for the
    broadcast it ends with)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: none was built
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        inner = getattr(getattr(optimizer, "_optim_constructor", None), "__name__", "the optimizer it wraps")
        raise CaseError(
            f"ZeroRedundancyOptimizer cannot step FSDP2's sharded parameters: it splits whole parameters among the "
            f"ranks and broadcasts each from the rank that stepped it (ZeRO-1, for DDP), while under FSDP2 each rank "
            f"already holds a shard of every parameter and of its optimizer state (ZeRO-3), as DTensors it cannot "
            f"broadcast. Give FSDP2 the optimizer ZeroRedundancyOptimizer wraps ({inner}) directly, or check this "
            f"optimizer with --modes single,ddp")


def refuse_sparse(model: Any) -> None:
    """A :class:`~ddparity.errors.CaseError` for an embedding with sparse gradients whose
    weight FSDP2 shards: its reduce-scatter has no sparse kernel (torch raises a
    NotImplementedError from inside backward, listing every dispatch key)."""
    sparse = [name or type(model).__name__ for name, m in model.named_modules()
              if getattr(m, "sparse", False) is True and is_sharded(getattr(m, "weight", None))]
    if sparse:
        raise CaseError(
            f"FSDP2 cannot reduce sparse gradients: {', '.join(sparse)} "
            f"({'is' if len(sparse) == 1 else 'are'} built with sparse=True); check this model with --modes single,ddp "
            f"(DDP all-reduces sparse gradients), or build the embedding with sparse=False for fsdp and hsdp, or "
            f"leave it out of sharding in Case.fsdp (fully_shard(..., ignored_params=...))"
        )


def default_wrapping(model: Any, mesh: Any) -> None:
    """``fully_shard`` on each of the model's blocks, then on the root: the usual per-block
    wrapping (torchtitan's, nanoGPT's FSDP recipes), found by :func:`wrapping_units`."""
    from torch.distributed.fsdp import fully_shard

    for unit in wrapping_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def wrapping_units(model: Any) -> list[Any]:
    """The modules the default wrapping gives a group of their own.

    A transformers model names its blocks (``_no_split_modules``: ``GPT2Block``,
    ``MixtralDecoderLayer``): each module of those classes, as accelerate's and TRL's FSDP2
    wrapping takes them, the rest (embeddings, final norm, head) left to the root. Wrapping
    such a model's inner ``MixtralModel`` whole swaps its class (``FSDPMixtralModel``), and
    transformers' output capture, keyed on the class, then records no router logits: the
    model's own loss raised.

    Otherwise each direct child that holds parameters, except that

    * a container without a ``forward`` of its own (``ModuleList``, ``ModuleDict``: nanoGPT's
      ``transformer``, torchtitan's ``layers``) is looked into, its children taken instead
      (``fully_shard`` refuses a module that is never called);
    * a module holding a parameter that is also reachable elsewhere (tied embeddings, T5's
      embedding shared by encoder and decoder) is looked into too, and a parameter so shared
      is left to the root's group: one FSDP group may manage a parameter, never two.
    """
    seen_names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen_names[id(p)] = seen_names.get(id(p), 0) + 1
    shared = {pid for pid, count in seen_names.items() if count > 1}
    declared = {str(name) for name in getattr(model, "_no_split_modules", None) or ()}
    blocks = _units(model, shared, declared) if declared else []
    return blocks or _units(model, shared, set())


def _units(model: Any, shared: set[int], declared: set[str]) -> list[Any]:
    """:func:`wrapping_units` by ``declared`` block classes (by name), or by children where
    none are declared."""
    from torch import nn

    units: list[Any] = []
    taken: set[int] = set()

    def visit(module: Any) -> None:
        for child in module.children():
            if id(child) in taken:
                continue
            taken.add(id(child))
            params = list(child.parameters())
            if not params:
                continue
            whole = (type(child).__name__ in declared if declared
                     else type(child).forward is not nn.Module.forward)  # not ModuleList, ModuleDict, a bare Module
            if whole and not any(id(p) in shared for p in params):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def fsdp_no_sync(module: Any) -> Any:
    """``ctx.no_sync()`` under FSDP2: gradients accumulate unreduced until the context ends
    (``set_requires_gradient_sync``), as DDP's ``no_sync`` does; None where the root is not
    an FSDP module (the case's own ``Case.fsdp`` left it unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None

    @contextmanager
    def no_sync() -> Any:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return no_sync
