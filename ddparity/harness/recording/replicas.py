"""The replicas of a script ddparity did not write (``ddparity watch``): which parameters
must be identical on which ranks, and their fingerprints after every ``optimizer.step()``.

A watched script builds its own DDP and FSDP2 modules and optimizers. :class:`Replicas`
learns of them as they are made (``DistributedDataParallel.__init__`` and ``fully_shard``
are wrapped: they run as they are, then the module is remembered) and registers one global
optimizer step hook (``torch.optim``'s own: it returns nothing and changes no tensor).
After each step it fingerprints every parameter the optimizer holds
(:mod:`ddparity.harness.recording.fingerprint`, a rotating sixteenth of each large tensor per
step, every element within 16 steps, as ``check`` does) and
names each with the ranks that must agree on it:

* a parameter of a DDP module: every rank of that DDP's process group;
* a DTensor (FSDP2, HSDP): the ranks at the same coordinate of every sharded mesh
  dimension (under HSDP the shard's replicas; under plain FSDP2 no one, so nothing);
* any other parameter (model parallel, a rank-local model): not compared.

The fingerprints go to the rank's recorder and from there to the launch's store, where the
reporter compares them (:mod:`ddparity.verbs.watch`). On a GPU the sums are copied to the
host without waiting (a pinned buffer and an event) and published one step later: the step
never waits for them.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from ddparity.harness.optimizer_steps import nested_step
from ddparity.harness.recording.fingerprint import device_sums, nonfinite_count
from ddparity.harness.recording.recorder import StepRecorder, untraced
from ddparity.harness.shards import is_sharded
from ddparity.records import IN_BACKWARD, NONFINITE, SETTING, SHARD_TAG, STEPPED

_installed: Replicas | None = None

class Replicas:
    """The DDP and FSDP2 modules this process built, and the fingerprints of their
    parameters after every optimizer step (see the module docstring)."""

    def __init__(self, recorder: StepRecorder, world_size: int) -> None:
        self.recorder = recorder
        self.world_size = world_size
        self.steps = 0
        self.modules: list[tuple[Any, bool, tuple[int, ...]]] = []
        """(module, sharded (FSDP2's) or not (DDP's), the DDP's group ranks or ())"""
        self.unmatched = 0
        """Parameters an optimizer stepped that belong to no DDP or FSDP2 module (not compared)."""
        self.replicated = 0
        """Parameters (or shards) an optimizer stepped that other ranks hold too (compared)."""
        self.backend = ""
        """The default process group's backend, as the first DDP or FSDP2 module found it."""
        self._names: dict[int, tuple[str, str, int]] = {}
        self._pending: tuple[int, list[str], Any, Any, dict[str, int]] | None = None
        self._known = 0

    # -- what the script's modules tell us ------------------------------------------

    def built(self, module: Any, sharded: bool, ranks: tuple[int, ...] = ()) -> None:
        """``module`` was wrapped: by ``fully_shard`` (``sharded``) or DDP (over ``ranks``)."""
        import torch.distributed as dist

        self.modules.append((module, sharded, ranks))
        if not self.backend and dist.is_initialized():
            self.backend = str(dist.get_backend())

    @property
    def mode(self) -> str:
        """The data parallelism the script used: ddp, fsdp, hsdp (a 2-D mesh), or ddp when none was seen."""
        meshes = [self._mesh_dims(m) for m, sharded, _ in self.modules if sharded]
        if meshes:
            return "hsdp" if max(meshes) > 1 else "fsdp"
        return "ddp"

    @staticmethod
    def _mesh_dims(module: Any) -> int:
        for p in module.parameters():
            if is_sharded(p):
                return int(p.device_mesh.ndim)
        return 0

    def _name_map(self) -> None:
        """Each parameter's name, the tag naming the ranks that hold the same values, and how
        many ranks those are."""
        if self._known == len(self.modules):
            return
        self._known = len(self.modules)
        names: dict[int, tuple[str, str, int]] = {}
        prefixes = _root_prefixes([m if sharded else m.module for m, sharded, _ in self.modules])
        for module, sharded, ranks in sorted(self.modules, key=lambda m: -sum(1 for _ in m[0].parameters())):
            inner = module if sharded else module.module
            tag = "" if sharded or len(ranks) in (0, self.world_size) else f"{SHARD_TAG}ddp group {list(ranks)}]"
            holders = 0 if sharded else len(ranks)
            for name, p in inner.named_parameters():
                if id(p) not in names:
                    names[id(p)] = (prefixes.get(id(inner), "") + name, tag, holders)
        self._names = names

    def record_buckets(self, ddp: Any) -> None:
        """Where the rank is in a DDP step, and DDP's gradient all-reduces (issued from
        C++, recorded from its bucket layout) once a forward that backward will all-reduce
        ended. Hooks that return nothing: the forward's outputs and their gradients are
        DDP's; a gradient hook on the outputs says backward began (a rank that never gets
        there is behind the ranks waiting in backward for its all-reduce)."""
        import torch
        from torch.utils._pytree import tree_leaves

        from ddparity.harness.recording.ddp_buckets import BucketLayout

        layout = BucketLayout(ddp) if BucketLayout.available(ddp) else None
        recorder = self.recorder

        def backward_began(grad: Any) -> None:
            recorder.set_phase(self.steps, "backward")

        def after_forward(module: Any, args: Any, outputs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            recorder.set_phase(self.steps, "forward")
            for leaf in tree_leaves(outputs):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(backward_began)
            if layout is not None and module.require_backward_grad_sync:
                recorder.ddp_buckets(layout.current())

        ddp.register_forward_hook(untraced(after_forward))

    # -- after each optimizer step ----------------------------------------------------

    def after_step(self, optimizer: Any, *_: Any) -> None:
        """The global optimizer step hook: fingerprint what this optimizer holds (once per
        call the script made: a subclass's ``super().step()`` is the same step)."""
        if nested_step():
            return
        step = self.steps
        self.steps += 1
        self.recorder.set_phase(self.steps, "optimizer")
        self._name_map()
        names: list[str] = []
        tensors: list[Any] = []
        unmatched = replicated = 0
        whole_world = True  # every parameter a DDP's over every rank: so is the optimizer
        sharded = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if is_sharded(p):
                    name = self._names.get(id(p), ("?", "", 0))[0]
                    names.append(f"param {name}{SHARD_TAG}{_coordinates(p)}]")
                    tensors.append(p.to_local())
                    replicated += _replicas(p) > 1
                    whole_world, sharded = False, True
                elif id(p) in self._names:
                    name, tag, holders = self._names[id(p)]
                    names.append(f"param {name}{tag}")
                    tensors.append(p)
                    replicated += holders > 1
                    whole_world = whole_world and not tag
                else:
                    unmatched += 1
                    whole_world = False
        self.unmatched = max(self.unmatched, unmatched)
        self.replicated = max(self.replicated, replicated)
        if tensors:
            self._publish_pending()
            sums = _device_sums(tensors, step)
            names.append(NONFINITE)  # _device_sums' last element
            settings = setting_prints(optimizer) if whole_world else {}
            if whole_world:  # every rank steps this optimizer: in the same order
                settings[f"{STEPPED}the optimizer of {names[0].split(' ', 1)[1]}"] = 1
            if replicated and not sharded:  # DDP's parameters (FSDP2's hooks run on reduced gradients)
                settings.update(_in_backward())
            if sums.device.type != "cuda":
                self.recorder.fingerprints(step, {**dict(zip(names, sums.tolist())), **settings})
            else:  # published at the next step (or the end), the copy finished by then
                import torch

                with torch.cuda.device(sums.device):  # the stream of the parameters' device
                    host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
                    host.copy_(sums, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                self._pending = (step, names, host, event, settings)

    def _publish_pending(self) -> None:
        if self._pending is not None:
            step, names, host, event, settings = self._pending
            self._pending = None
            event.synchronize()
            self.recorder.fingerprints(step, {**dict(zip(names, host.tolist())), **settings})

    def flush(self) -> None:
        """The script ended: publish the last step's fingerprints (a GPU's, still pending)."""
        self._publish_pending()


def _in_backward() -> dict[str, int]:
    """:data:`~ddparity.records.IN_BACKWARD` where a backward is running on this thread."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
    return {IN_BACKWARD: 1} if task != -1 else {}


def _root_prefixes(modules: list[Any]) -> dict[int, str]:
    """Where the script built several models (a GAN's generator and discriminator, each under
    its own DDP), a prefix for each one's parameter names, by the model's id: its class
    (``Generator.``), with the order it was built in where two share a class
    (``Sequential#1.``); none for one model, or for blocks inside another (FSDP2's)."""
    held = [frozenset(id(p) for p in m.parameters()) for m in modules]
    widest: dict[frozenset[int], Any] = {}  # one model per set of parameters: the one holding the others
    for i, m in enumerate(modules):
        if held[i] and not any(held[i] < other for other in held):
            known = widest.get(held[i])
            if known is None or sum(1 for _ in m.modules()) > sum(1 for _ in known.modules()):
                widest[held[i]] = m
    roots = list(widest.values())
    if len(roots) < 2:
        return {}
    classes = [type(m).__name__ for m in roots]
    return {id(m): (c if classes.count(c) == 1 else f"{c}#{i}") + "." for i, (m, c) in enumerate(zip(roots, classes))}


def setting_prints(optimizer: Any) -> dict[str, int]:
    """The optimizer's numeric settings (:func:`~ddparity.harness.optimizer_settings.settings_of`)
    as fingerprints (each float's bits), named ``setting lr (group 0)``: every rank of a DDP
    over the whole world steps the same optimizer, so they must agree too."""
    import struct

    from ddparity.harness.optimizer_settings import settings_of

    return {f"{SETTING}{key} (group {i})": struct.unpack("<q", struct.pack("<d", v))[0]
            for key, values in settings_of(optimizer).items() for i, v in enumerate(values)}


def _replicas(p: Any) -> int:
    """How many ranks hold the same part of a DTensor (the sizes of its replicated mesh dimensions)."""
    count = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):
        count *= size if placement.is_replicate() else 1
    return count


def _coordinates(p: Any) -> str:
    """Where a DTensor's local part sits on its mesh's sharded dimensions (``1`` or
    ``dim 1: 0``): the ranks with the same coordinates hold the same part."""
    mesh, placements = p.device_mesh, p.placements
    coords = mesh.get_coordinate() or []
    sharded = [(i, c) for i, (c, pl) in enumerate(zip(coords, placements)) if not pl.is_replicate()]
    if len(sharded) == 1:
        return str(sharded[0][1])
    return ", ".join(f"dim {i}: {c}" for i, c in sharded) or "replicated"


def _device_sums(tensors: list[Any], step: int) -> Any:
    """Each tensor's fingerprint (large tensors a rotating slice, as
    :func:`ddparity.harness.recording.fingerprint.fingerprint` takes them), then how many hold
    a NaN or inf (:data:`~ddparity.records.NONFINITE`), as one int64 tensor on the first
    tensor's device."""
    import torch

    with torch.no_grad():
        sums = device_sums(tensors, step)  # a rotating slice of large tensors: SLICES
        device = sums[0].device
        return torch.stack([s.to(device) for s in [*sums, nonfinite_count(tensors, step)]])


def install(recorder: StepRecorder, world_size: int) -> Replicas:
    """Wrap DDP's constructor and ``fully_shard`` in this process (the latter once the script
    imports it: importing FSDP has side effects of its own) and register the global
    optimizer step hook (once; later calls return the same :class:`Replicas`)."""
    global _installed
    if _installed is not None:
        return _installed
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook

    replicas = _installed = Replicas(recorder, world_size)
    original_init = DistributedDataParallel.__init__

    @functools.wraps(original_init)
    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        import torch.distributed as dist

        replicas.built(self, False, tuple(dist.get_process_group_ranks(self.process_group)))
        replicas.record_buckets(self)

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    if FSDP in sys.modules:
        _wrap_fully_shard(replicas)
    else:
        sys.meta_path.insert(0, _AfterImport(FSDP, lambda: _wrap_fully_shard(replicas)))
    register_optimizer_step_post_hook(replicas.after_step)
    return replicas


FSDP = "torch.distributed.fsdp"


def _wrap_fully_shard(replicas: Replicas) -> None:
    """``fully_shard`` runs as it is, then the module (or modules) it sharded are remembered."""
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as fsdp_pkg
    import torch.distributed.fsdp._fully_shard._fully_shard as inner

    original_shard = fsdp_pkg.fully_shard

    @functools.wraps(original_shard)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_shard(module, *args, **kwargs)
        for m in (module if isinstance(module, (list, tuple)) else [module]):
            replicas.built(m, True)
        return out

    for where in (fsdp_pkg, composable, inner):
        if getattr(where, "fully_shard", None) is original_shard:
            where.fully_shard = fully_shard  # type: ignore[attr-defined]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after module ``name`` is first imported (and leaves the import
    system as it found it)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            original(module)
            then()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
