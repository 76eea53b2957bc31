"""The modes, as tasks that run inside rank processes: given a Case, produce a Trace.

* ``reference_task`` builds the initial state once (from the case's factory and seed),
  then trains on one device with the whole global batch (mode ``single``), and once more
  as the calibration twin (reversed sample order, gradients nudged by the rounding DDP
  may add), whose distance to the reference calibrates the floating-point noise floor.
* ``ddp_task`` loads that initial state into every rank and trains under
  ``DistributedDataParallel``, each rank on its contiguous shard of the same batch.
"""

from __future__ import annotations

import copy
from typing import Any

from ddparity.case import Case, load_target, make_optimizer, resolve_loss
from ddparity.errors import CaseError
from ddparity.harness.protocol import RankContext
from ddparity.trace import StepRecord, Trace


def _build_model(case: Case) -> Any:
    import torch

    factory = load_target(case.model) if isinstance(case.model, str) else case.model
    try:
        model = factory()
    except Exception as exc:
        raise CaseError(f"the model factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise CaseError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _data_fn(case: Case) -> Any:
    return load_target(case.data) if isinstance(case.data, str) else case.data


def map_tensors(obj: Any, fn: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def batch_size(obj: Any) -> int | None:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.shape[0]) if obj.dim() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        size = batch_size(item)
        if size is not None:
            return size
    return None


def shard(obj: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s contiguous, equal share of every tensor along dim 0."""

    def cut(t: Any) -> Any:
        if t.dim() == 0:
            return t
        per = t.shape[0] // world_size
        return t[rank * per : (rank + 1) * per]

    return map_tensors(obj, cut)


def reverse_samples(obj: Any, size: int) -> Any:
    """The same batch in reversed sample order (tensors whose dim 0 is the batch)."""
    return map_tensors(obj, lambda t: t.flip(0) if t.dim() and t.shape[0] == size else t)


def _global_batch(case: Case, data: Any, step: int, generator: Any) -> tuple[Any, Any]:
    try:
        batch = data(step, generator)
    except Exception as exc:
        raise CaseError(f"the data function raised at step {step}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise CaseError(
            f"the data function must return (inputs, targets) for step {step}, got {type(batch).__name__}"
        )
    return batch[0], batch[1]


def _forward(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _snapshot(module: Any, loss: Any) -> StepRecord:
    return StepRecord(
        loss=loss.detach().to("cpu", copy=True),
        grads={
            n: (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
            for n, p in module.named_parameters()
        },
    )


def _finish_step(record: StepRecord, module: Any) -> None:
    record.params = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}
    record.buffers = {n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers()}


def initial_state(case: Case) -> dict[str, Any]:
    import torch

    torch.manual_seed(case.seed)
    model = _build_model(case)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _prepared(case: Case, state: dict[str, Any], device: str) -> Any:
    import torch

    model = _build_model(case)
    model.load_state_dict(state)
    model.to(device=device, dtype=case.torch_dtype)
    torch.manual_seed(case.seed)  # any randomness in forward starts from the same point
    return model


def _cast(batch: Any, case: Case, device: str) -> Any:
    def move(t: Any) -> Any:
        t = t.to(device)
        return t.to(case.torch_dtype) if t.is_floating_point() else t

    return map_tensors(batch, move)


def _shard_magnitudes(model: Any, loss_fn: Any, inputs: Any, targets: Any, shards: int) -> tuple[Any, dict]:
    """Mean over ``shards`` contiguous shards of |shard loss| and |shard gradient|.

    DDP sums the shards' gradients; the rounding of that sum is bounded by the size of its
    terms, not of its result, which can be far smaller when the terms cancel. These are
    the terms' sizes. The model's gradients, buffers (BatchNorm statistics) and RNG
    state are restored, so the reference trajectory is untouched.
    """
    import torch

    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    loss_scale = torch.zeros((), dtype=torch.float64)
    grad_scale: dict[str, Any] = {}
    for rank in range(shards):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(_forward(model, shard(inputs, rank, shards)), shard(targets, rank, shards))
        loss.backward()
        loss_scale += loss.detach().abs().double().cpu() / shards
        for n, p in model.named_parameters():
            if p.grad is not None:
                term = p.grad.detach().abs().double().cpu() / shards
                grad_scale[n] = grad_scale[n] + term if n in grad_scale else term
    for n, p in model.named_parameters():
        p.grad = grads[n]
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return loss_scale, grad_scale


def _sample_magnitudes(model: Any, loss_fn: Any, inputs: Any, targets: Any) -> tuple[Any, dict] | None:
    """Mean over samples of |sample loss| and |per-sample gradient|, in one vmapped pass.

    Every reordering of the batch sum (by shards, by all-reduce) rounds in proportion to
    the size of these terms. Returns None where per-sample gradients are not defined or
    not computable by ``torch.func`` (BatchNorm in training, randomness, exotic inputs);
    the caller then falls back to shard magnitudes.
    """
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def one(params: dict, x: Any, y: Any) -> Any:
        batch = map_tensors(x, lambda t: t.unsqueeze(0))
        args = batch if isinstance(batch, tuple) else (batch,)
        loss = loss_fn(functional_call(model, (params, buffers), args), map_tensors(y, lambda t: t.unsqueeze(0)))
        return loss, loss

    try:
        if isinstance(inputs, dict):
            return None
        per_grad, per_loss = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0))(params, inputs, targets)
    except Exception:  # not expressible per sample: use shards instead
        return None
    loss_scale = per_loss.detach().abs().double().mean().cpu()
    grad_scales = {n: g.detach().abs().double().mean(dim=0).cpu() for n, g in per_grad.items()}
    return loss_scale, grad_scales


def _nudge_towards_zero(model: Any, grad_scales: dict[str, Any], world_size: int, dtype: Any) -> None:
    """Move every gradient towards zero by the rounding a correct W-rank run may add:
    ``world_size`` ulps of the size of its summands (of itself where that is unknown)."""
    import torch

    eps = torch.finfo(dtype).eps
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            scale = grad_scales.get(n)
            size = scale.to(p.grad.device, p.grad.dtype) if scale is not None else p.grad.abs()
            p.grad.sub_(world_size * eps * size * torch.sign(p.grad))


def run_single(case: Case, state: dict[str, Any], device: str, twin_world_size: int = 0) -> Trace:
    """Mode ``single``: one device, the whole global batch.

    With ``twin_world_size`` W > 0 this is the calibration twin instead: every global
    batch in reversed sample order (the same mathematics, summed in another order), and
    every gradient nudged towards zero by the rounding a W-rank run may add, before the
    optimizer step. The twin's distance to the reference therefore contains both the
    reordering noise and what the optimizer and later steps make of worst-case rounding
    (Adam turns ulps of a near-zero gradient into visible update differences). It also
    records the size of the summands (per-sample, or per-shard) for the tolerance floor.
    """
    import torch

    model = _prepared(case, state, device)
    optimizer = make_optimizer(case, model.parameters())
    loss_fn = resolve_loss(case.loss)
    data = _data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    trace = Trace(mode="single", rank=0, world_size=1)
    for step in range(case.steps):
        inputs, targets = _global_batch(case, data, step, generator)
        size = batch_size(inputs)
        trace.batch_sizes.append(size if size is not None else -1)
        if twin_world_size and size:
            inputs, targets = reverse_samples(inputs, size), reverse_samples(targets, size)
        inputs, targets = _cast(inputs, case, device), _cast(targets, case, device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_forward(model, inputs), targets)
        loss.backward()
        scales = None
        if twin_world_size > 1:
            scales = _sample_magnitudes(model, loss_fn, inputs, targets)
            if scales is None and size and size % twin_world_size == 0:
                scales = _shard_magnitudes(model, loss_fn, inputs, targets, twin_world_size)
            _nudge_towards_zero(model, scales[1] if scales else {}, twin_world_size, case.torch_dtype)
        record = _snapshot(model, loss)
        if scales is not None:
            record.loss_scale, record.grad_scales = scales
        optimizer.step()
        _finish_step(record, model)
        trace.steps.append(record)
    return trace


def run_dp(case: Case, state: dict[str, Any], device: str, world_size: int) -> tuple[Trace, dict[str, str], bool]:
    """Mode ``dp``: ``torch.nn.DataParallel`` over ``world_size`` devices — real when that
    many CUDA devices exist, else emulated on ``device`` (:mod:`ddparity.harness.dp`).
    Returns the trace, DataParallel pitfalls found (name -> explanation) and whether the
    run was simulated."""
    import torch

    from ddparity.harness import dp

    model = _prepared(case, state, device)
    real = device.startswith("cuda") and torch.cuda.device_count() >= world_size > 1
    wrapped = torch.nn.DataParallel(model, device_ids=list(range(world_size))) if real else None
    optimizer = make_optimizer(case, model.parameters())
    loss_fn = resolve_loss(case.loss)
    data = _data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    trace = Trace(mode="dp", rank=0, world_size=world_size)
    notes: dict[str, str] = {}
    for step in range(case.steps):
        inputs, targets = _global_batch(case, data, step, generator)
        size = batch_size(inputs)
        trace.batch_sizes.append(size if size is not None else -1)
        inputs, targets = _cast(inputs, case, device), _cast(targets, case, device)
        optimizer.zero_grad(set_to_none=True)
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
            (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {}))
        if wrapped is not None:
            outputs = wrapped(*args, **kwargs)
            found = dp.DataParallelNotes()
            found.inspect_inputs(args, kwargs)
            found.inspect_module(model)
        else:
            outputs, found = dp.forward(model, world_size, args, kwargs)
        notes.update(found.items)
        loss = loss_fn(outputs, targets)
        loss.backward()
        record = _snapshot(model, loss)
        optimizer.step()
        _finish_step(record, model)
        trace.steps.append(record)
    return trace, notes, wrapped is None and world_size > 1


def dp_task(ctx: RankContext, case: Case, state: dict[str, Any],
            world_sizes: tuple[int, ...]) -> dict[int, tuple[Trace, dict[str, str], bool]]:
    """Mode ``dp`` at every requested world size, in one round trip."""
    return {ws: run_dp(case, state, ctx.device, ws) for ws in world_sizes}


def prepare_task(ctx: RankContext, case: Case) -> tuple[dict[str, Any], list[int]]:
    """The initial state (built once, from the factory and the seed) and the global batch
    size of every step, so the controller can validate shards before anything trains."""
    import torch

    state = initial_state(case)
    data = _data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    sizes = []
    for step in range(case.steps):
        inputs, _ = _global_batch(case, data, step, generator)
        size = batch_size(inputs)
        sizes.append(size if size is not None else -1)
    return state, sizes


def reference_task(
    ctx: RankContext, case: Case, state: dict[str, Any], world_sizes: tuple[int, ...] = ()
) -> tuple[Trace, Trace]:
    """The single-device reference and its calibration twin for the largest world size
    to be compared."""
    reference = run_single(case, state, ctx.device)
    twin = run_single(case, state, ctx.device, twin_world_size=max(world_sizes, default=1))
    return reference, twin


def ddp_task(ctx: RankContext, case: Case, state: dict[str, Any], detect: bool = True) -> Trace:
    """Mode ``ddp``: this rank's shard of every global batch under DDP.

    With ``detect`` (the default) the rank reports its phase at every stage of a step,
    its DDP bucket all-reduces go through the ledger's comm hook (wrapping the case's
    own hook, if any), and the fingerprints of its replica are published after every
    optimizer step, so the controller can judge hangs and desync.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddparity.harness import ddp_buckets, recorder
    from ddparity.harness.fingerprint import fingerprint

    rec = recorder.active() if detect else recorder.DISABLED
    if not detect:
        recorder.active().pause()
    rec.set_phase(-1, "build")
    model = _prepared(case, state, ctx.device)
    device_ids = [torch.device(ctx.device).index] if ctx.device.startswith("cuda") else None
    rec.set_phase(-1, "ddp")
    ddp = DistributedDataParallel(model, device_ids=device_ids, **case.ddp_options)
    buckets = None
    # Each rank its own hook state, as a rank process gets by unpickling (simulated ranks
    # share one process and would otherwise share one state).
    hook_state = copy.deepcopy(case.comm_hook_state)
    if detect and (case.comm_hook is not None or not ddp_buckets.BucketLayout.available(ddp)):
        # the case's own hook (or DDP's default one) wrapped to record each bucket
        ddp.register_comm_hook(*ddp_buckets.ddp_comm_hook(case.comm_hook, hook_state))
    elif detect:
        buckets = ddp_buckets.BucketLayout(ddp)
    elif case.comm_hook is not None:
        ddp.register_comm_hook(hook_state, case.comm_hook)
    optimizer = make_optimizer(case, ddp.parameters())
    loss_fn = resolve_loss(case.loss)
    data = _data_fn(case)
    generator = torch.Generator().manual_seed(case.seed)
    trace = Trace(mode="ddp", rank=ctx.rank, world_size=ctx.world_size)
    for step in range(case.steps):
        rec.set_phase(step, "forward")
        inputs, targets = _global_batch(case, data, step, generator)
        trace.batch_sizes.append(batch_size(inputs) or -1)
        inputs = _cast(shard(inputs, ctx.rank, ctx.world_size), case, ctx.device)
        targets = _cast(shard(targets, ctx.rank, ctx.world_size), case, ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_forward(ddp, inputs), targets)
        rec.set_phase(step, "backward")
        if buckets is not None:
            rec.ddp_buckets(buckets.current())
        loss.backward()  # returns after DDP's gradient all-reduce has finished
        # The objective DDP optimises is the mean of the ranks' losses (it averages grads).
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= ctx.world_size
        record = _snapshot(model, global_loss)
        rec.set_phase(step, "optimizer")
        optimizer.step()
        _finish_step(record, model)
        trace.steps.append(record)
        if detect:
            rec.set_phase(step, "fingerprint")
            part = None if step == case.steps - 1 else step  # everything at the last step
            rec.fingerprints(step, fingerprint(model, optimizer, buffers=not ddp.broadcast_buffers, part=part))
    rec.set_phase(case.steps, "done")
    return trace
